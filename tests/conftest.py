"""Suite-wide guard: when the whole suite runs, every folder holding test files must have been
collected (pytest silently skips some folder names by default; a tier that never runs is a
failure, not a pass); every test gets a tier marker (``unit``, ``dist``, ``kernels``, ``hf``,
``gpu``) from its folder when it marks none. Also the Hypothesis profile ``mutation`` (``make mutation`` selects it:
scripts/mutation/run_mutation.py): no example database, fixed examples."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# helpers shared by test folders (tests mirror the package tree: one folder per package)
sys.path.insert(0, str(HERE / "helpers"))

# Without a GPU the Triton kernels run under the CPU interpreter (tests/kernels/conftest.py). The
# interpreter is chosen when a function is decorated, triton.language's own helpers included, so it
# is set here, before any test module is collected: several import transformers, whose MoE
# integration imports triton, and a triton imported compiled cannot be interpreted later.
if os.environ.get("TRITON_INTERPRET") is None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

try:  # hypothesis is a dev dependency (make test installs it); the profile is for mutation runs
    from hypothesis import settings

    settings.register_profile("mutation", database=None, derandomize=True)
except ImportError:  # pragma: no cover
    pass


def pytest_sessionstart(session: pytest.Session) -> None:
    """The planner's compiled parts (``native_lib``) built once, before any test: otherwise the first multi-rank test
    would build it in every rank at once (``tests/placement/test_native_fill.py`` checks it is
    available; a failed build here leaves the planner on its Python fill)."""
    from mixmoe.placement import native_lib

    native_lib.available()


TIERS = ("unit", "dist", "kernels", "hf", "gpu")


def _tier(item: pytest.Item) -> str:
    """The tier a test belongs to when it marks none: its folder (``kernels``), a transformers
    test file (``hf`` in its name), else ``unit``."""
    path = Path(str(item.fspath)).resolve().relative_to(HERE)
    if path.parts[0] == "kernels":
        return "kernels"
    if "hf" in path.stem.split("_"):
        return "hf"
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, _tier(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if config.option.keyword or config.option.markexpr:
        return  # a filtered run may legitimately leave folders out
    if [Path(a).resolve() for a in config.args] != [HERE]:
        return
    expected = {p.parent for p in HERE.rglob("test_*.py")}
    collected = {Path(str(item.fspath)).resolve().parent for item in session.items}
    missing = sorted(str(p.relative_to(HERE)) for p in expected - collected)
    if missing:
        raise pytest.UsageError(f"test folders that were never collected: {missing}")
