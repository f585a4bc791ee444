"""Per-layer balance metrics of a training run, one dict per MoE layer per optimizer step.

Legend: N experts.

From each layer's ``LoadRecord`` (``MoE.end_step``: the step's global rows per expert):

    layer          the layer's qualified name
    load           rows per expert this step (global: every rank, every micro-batch)
    max_over_mean  busiest expert's rows / the mean (1.0 = balanced; at most N / K)
    cv             coefficient of variation of ``load`` (population std / mean)
    dead           experts that received no row over the last ``window`` steps (the steps seen
                   so far while fewer)
    replicas       expert replicas the strategy used, summed over the step's forwards (the
                   plan's count: the same on every rank; 0 on one device and under a2a)
    bias_min, bias_max  the selection bias' range after this step's update (None without one)
"""

from __future__ import annotations

from collections import deque

import torch

from mixmoe.types import LoadRecord

DEAD_WINDOW = 20


class BalanceLog:
    """Turns each step's ``[(name, LoadRecord)]`` into metric dicts, remembering the last
    ``window`` loads per layer for the dead-expert count."""

    def __init__(self, window: int = DEAD_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self.window = window
        self._recent: dict[str, deque] = {}

    def step(self, records: list[tuple[str, LoadRecord]]) -> tuple[dict, ...]:
        out = []
        for name, rec in records:
            recent = self._recent.setdefault(name, deque(maxlen=self.window))
            recent.append(rec.load_N)
            seen_N = torch.stack(list(recent)).sum(dim=0)
            out.append(
                {
                    "layer": name,
                    "load": rec.load_N.tolist(),
                    "max_over_mean": round(rec.max_over_mean, 6),
                    "cv": round(rec.cv, 6),
                    "dead": int((seen_N == 0).sum()),
                    "replicas": rec.replicas,
                    "bias_min": rec.bias_min,
                    "bias_max": rec.bias_max,
                }
            )
        return tuple(out)
