"""Import direction (docs/design.md, "Layers") and import-time hygiene.

``LAYERS`` must equal the table in docs/design.md (a test parses it). A module may import only
modules of its own layer or below; only ``mixmoe/comm/`` may import ``torch.distributed``.
The package root ``mixmoe/__init__.py`` is the public facade: it may import anything, and it counts
as the top layer when another module imports it (``from mixmoe import MoE`` inside ``ops`` pulls in
the whole package).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mixmoe

PACKAGE_DIR = Path(mixmoe.__file__).resolve().parent

LAYERS: dict[str, int] = {
    "config": 0,
    "types": 0,
    "validation": 0,
    "formats": 1,
    "schedule": 1,
    "placement": 1,
    "reference": 1,
    "tracing": 1,
    "kernels": 1,
    "gating": 1,
    "ops": 2,
    "comm": 2,
    "report": 2,
    "dispatch": 3,
    "layers": 4,
    "parallel": 5,
    "models": 5,
    "hf": 5,
    "train": 6,
    "simulate": 6,
    "bench": 7,
    "commands": 8,
    "cli": 8,
    "__main__": 8,
}
FACADE_LAYER = 8
DISTRIBUTED_OK = ("comm",)


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(tree: ast.AST, module: str, is_package: bool, root: Path) -> list[str]:
    """Absolute names of everything a module imports (lazy imports inside functions included)."""
    out: list[str] = []
    pkg_parts = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when it exists
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                rel = Path(*sub.split(".")[1:]) if sub.startswith(root.name + ".") else None
                if rel is not None and (
                    (root / rel).with_suffix(".py").exists() or (root / rel).is_dir()
                ):
                    out.append(sub)
                else:
                    out.append(target)
    return out


def _layer_of(name: str, root_name: str) -> int | None:
    """Layer of an absolute module name inside the package (None outside it)."""
    parts = name.split(".")
    if parts[0] != root_name:
        return None
    if len(parts) == 1:
        return FACADE_LAYER
    return LAYERS.get(parts[1], -1)


def import_violations(root: Path) -> list[str]:
    """Every import pointing up a layer, every unassigned top-level module, and every
    ``torch.distributed`` import outside ``comm``."""
    problems: list[str] = []
    root_name = root.name
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        parts = module.split(".")
        if len(parts) == 1:  # the facade
            own = FACADE_LAYER
            top = ""
        else:
            top = parts[1]
            own = LAYERS.get(top, -1)
            if own < 0:
                problems.append(
                    f"{module}: top-level module '{top}' has no layer; add it to LAYERS "
                    "(tests/project/test_imports.py) and to the table in docs/design.md"
                )
                continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in _imported_modules(tree, module, path.name == "__init__.py", root):
            if target == "torch.distributed" or target.startswith("torch.distributed."):
                if top not in DISTRIBUTED_OK:
                    problems.append(f"{module} imports {target}; only {root_name}/comm/ may")
                continue
            layer = _layer_of(target, root_name)
            if layer is None:
                continue
            if layer < 0:
                problems.append(f"{module} imports {target}, which has no layer")
            elif layer > own:
                problems.append(
                    f"{module} (L{own}) imports {target} (L{layer}): imports point down"
                )
    # `from torch import distributed` is spelled without the dotted name
    for path in sorted(root.rglob("*.py")):
        parts = _module_name(path, root).split(".")
        if len(parts) > 1 and parts[1] in DISTRIBUTED_OK:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "torch"
                and any(a.name == "distributed" for a in node.names)
            ):
                problems.append(f"{'.'.join(parts)} imports torch.distributed (from torch import)")
    return problems


def test_package_imports_point_down():
    assert import_violations(PACKAGE_DIR) == []


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))


@pytest.fixture
def fake_pkg(tmp_path: Path) -> Path:
    root = tmp_path / "mixmoe"
    _write(root, "__init__.py", "from mixmoe.layers.moe import MoE\n")
    _write(root, "config.py", "import torch\n")
    _write(root, "ops/__init__.py", "")
    _write(root, "ops/a.py", "from mixmoe.config import X\nfrom . import b\n")
    _write(root, "ops/b.py", "from ..schedule.blocks import B\n")
    _write(root, "schedule/__init__.py", "")
    _write(root, "schedule/blocks.py", "import torch\n")
    _write(root, "comm/__init__.py", "import torch.distributed as dist\n")
    _write(root, "layers/__init__.py", "")
    _write(root, "layers/moe.py", "from mixmoe.dispatch import local\nfrom mixmoe import ops\n")
    _write(root, "dispatch/__init__.py", "")
    _write(root, "dispatch/local.py", "def f():\n    from mixmoe.comm import x\n")
    return root


def test_scanner_accepts_a_clean_package(fake_pkg: Path):
    assert import_violations(fake_pkg) == []


@pytest.mark.parametrize(
    "rel,text,expected",
    [
        (
            "ops/c.py",
            "from mixmoe.layers.moe import MoE\n",
            "mixmoe.ops.c (L2) imports mixmoe.layers",
        ),
        (
            "ops/c.py",
            "def f():\n    from ..dispatch import local\n",
            "imports mixmoe.dispatch.local",
        ),
        ("schedule/c.py", "from mixmoe import MoE\n", "imports mixmoe (L8)"),
        ("config.py", "import mixmoe.gating.routing\n", "mixmoe.config (L0) imports mixmoe.gating"),
        ("dispatch/a2a.py", "import torch.distributed as dist\n", "only mixmoe/comm/ may"),
        ("ops/c.py", "from torch.distributed import all_reduce\n", "only mixmoe/comm/ may"),
        ("layers/c.py", "from torch import distributed\n", "(from torch import)"),
        ("utils.py", "import torch\n", "top-level module 'utils' has no layer"),
    ],
    ids=[
        "up-abs",
        "up-lazy-rel",
        "facade",
        "L0-up",
        "dist-import",
        "dist-from",
        "dist-attr",
        "unassigned",
    ],
)
def test_scanner_catches_violations(fake_pkg: Path, rel: str, text: str, expected: str):
    _write(fake_pkg, rel, text)
    problems = import_violations(fake_pkg)
    assert any(expected in p for p in problems), problems


HEAVY = ("matplotlib", "triton", "transformers")


def test_import_mixmoe_is_light_and_side_effect_free():
    """In a fresh interpreter: no optional dependency is imported, no process group is created."""
    code = (
        "import sys, torch, mixmoe\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "print(torch.distributed.is_available() and torch.distributed.is_initialized())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)},
    )
    assert proc.returncode == 0, f"`import mixmoe` failed: {proc.stderr}"
    heavy, initialized = proc.stdout.split("\n")[:2]
    assert heavy == "[]", f"`import mixmoe` imported {heavy}; import them lazily"
    assert initialized == "False"


def test_layers_match_the_design_doc():
    """The table under "## Layers" in docs/design.md lists exactly ``LAYERS``."""
    doc = PACKAGE_DIR.parent / "docs" / "design.md"
    documented: dict[str, int] = {}
    section = doc.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("L") and cells[0][1:].isdigit():
            for name in cells[1].split(","):
                documented[name.strip().strip("`")] = int(cells[0][1:])
    assert documented == LAYERS


def test_every_package_has_a_layer_and_exists():
    """No layer for a package that does not exist, no package without a layer."""
    present = {
        p.stem for p in PACKAGE_DIR.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    present.discard("__init__")
    assert present == set(LAYERS)
