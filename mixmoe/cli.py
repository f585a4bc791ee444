"""Command-line entry point: ``mixmoe <command> ...`` (also ``python -m mixmoe``).

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``
(``mixmoe.commands``); registering it in ``COMMANDS`` is all it takes. A command's module is
imported only when that command is chosen (or its help is asked for), so ``mixmoe --help`` stays
fast and optional dependencies are only touched by the commands that need them.

The error contract, enforced here for every command (those added later included):

- a user error (bad flag or value, missing file, missing optional dependency) prints one line,
  ``mixmoe: error: <what is wrong and the fix>``, to stderr and exits with status 2 (argparse's
  convention for usage errors); user errors are argparse errors and ``ValueError``,
  ``TypeError``, ``OSError`` and ``ImportError`` raised by the command;
- ``--debug`` (anywhere on the line) shows the full traceback instead;
- anything else is a bug in mixmoe and keeps its traceback;
- Ctrl-C prints ``mixmoe: interrupted`` and exits with 130.

Help texts show each option's default.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["COMMANDS", "USER_ERRORS", "build_parser", "main"]

# command words -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("demo",): ("mixmoe.commands.demo", "run the default CPU demo (strategy comparison benchmark)"),
    ("train",): (
        "mixmoe.commands.train",
        "train GPT-2 / BERT / Transformer-XL / Mixtral with MoE FFNs on the pydoc corpus",
    ),
    ("bench", "layer"): (
        "mixmoe.commands.bench_layer",
        "benchmark one MoE layer (docs/formats.md section 1 log)",
    ),
    ("bench", "model"): (
        "mixmoe.commands.bench_model",
        "benchmark whole-model training steps per variant (docs/formats.md section 2 log)",
    ),
    ("bench", "kernels"): ("mixmoe.commands.bench_kernels", "benchmark grouped-GEMM providers"),
    ("bench", "peers"): (
        "mixmoe.commands.bench_peers",
        "mixmoe vs transformers' Mixtral block (hf-eager/batched_mm/grouped_mm), CPU",
    ),
    ("bench", "hf"): (
        "mixmoe.commands.bench_hf",
        "transformers MoE training step: all_to_all vs mixmoe EP implementations (FSDP x EP)",
    ),
    ("bench", "planner"): (
        "mixmoe.commands.bench_planner",
        "time the mixed strategy's planner against the step it plans",
    ),
    ("bench", "balance"): (
        "mixmoe.commands.bench_balance",
        "imbalance workloads: a2a / shadow / mix vs the force-balanced step (cost model)",
    ),
    ("calibrate",): (
        "mixmoe.commands.calibrate",
        "measure this machine's hardware profile (GEMM rate, all_to_all) as JSON",
    ),
    ("simulate",): (
        "mixmoe.commands.simulate",
        "predict a2a / shadow / mix step times for a layer shape, routing and profile",
    ),
    ("analyze", "trace"): ("mixmoe.commands.analyze_trace", "analyse CMD operation traces"),
    ("analyze", "profile"): ("mixmoe.commands.analyze_profile", "analyse a torch.profiler table"),
    ("report",): ("mixmoe.commands.report", "tables and plots from benchmark logs"),
    ("checkpoint", "consolidate"): (
        "mixmoe.commands.checkpoint",
        "a sharded training checkpoint (step-N directory) as one --save file",
    ),
    ("checkpoint", "shard"): (
        "mixmoe.commands.checkpoint",
        "a --save file as a sharded training checkpoint (step-N directory)",
    ),
    ("checkpoint", "export"): (
        "mixmoe.commands.checkpoint",
        "a --model mixtral training checkpoint as a transformers model (save_pretrained)",
    ),
}
# the exceptions a command raises for bad input; everything else is a bug and keeps its traceback
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError, ImportError)
GROUP_HELP = {
    "bench": "benchmarks",
    "analyze": "trace and profile analyses",
    "checkpoint": "training checkpoint conversions",
}
DEBUG_FLAG = "--debug"


class UsageError(Exception):
    """A command line argparse could not parse (raised instead of printing usage and exiting)."""

    def __init__(self, prog: str, message: str) -> None:
        where = prog.removeprefix("mixmoe").strip()
        super().__init__(f"{where}: {message}" if where else message)
        self.prog = prog


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the default is None/False or the help
    already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            text = f"{text} (default: {str(shown).replace('%', '%%')!s})".strip()
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(self.prog, f"{message} (see '{self.prog} --help')")


def _add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        DEBUG_FLAG,
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, show the full traceback instead of one line",
    )


def build_parser(load: Iterable[tuple[str, ...]] | None = None) -> argparse.ArgumentParser:
    """The whole command tree. The options of the commands in ``load`` (all when None) are
    added by importing their modules; the others only have their help line."""
    wanted = set(COMMANDS) if load is None else set(load)
    root = _Parser(
        prog="mixmoe",
        description="Mixture-of-Experts training for PyTorch: benchmarks, trace and profile "
        "analyses, reports.",
        epilog="`mixmoe <command> --help` shows the options of one command.",
    )
    _add_debug(root)
    groups: dict[tuple[str, ...], Any] = {(): root.add_subparsers(metavar="COMMAND")}
    groups[()].required = True
    for words, (module_name, text) in COMMANDS.items():
        for depth in range(1, len(words)):
            prefix = words[:depth]
            if prefix not in groups:
                parent = groups[prefix[:-1]]
                sub = parent.add_parser(
                    prefix[-1], help=GROUP_HELP.get(prefix[-1], ""), description=None
                )
                _add_debug(sub)
                groups[prefix] = sub.add_subparsers(metavar="COMMAND")
                groups[prefix].required = True
        leaf = groups[words[:-1]].add_parser(words[-1], help=text, description=text)
        leaf.set_defaults(_command=words)
        if words in wanted:
            importlib.import_module(module_name).add_arguments(leaf)
        _add_debug(leaf)
    return root


def _match(argv: Sequence[str]) -> tuple[str, ...] | None:
    for n in (2, 1):
        words = tuple(argv[:n])
        if words in COMMANDS:
            return words
    return None


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _out_of_memory(exc: BaseException) -> str | None:
    """One line for an allocation that failed (``MemoryError``, torch's CPU allocator or CUDA
    out of memory), or None for any other error: the sizes the command was given were too
    large for this machine, not a bug."""
    if isinstance(exc, MemoryError):
        what = str(exc) or "a Python allocation failed"
    elif isinstance(exc, RuntimeError) and (
        "can't allocate memory" in str(exc) or isinstance(exc, _torch_oom())
    ):
        found = re.search(r"allocate (\d+) bytes", str(exc))
        what = (
            f"tried to allocate {int(found.group(1)) / 2**30:.1f} GiB"
            if found
            else _one_line(exc)[:200]
        )
    else:
        return None
    return f"out of memory: {what}; use smaller sizes (ranks, experts, tokens, batch)"


def _torch_oom() -> tuple[type[BaseException], ...]:
    """torch's out-of-memory error type where torch is imported (no import here)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return (oom,) if isinstance(oom, type) else ()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = DEBUG_FLAG in argv[:end]
    argv = [a for i, a in enumerate(argv) if i >= end or a != DEBUG_FLAG]
    try:
        if not argv:
            build_parser(load=()).print_help()
            return 0
        words = _match(argv)
        args = build_parser(load=[words] if words else ()).parse_args(argv)
        module = importlib.import_module(COMMANDS[args._command][0])
        return int(module.run(args) or 0)
    except SystemExit as exc:  # --help, or a command that exits on purpose
        if isinstance(exc.code, str):
            print(f"mixmoe: error: {exc.code}", file=sys.stderr)
            return 2
        return int(exc.code or 0)
    except KeyboardInterrupt:
        print("mixmoe: interrupted", file=sys.stderr)
        return 130
    except (UsageError, *USER_ERRORS) as exc:
        if debug:
            traceback.print_exc()
        print(f"mixmoe: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        lines = getattr(exc, "user_lines", None)  # a failed multi-rank run: one line per rank
        oom = None if lines else _out_of_memory(exc)
        if oom is not None:
            if debug:
                traceback.print_exc()
            print(f"mixmoe: error: {oom}", file=sys.stderr)
            return 2
        if not lines:
            raise
        if debug:
            print(str(exc), file=sys.stderr)
        for line in lines:
            print(f"mixmoe: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
