"""``mixmoe analyze profile FILE``: the MoE layer's breakdown in a torch.profiler table.

Prints gate, dispatch, all-to-all, experts, combine and rest as CPU and device time with their
shares of the layer, the layer's share of the step, and what the table cannot tell (e.g. async
collectives not attributed to any label). Definitions: ``mixmoe.report.profile_breakdown``;
the table is read by ``mixmoe.formats.profiler_table``.
"""

from __future__ import annotations

import argparse

from mixmoe.formats.profiler_table import read_profiler_table
from mixmoe.report.profile_breakdown import MoEBreakdown, moe_breakdown
from mixmoe.report.text_table import render_table

__all__ = ["add_arguments", "format_breakdown", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="text of key_averages().table()")
    parser.add_argument("--markdown", action="store_true", help="table as Markdown")


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


def _pct(part: float, whole: float | None) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def format_breakdown(b: MoEBreakdown, markdown: bool = False) -> str:
    """The breakdown as text; device columns are omitted for CPU-only tables."""
    dev = b.device
    rows: list[list[object]] = []
    for c in b.categories:
        labels = ", ".join(c.labels) or "(not found)"
        row: list[object] = [
            c.category,
            labels,
            c.calls,
            _ms(c.cpu_us),
            _pct(c.cpu_us, b.layer_cpu_us),
        ]
        if dev:
            row += [_ms(c.device_us), _pct(c.device_us, b.layer_device_us)]
        rows.append(row)
    if b.layer_label is not None:
        row = [
            "rest",
            "(layer - above)",
            "",
            _ms(b.rest_cpu_us),
            _pct(b.rest_cpu_us, b.layer_cpu_us),
        ]
        if dev:
            row += [_ms(b.rest_device_us), _pct(b.rest_device_us, b.layer_device_us)]
        rows.append(row)
    layer = [
        "MoE layer",
        b.layer_label or "(sum of categories)",
        b.layer_calls,
        _ms(b.layer_cpu_us),
        "100.0%",
    ]
    rows.append(layer + ([_ms(b.layer_device_us), "100.0%"] if dev else []))
    headers = ["stage", "labels", "calls", "CPU ms", "CPU %"]
    headers += [f"{dev} ms", f"{dev} %"] if dev else []
    out = [render_table(headers, rows, markdown=markdown), ""]
    if b.step_label is not None:
        line = (
            f"layer share of the step ({b.step_label}): CPU "
            f"{_pct(b.layer_cpu_us, b.step_cpu_us)} of {_ms(b.step_cpu_us or 0.0)} ms"
        )
        if dev and b.step_device_us:
            line += (
                f", {dev} {_pct(b.layer_device_us, b.step_device_us)} of {_ms(b.step_device_us)} ms"
            )
        out.append(line)
    out.append("what this table cannot tell:")
    out += [f"  - {note}" for note in b.notes]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    print(format_breakdown(moe_breakdown(read_profiler_table(args.file)), args.markdown))
    return 0
