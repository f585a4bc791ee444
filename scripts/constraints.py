"""The pinned installs: write ``constraints.txt`` from a venv's ``pip freeze``, and report how
another venv's freeze differs from it. Standard library only (runs before anything is installed).

    pip freeze --all --exclude-editable | python scripts/constraints.py write > constraints.txt
    python scripts/constraints.py diff constraints.txt FREEZE.txt

``write`` keeps every ``name==version`` line but mixmoe itself, drops local version labels
(``torch==2.13.0+cpu`` -> ``torch==2.13.0``: the same constraint then admits the CPU and the CUDA
builds of one release) and puts torch first (the Makefile installs it first). ``diff`` prints one
line per package whose version changed, appeared or went away, and a count; it exits 0 (a report,
not a verdict: the tests decide).
"""

from __future__ import annotations

import sys
from pathlib import Path

HEADER = """\
# The tested versions of every package `make venv` installs (pip constraints: `pip install -c`).
# Regenerate from a venv that `make venv` built and the tests passed in: `make constraints`.
# torch first; local labels (+cpu, +cu128) dropped so one pin fits every build of a release.
"""
SKIP = {"mixmoe"}


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    out = name.strip().lower()
    for ch in "_.":
        out = out.replace(ch, "-")
    while "--" in out:
        out = out.replace("--", "-")
    return out


def parse_pins(lines: list[str]) -> dict[str, tuple[str, str]]:
    """``{canonical name: (name as written, version without local label)}`` from ``name==version``
    lines; comments, editables and other forms are ignored."""
    pins: dict[str, tuple[str, str]] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if "==" not in line or line.startswith("-"):
            continue
        name, version = (part.strip() for part in line.split("==", 1))
        pins[canonical(name)] = (name, version.split("+", 1)[0])
    return pins


def write(freeze_lines: list[str]) -> str:
    """The constraints file text for a freeze (torch first, then by name)."""
    pins = {k: v for k, v in parse_pins(freeze_lines).items() if k not in SKIP}
    if "torch" not in pins:
        raise SystemExit("constraints: the freeze has no torch==...; run it in the project venv")
    order = ["torch"] + sorted(k for k in pins if k != "torch")
    return HEADER + "".join(f"{pins[k][0]}=={pins[k][1]}\n" for k in order)


def diff(pinned: dict[str, tuple[str, str]], got: dict[str, tuple[str, str]]) -> list[str]:
    """One line per changed / new / gone package, by name."""
    out = []
    for key in sorted(set(pinned) | set(got)):
        if key in SKIP:
            continue
        old = pinned.get(key, (key, None))[1]
        new = got.get(key, (key, None))[1]
        if old == new:
            continue
        if old is None:
            out.append(f"  + {key} {new} (not in the constraints)")
        elif new is None:
            out.append(f"  - {key} {old} (pinned, not installed)")
        else:
            out.append(f"  ~ {key} {old} -> {new}")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"] and len(argv) == 1:
        sys.stdout.write(write(sys.stdin.read().splitlines()))
        return 0
    if argv[:1] == ["diff"] and len(argv) == 3:
        pinned, got = (parse_pins(Path(p).read_text().splitlines()) for p in argv[1:])
        lines = diff(pinned, got)
        print(f"{argv[2]} vs {argv[1]}: {len(lines)} package(s) differ")
        print("\n".join(lines) if lines else "  (none)")
        return 0
    print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
