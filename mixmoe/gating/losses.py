"""Auxiliary router losses.

Legend: T tokens, N experts, K top-k.

load-balancing loss (Switch Transformer eq. 4, GShard's l_aux):
    N * sum_i f_i * P_i
    P_i = mean over tokens of softmax(logits)_i            (differentiable)
    f_i = share of the routed rows that went to expert i   (a count, no gradient)
    ``first_choice_only=True`` counts only each token's first choice (GShard's ``c_e``; equals
    Switch for K = 1); otherwise all K choices count, divided by the number of kept choices
    (Megatron-LM's top-k generalisation). Perfectly uniform routing gives exactly 1.0.

router z-loss (ST-MoE eq. 5): mean over tokens of logsumexp(logits)^2.
"""

from __future__ import annotations

import torch

from mixmoe.gating.precision import widen
from mixmoe.schedule.sort import expert_counts


def load_balancing_loss(
    logits_TN: torch.Tensor, ids_TK: torch.Tensor, first_choice_only: bool = False
) -> torch.Tensor:
    num_experts = logits_TN.shape[-1]
    if logits_TN.shape[0] == 0:
        return widen(logits_TN).sum() * 0.0
    probs_N = torch.softmax(widen(logits_TN), dim=-1).mean(dim=0)
    chosen = ids_TK[:, :1] if first_choice_only else ids_TK
    # dropped choices (-1) are not counted; no boolean indexing, no host sync
    counts_N = expert_counts(chosen, num_experts).to(probs_N.dtype)
    f_N = counts_N / counts_N.sum().clamp(min=1)
    return num_experts * (f_N * probs_N).sum()


def router_z_loss(logits_TN: torch.Tensor) -> torch.Tensor:
    if logits_TN.shape[0] == 0:
        return widen(logits_TN).sum() * 0.0
    return torch.logsumexp(widen(logits_TN), dim=-1).square().mean()
