"""``mixmoe analyze trace FILE...``: where the time goes in per-rank CMD traces.

Prints, per rank: phase totals (pipeline send/recv with fused pairs counted once; finalize =
data-parallel + expert-data-parallel all-reduce + optimizer), host gaps, the measured pipeline
bubble against the ideal 1F1B bubble, the MoE communication share of forward and backward,
per-call statistics of each collective and the expert load where the trace reveals it.
Definitions: ``mixmoe.report.trace_summary``; files: ``mixmoe.formats.traces``.
``--timeline out.png`` draws all ranks.
"""

from __future__ import annotations

import argparse
import math

from mixmoe.formats.traces import read_traces
from mixmoe.report.text_table import render_table
from mixmoe.report.trace_summary import (
    FINALIZE_PHASES,
    RankSummary,
    cross_rank_load_imbalance,
    summarize_rank,
)

__all__ = ["add_arguments", "format_rank", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="CMD trace files (one per rank) or mixmoe Chrome trace JSON",
    )
    parser.add_argument(
        "--timeline", metavar="PNG", help="write a timeline plot here (needs matplotlib)"
    )
    parser.add_argument("--stages", type=int, help="pipeline stages P (default: inferred)")
    parser.add_argument(
        "--microbatches", type=int, help="micro-batches per iteration M (default: inferred)"
    )
    parser.add_argument("--markdown", action="store_true", help="tables as Markdown")


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _phase_table(s: RankSummary, markdown: bool) -> str:
    rows: list[list[object]] = []
    for phase in ("data", "forward", "backward", "pipeline p2p"):
        pairs = s.fused_p2p_pairs
        note = f"{pairs} fused send+recv counted once" if phase == "pipeline p2p" and pairs else ""
        rows.append([phase, f"{s.phase_ms[phase]:.3f}", _pct(s.phase_ms[phase], s.span_ms), note])
    rows.append(["finalize", f"{s.finalize_ms:.3f}", _pct(s.finalize_ms, s.span_ms), ""])
    for phase in FINALIZE_PHASES:
        rows.append(
            [f"  {phase}", f"{s.phase_ms[phase]:.3f}", _pct(s.phase_ms[phase], s.span_ms), ""]
        )
    if s.phase_ms["other"] or s.unknown_ops:
        other = ", ".join(s.unknown_ops)
        rows.append(
            ["other", f"{s.phase_ms['other']:.3f}", _pct(s.phase_ms["other"], s.span_ms), other]
        )
    gap_note = f"{s.gaps} gaps, largest {s.largest_gap_ms:.3f} ms"
    rows.append(["host gaps", f"{s.gap_ms:.3f}", _pct(s.gap_ms, s.span_ms), gap_note])
    return render_table(["phase", "ms", "of span", "note"], rows, markdown=markdown)


def _bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _collective_table(s: RankSummary, markdown: bool) -> str:
    rows = []
    for c in sorted(s.collectives, key=lambda c: (c.where, c.op, str(c.shape))):
        shape = "x".join(map(str, c.shape)) if c.shape is not None else None
        size = _bytes(c.bytes_per_call) if c.bytes_per_call is not None else None
        gbps = f"{c.gbps:.3g}" if c.gbps is not None else None
        dtype = c.dtype.removeprefix("torch.") if c.dtype else None
        rows.append(
            [
                c.where,
                c.op,
                c.group,
                shape,
                dtype,
                c.calls,
                f"{c.mean_ms:.3f}",
                f"{c.min_ms:.3f}",
                f"{c.max_ms:.3f}",
                size,
                gbps,
            ]
        )
    headers = [
        "in",
        "collective",
        "group",
        "shape",
        "dtype",
        "calls",
        "mean ms",
        "min ms",
        "max ms",
        "bytes/call",
        "GB/s",
    ]
    return render_table(headers, rows, markdown=markdown)


def _sub_op_table(s: RankSummary, markdown: bool) -> str:
    rows = []
    ordered = sorted(s.sub_op_ms.items(), key=lambda item: item[0][0])  # stable: by first use
    for (phase, label, kind), (n, ms) in ordered:
        rows.append([phase, label, kind, n, f"{ms:.3f}", _pct(ms, s.phase_ms.get(phase, 0.0))])
    headers = ["in", "sub-operation", "kind", "calls", "ms", "of phase"]
    return render_table(headers, rows, markdown=markdown)


def format_rank(s: RankSummary, markdown: bool = False) -> str:
    """The report of one rank as text (``markdown`` switches the tables to Markdown)."""
    stage = f" (stage {s.stage_id})" if s.stage_id is not None else ""
    untimed = f", {s.untimed_ops} without timing" if s.untimed_ops else ""
    out = [
        f"rank {s.rank}{stage}: {s.ops} ops{untimed}, span {s.span_ms:.3f} ms "
        "(first start to last end)",
        "",
        _phase_table(s, markdown),
        "",
    ]
    b = s.bubble
    if b is not None:
        rest = b.idle_ms - b.p2p_ms - b.data_ms
        out.append(
            f"pipeline bubble: P={b.stages} stages, M={b.microbatches} micro-batches; measured "
            f"{100 * b.measured:.2f}% of the {b.window_ms:.3f} ms pipeline window (idle "
            f"{b.idle_ms:.3f} ms = p2p {b.p2p_ms:.3f} + data {b.data_ms:.3f} + gaps {rest:.3f}) "
            f"vs ideal 1F1B (P-1)/(M+P-1) = {100 * b.ideal:.2f}%"
        )
    else:
        out.append(f"pipeline bubble: n/a ({s.bubble_note})")
    shares = []
    for phase in ("forward", "backward"):
        share = s.moe_comm_share(phase)
        if share is not None:
            shares.append(f"{phase} {s.moe_comm_ms.get(phase, 0.0):.3f} ms = {100 * share:.2f}%")
    out.append("MoE communication (collective sub-operations): " + ("; ".join(shares) or "none"))
    if s.load is not None:
        ld = s.load
        sent = sum(ld.sent_rows) / ld.calls
        recv = sum(ld.received_rows) / ld.calls
        how = "split sizes" if ld.source == "splits" else "all-to-all shapes (dispatch, combine)"
        line = (
            f"expert load (from {how}, {ld.calls} dispatches): rows sent {sent:.1f}, received "
            f"{recv:.1f} per dispatch -> this rank's experts carry {ld.load_factor:.3f}x a "
            "balanced share"
        )
        if ld.destination_imbalance is not None:
            line += f"; destinations max/mean {ld.destination_imbalance:.3f}"
        out.append(line)
    if s.sub_op_ms:
        out += ["", "sub-operations:", _sub_op_table(s, markdown)]
    if s.collectives:
        out += [
            "",
            "collectives, per call (GB/s = bytes of the input / mean duration):",
            _collective_table(s, markdown),
        ]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    for name in ("stages", "microbatches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    by_rank = read_traces(args.files)
    summaries = [
        summarize_rank(ops, stages=args.stages, microbatches=args.microbatches)
        for ops in by_rank.values()
    ]
    print("\n\n".join(format_rank(s, args.markdown) for s in summaries))
    cross = cross_rank_load_imbalance(summaries)
    if cross is not None and not math.isnan(cross):
        print(f"\nexpert load across ranks: max/mean rows received per dispatch = {cross:.3f}")
    if args.timeline:
        from mixmoe.report.timeline_plot import plot_timeline

        path = plot_timeline(by_rank, args.timeline)
        print(f"\ntimeline written to {path}")
    return 0
