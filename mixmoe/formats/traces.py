"""Per-rank trace files of either format, grouped by rank: what ``mixmoe analyze trace`` loads.

A file is a CMD trace (docs/formats.md section 3) or a Chrome trace JSON written by mixmoe
(section 5), told apart by its first non-blank character. Op names are normalised through
``mixmoe.formats.cmd_trace.OP_ALIASES`` either way. Torch-free.

``trace_count_steps`` rebuilds the count matrices C [W, N] of the recorded steps from the
``counts`` of the MoE layer's count exchanges (``mixmoe simulate --routing trace:PATH``):
the i-th count exchange of every rank is one step (every rank joins every exchange, in the same
order), its rows the ranks in ascending order.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from mixmoe.formats.chrome import read_chrome_trace
from mixmoe.formats.cmd_trace import CmdOp, normalised, read_cmd_trace

__all__ = ["read_traces", "trace_count_steps", "trace_paths"]


def _is_json(path: str | os.PathLike[str]) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(64).lstrip()
    return head.startswith(("{", "["))


def read_traces(paths: Iterable[str | os.PathLike[str]]) -> dict[int, list[CmdOp]]:
    """Ops of several trace files grouped by rank (ascending), each rank's ops in file order.

    Raises ValueError if two files hold the same rank.
    """
    by_rank: dict[int, list[CmdOp]] = {}
    origin: dict[int, str] = {}
    for path in paths:
        ops = normalised(read_chrome_trace(path)) if _is_json(path) else read_cmd_trace(path)
        ranks: dict[int, list[CmdOp]] = {}
        for op in ops:
            ranks.setdefault(op.rank, []).append(op)
        for rank, rank_ops in ranks.items():
            if rank in by_rank:
                raise ValueError(
                    f"rank {rank} appears in both {origin[rank]} and {os.fspath(path)}; "
                    "pass each rank's trace once"
                )
            by_rank[rank] = rank_ops
            origin[rank] = os.fspath(path)
    return dict(sorted(by_rank.items()))


def trace_paths(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` itself when it is a file; the ``*.txt`` and ``*.json`` files directly in it
    (sorted) when it is a directory (e.g. ``mixmoe bench layer --trace DIR``)."""
    where = Path(path)
    if where.is_dir():
        files = sorted(p for p in where.iterdir() if p.is_file() and p.suffix in (".txt", ".json"))
        if not files:
            raise FileNotFoundError(
                f"trace directory {os.fspath(path)!r} holds no *.txt or *.json trace file; record "
                "one with `mixmoe bench layer --world-size W --trace DIR`"
            )
        return files
    if not where.exists():
        raise FileNotFoundError(
            f"trace {os.fspath(path)!r} does not exist; pass a CMD or Chrome trace file, or the "
            "directory of `mixmoe bench layer --trace DIR`"
        )
    return [where]


def trace_count_steps(
    by_rank: dict[int, list[CmdOp]], where: str = "traces"
) -> list[list[list[int]]]:
    """The count matrices (each W lists of N ints, W = the ranks of ``by_rank`` in ascending
    order) of the recorded count exchanges, in the order they ran (module doc).

    Raises ValueError when no sub-operation carries ``counts`` (traces recorded before the field
    existed, or by another producer), or when the ranks recorded different numbers of exchanges
    or of experts (traces of different runs, or of part of a group)."""
    per_rank = {
        rank: [sub.counts for op in ops for sub in op.sub_ops if sub.counts is not None]
        for rank, ops in by_rank.items()
    }
    if not any(per_rank.values()):
        raise ValueError(
            f"{where}: no count exchange carries per-expert counts (the 'counts' key); record the "
            "traces with this mixmoe (`mixmoe bench layer --trace DIR`) or simulate from a counts "
            "file (`bench layer --save-counts FILE`, --routing counts:FILE)"
        )
    lengths = {rank: len(v) for rank, v in per_rank.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"{where}: the ranks recorded different numbers of count exchanges ({lengths}); pass "
            "the traces of one run, every rank of its expert-parallel group"
        )
    widths = {len(c) for v in per_rank.values() for c in v}
    if len(widths) != 1:
        raise ValueError(
            f"{where}: count exchanges of different expert counts N {sorted(widths)}; pass the "
            "traces of one layer configuration"
        )
    ranks = sorted(per_rank)
    steps = next(iter(lengths.values()))
    return [[list(per_rank[r][i]) for r in ranks] for i in range(steps)]
