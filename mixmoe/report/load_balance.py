"""Per-layer expert load of a training run: a summary table and a load heat-map.

Legend: N experts, S steps.

Input: the step records of one run (``StepRecord`` dicts or ``train.jsonl`` lines), each with a
``moe`` list of per-layer dicts (``mixmoe.train.balance_log``: ``layer``, ``load`` [N],
``max_over_mean``, ``cv``, ``dead``, ``replicas``, ``bias_min``, ``bias_max``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixmoe.report.text_table import render_table

HEADERS = [
    "layer",
    "steps",
    "max/mean first",
    "max/mean mid",
    "max/mean last",
    "cv last",
    "dead last",
    "replicas/step",
    "bias range last",
]


def layer_series(steps: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, dict]]]:
    """``{layer: [(step, layer dict), ...]}`` in step order, for the steps that carry one."""
    out: dict[str, list[tuple[int, dict]]] = {}
    for rec in steps:
        for layer in rec.get("moe") or ():
            out.setdefault(layer["layer"], []).append((rec["step"], layer))
    return out


def balance_rows(steps: Sequence[dict[str, Any]]) -> list[list[object]]:
    """One row per MoE layer (see ``HEADERS``); ``mid`` is the middle step of the run."""
    rows = []
    for name, series in layer_series(steps).items():
        first, mid, last = series[0][1], series[len(series) // 2][1], series[-1][1]
        bias = (
            None
            if last.get("bias_min") is None
            else f"[{last['bias_min']:+.4f}, {last['bias_max']:+.4f}]"
        )
        replicas = sum(d["replicas"] for _, d in series) / len(series)
        rows.append(
            [
                name or "(root)",
                len(series),
                f"{first['max_over_mean']:.3f}",
                f"{mid['max_over_mean']:.3f}",
                f"{last['max_over_mean']:.3f}",
                f"{last['cv']:.3f}",
                last["dead"],
                f"{replicas:.1f}",
                bias,
            ]
        )
    return rows


def balance_table(steps: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    rows = balance_rows(steps)
    if not rows:
        return "no MoE balance records in these steps"
    return render_table(HEADERS, rows, markdown=markdown)


def plot_load_heatmap(steps: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """One panel per MoE layer: expert (rows) x step (columns), colour = the expert's load over
    the step's mean load (1 = its fair share; log-scaled colours centred on 1)."""
    from mixmoe.report.matplotlib_agg import pyplot

    series = layer_series(steps)
    if not series:
        raise ValueError("no MoE balance records in these steps; nothing to plot")
    plt = pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(series), 1, figsize=(8, 1.2 + 1.6 * len(series)), squeeze=False)
    image = None
    for ax, (name, s) in zip(axes[:, 0], series.items(), strict=True):
        step_S = [st for st, _ in s]
        # columns: load / mean per step; an expert without rows is drawn at the floor colour
        cols = []
        for _, d in s:
            load = d["load"]
            mean = sum(load) / len(load) if load else 0.0
            cols.append([max(v / mean, 1e-2) if mean else 1.0 for v in load])
        grid_NS = [list(row) for row in zip(*cols, strict=True)]
        image = ax.imshow(
            grid_NS,
            aspect="auto",
            interpolation="nearest",
            cmap="RdBu_r",
            norm=LogNorm(vmin=0.1, vmax=10.0),
            extent=(step_S[0] - 0.5, step_S[-1] + 0.5, len(grid_NS) - 0.5, -0.5),
        )
        ax.set_ylabel(f"{name or 'moe'}\nexpert", fontsize=8)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title)
    fig.colorbar(image, ax=axes[:, 0].tolist(), label="load / mean")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
