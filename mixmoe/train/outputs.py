"""What a training run leaves on disk, written AS IT RUNS by world rank 0: one JSONL line per
step (``train.jsonl``, appended and flushed at once, so a killed run keeps the log of every step
it finished), optional TensorBoard event files (loss, lr, tokens/s, aux loss, and per MoE layer
its balance metrics), and at the end a loss-curve PNG, which ``plot_log`` redraws from any log,
a partial one included (``mixmoe report RUN/train.jsonl``), and for MoE models a per-layer
expert-load heat-map PNG (matplotlib, imported lazily).

A line is ``{"kind": "train", "config", "environment", "model", "strategy", "world_size",
"ep_size", **StepRecord fields}`` (``mixmoe.formats.results``' shape). A resumed run appends to
the same log, so a step may appear twice (run before a crash, run again after the resume): the
plot keeps the LAST line of each step, the resumed run's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from mixmoe.formats.results import environment

JSONL_NAME = "train.jsonl"
PNG_NAME = "loss.png"
TENSORBOARD_DIR = "tensorboard"
HEATMAP_NAME = "load_heatmap.png"


def _scalars(prefix: str, record: Mapping[str, Any]) -> Iterable[tuple[str, float]]:
    """Every finite number of ``record`` as (tag, value); dicts flattened; ``moe`` (one dict per
    MoE layer, ``mixmoe.train.balance_log``) as ``<prefix>/moe/<layer>/<metric>`` without the
    per-expert load vector."""
    for key, value in record.items():
        if isinstance(value, bool) or key == "step":
            continue
        if key == "moe" and isinstance(value, list | tuple):
            for layer in value:
                metrics = {k: v for k, v in layer.items() if k not in ("layer", "load")}
                yield from _scalars(f"{prefix}/moe/{layer.get('layer')}", metrics)
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            yield f"{prefix}/{key}", float(value)
        elif isinstance(value, Mapping):
            yield from _scalars(f"{prefix}/{key}", value)
        elif isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
            yield from _scalars(f"{prefix}/{key}", {str(i): v for i, v in enumerate(value)})


class RunLog:
    """Rank 0's streamed outputs of one run in ``out_dir``: ``write(record)`` appends one JSONL
    line and flushes it (and adds the record's numbers to TensorBoard when ``tensorboard``);
    ``close(title)`` draws ``loss.png`` from the whole log and closes the files."""

    def __init__(
        self,
        out_dir: str | Path,
        config: Mapping[str, Any],
        device: torch.device,
        common: Mapping[str, Any],
        tensorboard: bool = False,
    ) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / JSONL_NAME
        self.head = {
            "kind": "train",
            "config": dict(config),
            "environment": environment(device),
            **common,
        }
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed in close()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._file.close()
                raise ImportError(
                    "--tensorboard needs the tensorboard package; pip install 'mixmoe[plot]' "
                    "(or pip install tensorboard)"
                ) from None
            self._tb = SummaryWriter(str(self.dir / TENSORBOARD_DIR))

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` (a StepRecord as a dict) and flush: it survives a kill from here."""
        self._file.write(json.dumps({**self.head, **record}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for tag, value in _scalars("train", record):
                self._tb.add_scalar(tag, value, global_step=int(record["step"]))
            self._tb.flush()

    def close_files(self) -> None:
        """Close the JSONL and TensorBoard files (idempotent)."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def close(self, title: str) -> Path:
        """Close the files and draw ``loss.png`` (and, when the steps carry MoE balance
        records, ``load_heatmap.png``) from the log; returns the loss PNG's path."""
        self.close_files()
        records = latest_per_step(read_log(self.path))
        if any(r.get("moe") for r in records):
            from mixmoe.report.load_balance import plot_load_heatmap

            plot_load_heatmap(records, self.dir / HEATMAP_NAME, f"{title}: expert load")
        return plot_log(self.path, self.dir / PNG_NAME, title)


def read_log(path: str | Path) -> list[dict]:
    """The train records of a ``train.jsonl``; a torn last line (the run was killed while
    writing it) and lines of other kinds are skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "train" and "step" in rec:
            out.append(rec)
    return out


def latest_per_step(records: list[dict]) -> list[dict]:
    """One record per step, the last one written (a resumed run's redo wins), in step order."""
    by_step = {int(r["step"]): r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def plot_log(log: str | Path, png: str | Path, title: str | None = None) -> Path:
    """Train loss per step (and eval loss where measured) of the log at ``log`` to ``png``."""
    from mixmoe.report.matplotlib_agg import pyplot

    records = latest_per_step(read_log(log))
    if not records:
        raise ValueError(f"{log} holds no train step record; pass the train.jsonl of a run")
    if title is None:
        r = records[-1]
        n = (r.get("config") or {}).get("num_experts")
        title = f"{r.get('model')} {r.get('strategy')} W={r.get('world_size')} N={n}"
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train")
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    out = Path(png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
