"""Replay of a CMD trace (docs/formats.md section 3) under another hardware profile.

Every operation of one rank's trace keeps its measured duration, except the MoE token
all-to-alls inside it (sub-operations with ``comm_func=all_to_all`` and ``group=exp``): each is
re-predicted as the cost model prices a collective, ``link_latency + bytes sent to other ranks /
link_bandwidth``, with the bytes from the sub-operation's shape and dtype (the buffer this rank
sends, split evenly over the ``ep_size`` ranks of the group, ``(ep_size - 1) / ep_size`` of it
leaving the rank) or from its ``in_splits`` when the trace has them (the rank's own split taken
at its rank modulo the group size). The replayed iteration is
the measured one (first start to last end on the rank) plus the sum of the changes: the
all-to-alls are assumed to sit on the rank's critical path, as they do in a synchronous
expert-parallel step.

Not done here: re-predicting the all-to-alls under another *strategy* needs the per-step count
matrices, which a CMD trace does not carry (record them with ``bench layer --save-counts``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from mixmoe.formats.cmd import read_cmd_trace
from mixmoe.placement.profile import HardwareProfile

__all__ = ["Replay", "replay_trace"]

_DTYPE_BYTES = {
    "torch.float32": 4,
    "torch.float": 4,
    "torch.float16": 2,
    "torch.half": 2,
    "torch.bfloat16": 2,
    "torch.int64": 8,
    "torch.int32": 4,
    "torch.float64": 8,
}


@dataclass(frozen=True)
class Replay:
    """Milliseconds: the measured iteration, its MoE all-to-alls measured and re-predicted, the
    replayed iteration; ``a2a_calls`` all-to-alls replayed, ``skipped`` those without a shape."""

    iteration_ms: float
    a2a_measured_ms: float
    a2a_predicted_ms: float
    replayed_ms: float
    a2a_calls: int
    skipped: int


def replay_trace(
    path: str | os.PathLike[str], profile: HardwareProfile, ep_size: int, rank: int | None = None
) -> Replay:
    """Replay the ops of ``rank`` (default: the first rank in the file) under ``profile``."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 2:
        raise ValueError(
            f"ep_size must be an int >= 2 (the expert-parallel group), got {ep_size!r}"
        )
    ops = read_cmd_trace(path)
    rank = ops[0].rank if rank is None else rank
    ops = [op for op in ops if op.rank == rank]
    if not ops:
        raise ValueError(f"{os.fspath(path)}: no operation of rank {rank}")
    spans = [
        (op.timestamp_ms - op.duration_ms, op.timestamp_ms)
        for op in ops
        if op.timestamp_ms is not None and op.duration_ms is not None
    ]
    if not spans:
        raise ValueError(f"{os.fspath(path)}: no operation with a duration and a timestamp")
    iteration = max(e for _, e in spans) - min(s for s, _ in spans)
    measured = predicted = 0.0
    calls = skipped = 0
    for op in ops:
        for sub in op.sub_ops:
            if sub.comm_func != "all_to_all" or sub.group != "exp" or sub.duration_ms is None:
                continue
            elem = _DTYPE_BYTES.get(sub.dtype or "")
            if sub.in_splits is not None and sub.shape and elem:
                row = math.prod(sub.shape[1:]) * elem
                own = sub.in_splits[rank % len(sub.in_splits)]  # rows that stay on this rank
                sent = (sum(sub.in_splits) - own) * row
            elif sub.shape and elem:
                sent = math.prod(sub.shape) * elem * (ep_size - 1) / ep_size
            else:
                skipped += 1
                continue
            measured += sub.duration_ms
            predicted += (profile.link_latency + sent / profile.link_bandwidth) * 1e3
            calls += 1
    return Replay(
        iteration_ms=iteration,
        a2a_measured_ms=measured,
        a2a_predicted_ms=predicted,
        replayed_ms=iteration - measured + predicted,
        a2a_calls=calls,
        skipped=skipped,
    )
