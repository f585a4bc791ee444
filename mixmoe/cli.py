"""Command-line entry point: ``mixmoe <command> ...`` (also ``python -m mixmoe``).

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their command is chosen, so ``mixmoe --help`` stays fast and
optional dependencies (matplotlib, triton) are only touched by the commands that need them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# command words -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("demo",): ("mixmoe.bench.demo", "run the default CPU demo (strategy comparison benchmark)"),
    ("bench", "layer"): (
        "mixmoe.bench.layer",
        "benchmark one MoE layer (FORMATS.md section 1 log)",
    ),
    ("bench", "kernels"): ("mixmoe.bench.kernels", "benchmark grouped-GEMM providers"),
    ("bench", "peers"): (
        "mixmoe.bench.peers",
        "mixmoe vs transformers' Mixtral block (hf-eager/batched_mm/grouped_mm), CPU",
    ),
    ("analyze", "trace"): ("mixmoe.report.analyze_trace", "analyse CMD operation traces"),
    ("analyze", "profile"): ("mixmoe.report.analyze_profile", "analyse a torch.profiler table"),
    ("report",): ("mixmoe.report.report_cli", "tables and plots from benchmark logs"),
}


def _usage() -> str:
    lines = ["usage: mixmoe <command> [options]", "", "commands:"]
    for words, (_, text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<18} {text}")
    lines.append("")
    lines.append("`mixmoe <command> --help` shows the options of one command.")
    return "\n".join(lines)


def _match(argv: Sequence[str]) -> tuple[tuple[str, ...], list[str]] | None:
    for n in (2, 1):
        words = tuple(argv[:n])
        if words in COMMANDS:
            return words, list(argv[n:])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    found = _match(argv)
    if found is None:
        print(f"mixmoe: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    words, rest = found
    module = importlib.import_module(COMMANDS[words][0])
    parser = argparse.ArgumentParser(
        prog="mixmoe " + " ".join(words), description=COMMANDS[words][1]
    )
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
