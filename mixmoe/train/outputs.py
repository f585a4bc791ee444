"""What a training run leaves on disk: a JSONL record per step (with the config and the
environment, ``mixmoe.formats.results``), a loss-curve PNG and, for MoE models, a per-layer
expert-load heat-map PNG (matplotlib, imported lazily)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from mixmoe.formats.results import append_jsonl

JSONL_NAME = "train.jsonl"
PNG_NAME = "loss.png"
HEATMAP_NAME = "load_heatmap.png"


def step_records(result) -> list[dict]:
    """One dict per step: the ``StepRecord`` fields plus strategy, world and EP size, model."""
    common = {
        "model": result.spec.model,
        "strategy": result.strategy,
        "world_size": result.world_size,
        "ep_size": result.ep_size,
    }
    return [{**common, **asdict(rec)} for rec in result.steps]


def plot_losses(result, path: str | Path) -> Path:
    """Train loss per step (and eval loss where measured) to a PNG."""
    from mixmoe.report.matplotlib_agg import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [r.step for r in result.steps]
    ax.plot(steps, [r.loss for r in result.steps], label="train")
    evals = [(r.step, r.eval_loss) for r in result.steps if r.eval_loss is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(
        f"{result.spec.model} {result.strategy} W={result.world_size} N={result.spec.num_experts}"
    )
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_outputs(result, out_dir: str | Path, device: torch.device) -> tuple[Path, Path]:
    """``out_dir/train.jsonl`` (appended), ``out_dir/loss.png`` and, when the steps carry MoE
    balance records, ``out_dir/load_heatmap.png`` (not returned; ``mixmoe report`` reads it back
    from the JSONL)."""
    out = Path(out_dir)
    records = step_records(result)
    jsonl = append_jsonl(out / JSONL_NAME, "train", result.config, device, records)
    if any(r.get("moe") for r in records):
        from mixmoe.report.load_balance import plot_load_heatmap

        title = f"{result.spec.model} {result.strategy} W={result.world_size}: expert load"
        plot_load_heatmap(records, out / HEATMAP_NAME, title)
    return jsonl, plot_losses(result, out / PNG_NAME)
