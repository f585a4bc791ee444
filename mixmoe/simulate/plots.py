"""PNG plots of simulator predictions (matplotlib loads lazily, ``mixmoe.report.matplotlib_agg``).

- ``plot_rank_bars``: one panel per strategy, per-rank stacked bars of compute, exposed token
  communication and replica transfer (ms), the predicted step as a dashed line.
- ``plot_sweep``: predicted step time per strategy against a swept quantity (W, or the routing).
- ``plot_balance``: % of force-balanced per workload and strategy, one panel per (shape, W)
  (``mixmoe bench balance``'s records, ``mixmoe.simulate.workloads``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from mixmoe.report.matplotlib_agg import pyplot
from mixmoe.simulate.layer import StrategyPrediction

__all__ = ["plot_balance", "plot_rank_bars", "plot_sweep"]


def plot_rank_bars(
    preds: Mapping[str, StrategyPrediction], out_path: str | os.PathLike[str], title: str = ""
) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(preds), figsize=(4.5 * len(preds), 4), sharey=True, squeeze=False
    )
    for ax, (name, p) in zip(axes[0], preds.items(), strict=True):
        W = len(p.compute_W)
        x = list(range(W))
        compute = [v * 1e3 for v in p.compute_W]
        token = [max(0.0, (e - w) * 1e3) for e, w in zip(p.exposed_W, p.weight_W, strict=True)]
        weight = [v * 1e3 for v in p.weight_W]
        width = 0.8 if W <= 64 else 1.0
        ax.bar(x, compute, width, label="compute")
        ax.bar(x, token, width, bottom=compute, label="exposed token a2a")
        ax.bar(
            x,
            weight,
            width,
            bottom=[c + t for c, t in zip(compute, token, strict=True)],
            label="replica transfer",
        )
        ax.axhline(p.step_s * 1e3, color="k", linestyle="--", linewidth=1)
        ax.set_title(f"{name}: {p.step_s * 1e3:.3g} ms, {p.replicas} replicas")
        ax.set_xlabel("rank")
    axes[0][0].set_ylabel("predicted ms per layer step (fwd + bwd)")
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, out_path)


def plot_sweep(
    points: Sequence[tuple[str, str, float]], xlabel: str, out_path: str | os.PathLike[str]
) -> Path:
    """``points``: (x label, strategy, step seconds); x in first-seen order."""
    plt = pyplot()
    xs = list(dict.fromkeys(x for x, _, _ in points))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in dict.fromkeys(s for _, s, _ in points):
        got = {x: t for x, s, t in points if s == strategy}
        ax.plot(
            [i for i, x in enumerate(xs) if x in got],
            [got[x] * 1e3 for x in xs if x in got],
            marker="o",
            label=strategy,
        )
    ax.set_xticks(range(len(xs)), xs)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("predicted layer step (ms)")
    ax.set_yscale("log")
    ax.legend()
    return _save(fig, out_path)


def plot_balance(records: Sequence[Mapping[str, object]], out_path: str | os.PathLike[str]) -> Path:
    """Grouped bars of 100 x pct_balanced (capped at 100) per workload, one bar per strategy,
    one panel per (shape, W) in first-seen order; a dotted line at 90%."""
    plt = pyplot()
    panels = list(dict.fromkeys((r["shape"], r["world_size"]) for r in records))
    strategies = list(dict.fromkeys(r["strategy"] for r in records))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (shape, W) in zip(axes.flat, panels, strict=False):
        mine = [r for r in records if (r["shape"], r["world_size"]) == (shape, W)]
        workloads = list(dict.fromkeys(r["workload"] for r in mine))
        pct = {(r["workload"], r["strategy"]): min(100.0, 100 * r["pct_balanced"]) for r in mine}
        width = 0.8 / len(strategies)
        for i, s in enumerate(strategies):
            xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(workloads))]
            ax.bar(xs, [pct.get((w, s), 0.0) for w in workloads], width, label=s)
        ax.axhline(90, color="k", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(workloads)), workloads, rotation=45, ha="right", fontsize=7)
        ax.set_ylim(0, 105)
        ax.set_title(f"{shape}, W={W}", fontsize=9)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("% of force-balanced (capped)")
    axes[0][0].legend(fontsize=7)
    return _save(fig, out_path)


def _save(fig, out_path: str | os.PathLike[str]) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out
