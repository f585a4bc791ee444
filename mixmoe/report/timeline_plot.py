"""Timeline PNG of CMD traces: one lane per rank and role, ops coloured by kind.

Lanes, top to bottom per rank: ``rN ops`` (top-level ops), ``rN compute`` (compute/host
sub-operations) and ``rN comm`` (collective sub-operations); sub-op lanes appear only when the
rank has such sub-operations. The x axis is milliseconds from the earliest start. Ranks share the
time axis when their spans overlap (same host clock); otherwise each rank is shifted to start at
0 (different hosts' monotonic clocks are unrelated).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from mixmoe.formats.cmd_trace import CmdOp
from mixmoe.report.matplotlib_agg import pyplot
from mixmoe.report.trace_summary import phase_of

__all__ = ["COLORS", "plot_timeline"]

COLORS: dict[str, str] = {
    "data": "#9e9e9e",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "pipeline p2p": "#dd8452",
    "dp allreduce": "#c44e52",
    "ep-dp allreduce": "#8172b3",
    "optimizer": "#937860",
    "other": "#da8bc3",
    "moe compute": "#64b5cd",
    "moe comm": "#e377c2",
}


def _offsets(ops_by_rank: Mapping[int, Sequence[CmdOp]]) -> dict[int, float]:
    spans = {}
    for rank, ops in ops_by_rank.items():
        timed = [op for op in ops if op.is_timed]
        if timed:
            spans[rank] = (min(op.start_ms for op in timed), max(op.timestamp_ms for op in timed))
    if not spans:
        raise ValueError("no timed ops to plot")
    overlap = max(s for s, _ in spans.values()) < min(e for _, e in spans.values())
    if overlap or len(spans) == 1:
        origin = min(s for s, _ in spans.values())
        return dict.fromkeys(spans, origin)
    return {rank: s for rank, (s, _) in spans.items()}


def plot_timeline(
    ops_by_rank: Mapping[int, Sequence[CmdOp]],
    out_path: str | os.PathLike[str],
    title: str | None = None,
) -> Path:
    """Draw the timeline of ``ops_by_rank`` (rank -> ops) to a PNG at ``out_path``; returns it."""
    plt = pyplot()
    offsets = _offsets(ops_by_rank)
    lanes: list[tuple[str, dict[str, list[tuple[float, float]]]]] = []
    for rank in sorted(offsets):
        t0 = offsets[rank]
        ops_lane: dict[str, list[tuple[float, float]]] = {}
        compute: dict[str, list[tuple[float, float]]] = {}
        comm: dict[str, list[tuple[float, float]]] = {}
        for op in ops_by_rank[rank]:
            if not op.is_timed:
                continue
            ops_lane.setdefault(phase_of(op.name), []).append((op.start_ms - t0, op.duration_ms))
            for sub in op.sub_ops:
                if sub.start_ms is None:
                    continue
                lane, kind = (comm, "moe comm") if sub.is_comm else (compute, "moe compute")
                lane.setdefault(kind, []).append((sub.start_ms - t0, sub.duration_ms))
        lanes.append((f"r{rank} ops", ops_lane))
        if compute:
            lanes.append((f"r{rank} compute", compute))
        if comm:
            lanes.append((f"r{rank} comm", comm))
    fig, ax = plt.subplots(figsize=(14, max(2.5, 1.2 + 0.45 * len(lanes))))
    used: set[str] = set()
    for i, (_, kinds) in enumerate(lanes):
        y = len(lanes) - 1 - i
        for kind, bars in kinds.items():
            # sub-op bars get an outline so sub-pixel spans stay visible
            edge = COLORS[kind] if kind.startswith("moe") else "none"
            ax.broken_barh(
                bars, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolors=edge, linewidth=0.4
            )
            used.add(kind)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([name for name, _ in reversed(lanes)])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "mixmoe trace timeline")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in COLORS if k in used]
    labels = [k for k in COLORS if k in used]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
