"""Auxiliary router losses.

Legend: T tokens, N experts, K top-k, B sequences, S tokens per sequence.

Balance probabilities P_TN (``balance_probs``): softmax(logits) for softmax-scored gates; for
sigmoid-scored gates the sigmoid scores divided by their per-token sum (DeepSeek-V3's s'). Never
a softmax of probabilities (the double-softmax bug of transformers #45120).

load-balancing loss (Switch Transformer eq. 4, GShard's l_aux), over one forward's tokens:
    N * sum_i f_i * P_i
    P_i = mean over the valid tokens of P_TN[:, i]               (differentiable)
    f_i = share of the routed rows that went to expert i         (a count, no gradient)
    ``first_choice_only=True`` counts only each token's first choice (GShard's ``c_e``; equals
    Switch for K = 1); otherwise all K choices count, divided by the number of kept choices
    (Megatron-LM's top-k generalisation). Perfectly uniform routing gives exactly 1.0.
sequence loss (DeepSeek-V3's sequence-wise balance loss): the same per sequence of S tokens,
    averaged over the sequences holding at least one valid token.
global-batch loss: f_i from counts of a larger batch (every rank's rows), P_i from these tokens.

router z-loss (ST-MoE eq. 5): mean over the valid tokens of logsumexp(logits)^2.

``valid_T`` (bool, optional): False marks a padded token. Its choices must already be dropped
(id -1: the gate does it), so it counts in no f_i; it is left out of every mean.
"""

from __future__ import annotations

import torch

from mixmoe.gating.precision import widen
from mixmoe.schedule.sort import expert_counts


def balance_probs(logits_TN: torch.Tensor, score: str = "softmax") -> torch.Tensor:
    """P_TN (at least float32) of the balance losses: softmax, or sigmoid / its row sum."""
    wide_TN = widen(logits_TN)
    if score == "softmax":
        return torch.softmax(wide_TN, dim=-1)
    sig_TN = torch.sigmoid(wide_TN)
    return sig_TN / sig_TN.sum(dim=-1, keepdim=True)


def _mean_probs(probs_TN: torch.Tensor, valid_T: torch.Tensor | None) -> torch.Tensor:
    if valid_T is None:
        return probs_TN.mean(dim=0)
    w_T = valid_T.to(probs_TN.dtype)
    # no boolean indexing (no host sync): weight the rows, divide by the valid count
    return (probs_TN * w_T[:, None]).sum(dim=0) / w_T.sum().clamp(min=1)


def load_balancing_loss(
    logits_TN: torch.Tensor,
    ids_TK: torch.Tensor,
    first_choice_only: bool = False,
    *,
    probs_TN: torch.Tensor | None = None,
    valid_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """The micro-batch loss; ``probs_TN`` defaults to softmax(logits)."""
    num_experts = logits_TN.shape[-1]
    if logits_TN.shape[0] == 0:
        return widen(logits_TN).sum() * 0.0
    if probs_TN is None:
        probs_TN = balance_probs(logits_TN)
    probs_N = _mean_probs(probs_TN, valid_T)
    chosen = ids_TK[:, :1] if first_choice_only else ids_TK
    # dropped choices (-1) are not counted; no boolean indexing, no host sync
    counts_N = expert_counts(chosen, num_experts).to(probs_N.dtype)
    f_N = counts_N / counts_N.sum().clamp(min=1)
    return num_experts * (f_N * probs_N).sum()


def sequence_balance_loss(
    probs_TN: torch.Tensor,
    ids_TK: torch.Tensor,
    seq_len: int,
    valid_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over sequences (consecutive runs of ``seq_len`` tokens; T % seq_len == 0) of the
    per-sequence balance loss; sequences without a valid token are left out."""
    T, N = probs_TN.shape
    if T == 0:
        return probs_TN.sum() * 0.0
    B, S = T // seq_len, seq_len
    w_BS = (
        torch.ones(B, S, dtype=probs_TN.dtype, device=probs_TN.device)
        if valid_T is None
        else valid_T.reshape(B, S).to(probs_TN.dtype)
    )
    n_B = w_BS.sum(dim=1)
    P_BN = (probs_TN.reshape(B, S, N) * w_BS[..., None]).sum(dim=1) / n_B.clamp(min=1)[:, None]
    # per-sequence counts: sequence b's rows scatter into row b (dropped ids -1 go to column N)
    ids_BR = ids_TK.reshape(B, -1)
    key_BR = torch.where(ids_BR >= 0, ids_BR, N)
    counts_BN = torch.zeros(B, N + 1, dtype=probs_TN.dtype, device=probs_TN.device)
    counts_BN.scatter_add_(1, key_BR, torch.ones_like(key_BR, dtype=probs_TN.dtype))
    counts_BN = counts_BN[:, :N]
    f_BN = counts_BN / counts_BN.sum(dim=1, keepdim=True).clamp(min=1)
    loss_B = N * (f_BN * P_BN).sum(dim=1)
    has_B = (n_B > 0).to(probs_TN.dtype)
    return (loss_B * has_B).sum() / has_B.sum().clamp(min=1)


def global_balance_loss(
    probs_TN: torch.Tensor, counts_N: torch.Tensor, valid_T: torch.Tensor | None = None
) -> torch.Tensor:
    """N * sum_i f_i * P_i with f from ``counts_N`` (rows per expert of the whole batch, any
    device; no gradient) and P from these tokens."""
    T, N = probs_TN.shape
    if T == 0:
        return probs_TN.sum() * 0.0
    probs_N = _mean_probs(probs_TN, valid_T)
    c_N = counts_N.to(device=probs_N.device, dtype=probs_N.dtype)
    return N * (c_N / c_N.sum().clamp(min=1) * probs_N).sum()


def router_z_loss(logits_TN: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    if logits_TN.shape[0] == 0:
        return widen(logits_TN).sum() * 0.0
    z_T = torch.logsumexp(widen(logits_TN), dim=-1).square()
    if valid_T is None:
        return z_T.mean()
    w_T = valid_T.to(z_T.dtype)
    return (z_T * w_T).sum() / w_T.sum().clamp(min=1)
