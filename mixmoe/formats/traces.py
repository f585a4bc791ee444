"""Per-rank trace files of either format, grouped by rank: what ``mixmoe analyze trace`` loads.

A file is a CMD trace (docs/formats.md section 3) or a Chrome trace JSON written by mixmoe
(section 5), told apart by its first non-blank character. Op names are normalised through
``mixmoe.formats.cmd.OP_ALIASES`` either way. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from mixmoe.formats.chrome import read_chrome_trace
from mixmoe.formats.cmd import CmdOp, normalised, read_cmd_trace

__all__ = ["read_traces"]


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
