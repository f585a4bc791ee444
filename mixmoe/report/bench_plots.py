"""PNG plots of benchmark statistics (``mixmoe.report.run_stats.RunStats``); matplotlib loads lazily.

- ``plot_step_vs_experts``: median step time against experts per rank, one line per system.
- ``plot_forward_backward``: stacked median forward + backward bars per (system, experts).
- ``plot_model_bars``: median step time per model (and experts), one bar per variant.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixmoe.report.matplotlib_agg import pyplot
from mixmoe.report.run_stats import RunStats

__all__ = ["plot_forward_backward", "plot_model_bars", "plot_step_vs_experts"]


def _save(fig: Any, out_path: str | os.PathLike[str]) -> Path:
    plt = pyplot()
    out = Path(out_path)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_step_vs_experts(stats: Sequence[RunStats], out_path: str | os.PathLike[str]) -> Path:
    """Line plot: x = experts per rank, y = median step ms, one line per system."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(s.system for s in stats):
        pts = sorted((s.experts or 0, s.median_step_ms) for s in stats if s.system == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xlabel("experts per rank")
    ax.set_ylabel("median step time (ms)")
    ax.set_title("layer step time vs experts")
    ax.set_xticks(sorted({s.experts or 0 for s in stats}))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out_path)


def plot_forward_backward(stats: Sequence[RunStats], out_path: str | os.PathLike[str]) -> Path:
    """Stacked bars: median forward (bottom) + median backward per (system, experts)."""
    plt = pyplot()
    rows = [
        s for s in stats if s.median_forward_ms is not None and s.median_backward_ms is not None
    ]
    if not rows:
        raise ValueError("no forward/backward times in these logs to plot")
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows) + 2), 4.5))
    x = range(len(rows))
    fwd = [s.median_forward_ms or 0.0 for s in rows]
    bwd = [s.median_backward_ms or 0.0 for s in rows]
    ax.bar(x, fwd, label="forward", color="#4c72b0")
    ax.bar(x, bwd, bottom=fwd, label="backward", color="#55a868")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{s.system}\nE={s.experts}" for s in rows], rotation=30, ha="right")
    ax.set_ylabel("median time (ms)")
    ax.set_title("forward / backward per system")
    ax.legend()
    return _save(fig, out_path)


def plot_model_bars(stats: Sequence[RunStats], out_path: str | os.PathLike[str]) -> Path:
    """Grouped bars: one group per (model, experts), one bar per variant (median step ms)."""
    plt = pyplot()
    groups = list(dict.fromkeys((s.model, s.experts) for s in stats))
    variants = list(dict.fromkeys(s.system for s in stats))
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(groups) + 2), 4.5))
    for i, variant in enumerate(variants):
        by_group = {(s.model, s.experts): s.median_step_ms for s in stats if s.system == variant}
        xs = [g + i * width for g, key in enumerate(groups) if key in by_group]
        ys = [by_group[key] for key in groups if key in by_group]
        ax.bar(xs, ys, width=width, label=variant)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{m}\nE={e}" for m, e in groups])
    ax.set_ylabel("median step time (ms)")
    ax.set_title("model step time per variant")
    ax.legend()
    return _save(fig, out_path)
