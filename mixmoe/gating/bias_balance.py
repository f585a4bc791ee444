"""Aux-loss-free balancing (DeepSeek-V3): the per-expert selection bias and its update.

Legend: N experts.

The bias is added to the router scores for choosing experts only (never to the combine
weights, see ``routing.scored_route``). After each optimizer step it moves every expert
towards the mean load by a fixed step:

    bias_N += rate * sign(mean(load_N) - load_N)

so an overloaded expert loses ``rate``, an underloaded one gains it, one exactly at the mean
stays. ``load_N`` are the GLOBAL rows per expert of the whole step (every micro-batch, every
rank of the batch); equal counts on every rank give bit-identical biases everywhere.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def update_expert_bias(bias_N: torch.Tensor, load_N: torch.Tensor, rate: float) -> torch.Tensor:
    """In place on ``bias_N`` (any float dtype, any device); ``load_N`` counts (any dtype and
    device), summed over the step. Returns ``bias_N``. All-zero loads leave it unchanged."""
    if load_N.shape != bias_N.shape:
        raise ValueError(
            f"load_N has shape {tuple(load_N.shape)} but the bias has {tuple(bias_N.shape)}; "
            "pass one count per expert"
        )
    load = load_N.to(device=bias_N.device, dtype=torch.float64)
    # sign in float64 from integer-valued counts: exact, so every rank takes the same step
    step_N = torch.sign(load.mean() - load)
    bias_N += (rate * step_N).to(bias_N.dtype)
    return bias_N
