"""Suite-wide guard: when the whole suite runs, every folder holding test files must have been
collected (pytest silently skips some folder names by default; a tier that never runs is a
failure, not a pass). Also the Hypothesis profile ``mutation`` (``make mutation`` selects it:
tests/mutation/run_mutation.py): no example database, fixed examples."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

try:  # hypothesis is a dev dependency (make test installs it); the profile is for mutation runs
    from hypothesis import settings

    settings.register_profile("mutation", database=None, derandomize=True)
except ImportError:  # pragma: no cover
    pass


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
