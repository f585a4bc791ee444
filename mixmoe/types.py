"""Plain result types shared by the gates, the layer and the strategies.

Legend: T tokens, N experts (global), K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Where each token goes.

    ids_TK:     int64 expert ids, -1 marks a dropped choice (only GShard random routing drops).
    weights_TK: combine weights (differentiable w.r.t. the gate); 0 where the id is -1.
    logits_TN:  raw router logits (the z-loss and the balance loss read them).
    """

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    logits_TN: torch.Tensor


@dataclass(frozen=True)
class MoEAux:
    """Auxiliary outputs of one MoE forward.

    balance_loss: load-balancing loss (unscaled), see ``mixmoe.gating.losses``.
    z_loss:       router z-loss (unscaled).
    loss:         aux_loss_coef * balance_loss + z_loss_coef * z_loss: add it to the task loss.
    counts_N:     int64 rows routed to each global expert by this rank (dropped choices excluded).
    stats:        what the strategy did this step (rows moved, replicas, ...), for benchmarks;
                  the same on every rank.
    plan_wait_ms: what this rank's forward waited for the dispatcher's planning thread (an
                  async plan's unhidden part; 0 without one): a timing, this rank's own.
    """

    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    loss: torch.Tensor
    counts_N: torch.Tensor
    stats: dict | None = None
    plan_wait_ms: float = 0.0


@dataclass(frozen=True)
class LoadRecord:
    """One MoE layer's load over one optimizer step (``MoE.end_step``).

    load_N:    int64 CPU [N]: rows routed to each global expert over the step's forwards, summed
               over the expert-parallel group (and the ranks ``all_reduce`` added).
    forwards:  training forwards counted (micro-batches; recomputations excluded).
    replicas:  expert replicas the strategy used, summed over those forwards (0 on one device).
    bias_min, bias_max: the selection bias' range AFTER this step's update (None without one).
    """

    load_N: torch.Tensor
    forwards: int
    replicas: int
    bias_min: float | None = None
    bias_max: float | None = None

    @property
    def max_over_mean(self) -> float:
        """Busiest expert's load / the mean load (1.0 perfectly balanced; 0.0 with no rows)."""
        mean = float(self.load_N.double().mean())
        return float(self.load_N.max()) / mean if mean > 0 else 0.0

    @property
    def cv(self) -> float:
        """Coefficient of variation of the loads: population std / mean (0.0 with no rows)."""
        load = self.load_N.double()
        mean = float(load.mean())
        return float(load.std(unbiased=False)) / mean if mean > 0 else 0.0
