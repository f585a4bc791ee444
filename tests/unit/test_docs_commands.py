"""Every ``mixmoe`` command in the README and docs/ parses with today's CLI (flags renamed or
removed would otherwise rot in the docs). Parsing only: nothing runs. Dated results under
docs/results/ keep the commands of their day and are not checked."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mixmoe.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_PAGES = {"mutation-log.md"}  # a dated log of runs


def _commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of every mixmoe invocation in the page's ```bash blocks, with
    continuation lines joined and comments dropped."""
    out, in_bash, pending, start = [], False, "", 0
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_bash = line.strip() in ("```bash", "```sh", "```console")
            continue
        if not in_bash:
            continue
        text = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not pending:
            start = n
        pending += " " + text.rstrip("\\").strip()
        if text.endswith("\\"):
            continue
        command, pending = pending.strip(), ""
        match = re.search(r"(?:^|\s)(?:-m\s+mixmoe|mixmoe)\s+(.*)$", command)
        if match and not command.startswith(("pip", "python -c")):
            out.append((start, match.group(1)))
    return out


CASES = [
    pytest.param(cmd, id=f"{page.name}:{n}")
    for page in PAGES
    if page.name not in SKIP_PAGES
    for n, cmd in _commands(page)
]


def test_the_docs_hold_commands() -> None:
    assert len(CASES) >= 20, "the README and docs/ should show the CLI; did the scanner break?"


@pytest.mark.parametrize("command", CASES)
def test_documented_command_parses(command: str) -> None:
    argv = [a for a in shlex.split(command) if a not in ("|", "&&")]
    build_parser().parse_args(argv)
