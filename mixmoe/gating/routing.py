"""Routing functions: logits -> (ids, weights).

Legend: T tokens, N experts, K top-k.

Tie-breaking (all gates): among equal scores the LOWER expert id wins. It is implemented with a
stable descending sort, so it holds on every device and never depends on ``torch.topk``'s
unspecified order for ties.
"""

from __future__ import annotations

import torch

from mixmoe.config import GateConfig
from mixmoe.gating.precision import widen
from mixmoe.types import Routing


def _top_k_stable(scores_TN: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values and ids per row; ties -> lower id first (stable sort)."""
    values_TN, ids_TN = torch.sort(scores_TN, dim=-1, descending=True, stable=True)
    return values_TN[:, :k], ids_TN[:, :k]


def topk_route(logits_TN: torch.Tensor, k: int, normalize: str = "topk_softmax") -> Routing:
    """FastMoE NaiveGate: top-k of the logits.

    ``topk_softmax``: weights = softmax over the k selected logits.
    ``softmax_renorm``: weights = softmax over all N, the k selected ones divided by their sum.
    ``softmax``: weights = softmax over all N, the k selected ones as they are (sum <= 1).
    """
    top_TK, ids_TK = _top_k_stable(logits_TN, k)
    if normalize == "topk_softmax":
        weights_TK = torch.softmax(widen(top_TK), dim=-1)
    else:
        probs_TN = torch.softmax(widen(logits_TN), dim=-1)
        picked_TK = probs_TN.gather(1, ids_TK)
        renorm = normalize == "softmax_renorm"
        weights_TK = picked_TK / picked_TK.sum(dim=-1, keepdim=True) if renorm else picked_TK
    return Routing(ids_TK, weights_TK.to(logits_TN.dtype), logits_TN)


def switch_route(logits_TN: torch.Tensor) -> Routing:
    """Switch Transformer: top-1, weight = softmax probability of the chosen expert."""
    probs_TN = torch.softmax(widen(logits_TN), dim=-1)
    _, ids_TK = _top_k_stable(logits_TN, 1)
    weights_TK = probs_TN.gather(1, ids_TK)
    return Routing(ids_TK, weights_TK.to(logits_TN.dtype), logits_TN)


def gshard_route(
    logits_TN: torch.Tensor, random_routing: bool = False, generator: torch.Generator | None = None
) -> Routing:
    """GShard top-2: weights of the two best softmax probabilities renormalised over the two.

    With ``random_routing`` the second choice is kept with probability ``min(1, 2 * w2)``; a dropped
    choice gets id -1 and weight 0 (dropless otherwise: there is no capacity).
    """
    probs_TN = torch.softmax(widen(logits_TN), dim=-1)
    _, ids_TK = _top_k_stable(logits_TN, 2)
    picked_TK = probs_TN.gather(1, ids_TK)
    weights_TK = picked_TK / picked_TK.sum(dim=-1, keepdim=True)
    if random_routing:
        u_T = torch.rand(
            logits_TN.shape[0], device=logits_TN.device, generator=generator, dtype=torch.float32
        )
        keep_T = u_T < 2.0 * weights_TK[:, 1].detach()
        drop_TK = torch.stack([torch.zeros_like(keep_T), ~keep_T], dim=1)
        ids_TK = ids_TK.masked_fill(drop_TK, -1)
        weights_TK = weights_TK.masked_fill(drop_TK, 0.0)
    return Routing(ids_TK, weights_TK.to(logits_TN.dtype), logits_TN)


def route(
    logits_TN: torch.Tensor,
    k: int,
    gate: GateConfig,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> Routing:
    """Dispatch to the router named by ``gate.type`` (random routing only while training)."""
    if gate.type == "topk":
        return topk_route(logits_TN, k, gate.normalize)
    if gate.type == "switch":
        return switch_route(logits_TN)
    return gshard_route(logits_TN, gate.random_routing and training, generator)
