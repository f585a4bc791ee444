"""Pinned installs: constraints.txt pins every package `make venv` installs, the Makefile holds
every install to it, pyproject's extras start at the pinned releases, and scripts/constraints.py
writes and diffs freezes as documented."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "constraints_script", ROOT / "scripts/constraints.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pins() -> dict[str, str]:
    mod = _script()
    return {
        k: v
        for k, (_, v) in mod.parse_pins((ROOT / "constraints.txt").read_text().splitlines()).items()
    }


def test_constraints_file_pins_exact_releases_torch_first():
    lines = [
        ln
        for ln in (ROOT / "constraints.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "torch==2.13.0", lines[0]
    for ln in lines:
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", ln), ln  # no ranges, no +local
    assert "mixmoe" not in _pins()
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH   := torch==2.13.0" in makefile


def test_every_make_install_uses_the_constraints():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(STAMP): pyproject.toml $(PINS)\n", 1)[1].split("\n\n", 1)[0]
    installs = [ln for ln in recipe.splitlines() if "pip install" in ln]
    assert len(installs) == 3, installs
    assert all("-c $(PINS)" in ln for ln in installs), installs
    assert "PINS    := constraints.txt" in makefile
    latest = makefile.split("test-latest:\n", 1)[1].split("\n\n", 1)[0]
    assert "-c $(PINS)" not in latest and "scripts/constraints.py diff" in latest


def _release(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.match(r"[0-9.]+", v).group(0).rstrip(".").split("."))


def test_extras_lower_bounds_are_the_pinned_releases():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 has none
    section = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^(\w+) = \[(.*)\]$", section, re.M)
    pins = _pins()
    mod = _script()
    seen = 0
    for extra, listed in extras:
        for req in re.findall(r'"([^"]+)"', listed):
            name, op, bound = re.fullmatch(r"([A-Za-z0-9_.\-]+)(>=|==)(.+)", req).groups()
            pinned = pins.get(mod.canonical(name))
            assert pinned is not None, f"[{extra}] {name} is not in constraints.txt"
            lower = _release(bound)
            # the bound names the tested release: 5.24 for 5.24.0, 6.170 for 6.170.17
            assert _release(pinned)[: len(lower)] == lower, f"[{extra}] {req} vs pinned {pinned}"
            seen += 1
    assert seen >= 9


def test_write_and_diff():
    mod = _script()
    freeze = ["numpy==2.4.6", "torch==2.13.0+cpu", "Jinja2==3.1.6", "mixmoe==0.1.0", "-e /x", "# c"]
    text = mod.write(freeze)
    body = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert body == ["torch==2.13.0", "Jinja2==3.1.6", "numpy==2.4.6"]
    pinned = mod.parse_pins(body)
    got = mod.parse_pins(["torch==2.14.1+cu128", "jinja2==3.1.6", "rich==15.0.0"])
    assert mod.diff(pinned, got) == [
        "  - numpy 2.4.6 (pinned, not installed)",
        "  + rich 15.0.0 (not in the constraints)",
        "  ~ torch 2.13.0 -> 2.14.1",
    ]
