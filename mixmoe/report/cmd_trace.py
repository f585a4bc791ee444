"""Reader of per-rank CMD operation traces (FORMATS.md section 3), torch-free.

``read_cmd_trace(path)`` returns the file's ops in file order with op names normalised through
``OP_ALIASES`` (producers disagree: ``exp_dp_allreduce`` vs ``ep_dp_allreduce``). Every edge case
of the format is handled by the line grammar in ``mixmoe.tracing.cmd_format``: the six-field
short form, free-text descriptions with commas and parentheses, list-valued sub-operation keys,
unknown op names (kept as written), and truncated lines (ValueError naming ``path:line``).

``read_traces(paths)`` loads several files (CMD, or Chrome JSON written by mixmoe) and groups the
ops by rank.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from mixmoe.tracing.cmd_format import CmdOp, SubOp, read_cmd_file

__all__ = ["OP_ALIASES", "CmdOp", "SubOp", "canonical_op_name", "read_cmd_trace", "read_traces"]

# alias -> canonical op name
OP_ALIASES: dict[str, str] = {
    "exp_dp_allreduce": "ep_dp_allreduce",
    "expert_dp_allreduce": "ep_dp_allreduce",
    "ep_dp_all_reduce": "ep_dp_allreduce",
    "exp_dp_all_reduce": "ep_dp_allreduce",
    "dp_all_reduce": "dp_allreduce",
    "data_parallel_allreduce": "dp_allreduce",
    "forward": "forward_step",
    "backward": "backward_step",
    "optimizer": "optimizer_step",
    "optim_step": "optimizer_step",
    "load_batch": "get_batch",
}


def canonical_op_name(name: str) -> str:
    """``name`` mapped through ``OP_ALIASES``; unknown names are returned unchanged."""
    return OP_ALIASES.get(name, name)


def _normalised(ops: Iterable[CmdOp]) -> list[CmdOp]:
    out = []
    for op in ops:
        name = canonical_op_name(op.name)
        out.append(op if name == op.name else dataclasses.replace(op, name=name))
    return out


def read_cmd_trace(path: str | os.PathLike[str]) -> list[CmdOp]:
    """The ops of one CMD trace file, in file order, names normalised (see module docstring).

    Lines not starting with ``rank:`` are skipped; an empty result raises ValueError (wrong file).
    """
    ops = _normalised(read_cmd_file(path))
    if not ops:
        raise ValueError(
            f"{os.fspath(path)}: no 'rank:<R>:<op>(...)' lines found; is this a CMD trace?"
        )
    return ops


def _is_json(path: str | os.PathLike[str]) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(64).lstrip()
    return head.startswith(("{", "["))


def read_traces(paths: Iterable[str | os.PathLike[str]]) -> dict[int, list[CmdOp]]:
    """Ops of several trace files grouped by rank (ascending), each rank's ops in file order.

    A file may be a CMD trace or a Chrome trace JSON written by ``write_chrome_trace`` (detected
    by its first character). Raises ValueError if two files hold the same rank.
    """
    from mixmoe.report.chrome_trace import read_chrome_trace

    by_rank: dict[int, list[CmdOp]] = {}
    origin: dict[int, str] = {}
    for path in paths:
        ops = _normalised(read_chrome_trace(path)) if _is_json(path) else read_cmd_trace(path)
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
