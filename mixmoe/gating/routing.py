"""Routing functions: logits -> (ids, weights): the classic gates (topk, switch, gshard) and
DeepSeek-style scored routing (softmax | sigmoid scores, group limit, selection bias, scale).

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


def router_scores(logits_TN: torch.Tensor, score: str) -> torch.Tensor:
    """scores_TN in at least float32: softmax over the experts, or an element-wise sigmoid."""
    wide_TN = widen(logits_TN)
    return torch.softmax(wide_TN, dim=-1) if score == "softmax" else torch.sigmoid(wide_TN)


def _group_mask(choice_TN: torch.Tensor, n_groups: int, keep: int, group_score: str):
    """bool [T, N]: True where the expert's group is among the ``keep`` best of its token.

    Groups are ``n_groups`` runs of N / n_groups consecutive expert ids; a group is scored by the
    sum of its two best values (``sum_top2``) or its best (``max``); ties -> lower group id."""
    T, N = choice_TN.shape
    grouped_TGM = choice_TN.reshape(T, n_groups, N // n_groups)
    if group_score == "max":
        group_TG = grouped_TGM.amax(dim=-1)
    else:  # the two largest of each group (topk's order does not matter for a sum)
        group_TG = grouped_TGM.topk(2, dim=-1).values.sum(dim=-1)
    _, best_TG = _top_k_stable(group_TG, keep)
    keep_TG = torch.zeros(T, n_groups, dtype=torch.bool, device=choice_TN.device)
    keep_TG.scatter_(1, best_TG, True)
    # every expert inherits its group's verdict: [T, G] -> [T, G, M] -> [T, N]
    return keep_TG.unsqueeze(-1).expand_as(grouped_TGM).reshape(T, N)


def scored_route(
    logits_TN: torch.Tensor,
    k: int,
    gate: GateConfig,
    expert_bias_N: torch.Tensor | None = None,
) -> Routing:
    """DeepSeek-style routing (see ``GateConfig``): scores (softmax | sigmoid), selection on
    scores + ``expert_bias_N`` (no gradient through the choice), optional group limit, weights =
    the selected scores (normalised per ``gate.normalize``) times ``gate.route_scale``.

    Computed in ``logits_TN``'s dtype widened to at least float32; the weights come back in that
    dtype, the logits' (the gate casts them to the layer's). Ties: lower expert id, lower group id."""
    scores_TN = router_scores(logits_TN, gate.score)
    choice_TN = scores_TN.detach()
    if expert_bias_N is not None:
        choice_TN = choice_TN + expert_bias_N.to(choice_TN.dtype)
    if gate.group_limited:
        eligible_TN = _group_mask(choice_TN, gate.n_groups, gate.topk_groups, gate.group_score)
        # -inf: an expert of a dropped group can never beat an eligible one, whatever the bias
        choice_TN = choice_TN.masked_fill(~eligible_TN, float("-inf"))
    _, ids_TK = _top_k_stable(choice_TN, k)
    if gate.normalize == "topk_softmax":  # softmax score only (GateConfig checks it)
        weights_TK = torch.softmax(widen(logits_TN).gather(1, ids_TK), dim=-1)
    else:
        weights_TK = scores_TN.gather(1, ids_TK)
        if gate.normalize in ("renorm", "softmax_renorm"):
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    if gate.route_scale != 1.0:
        weights_TK = weights_TK * gate.route_scale
    return Routing(ids_TK, weights_TK.to(logits_TN.dtype), logits_TN)


def route(
    logits_TN: torch.Tensor,
    k: int,
    gate: GateConfig,
    training: bool = False,
    generator: torch.Generator | None = None,
    expert_bias_N: torch.Tensor | None = None,
) -> Routing:
    """Dispatch to the router named by ``gate.type`` (random routing only while training); a
    topk gate with any scored-routing option (``gate.scored``) routes with ``scored_route``."""
    if gate.type == "topk" and gate.scored:
        return scored_route(logits_TN, k, gate, expert_bias_N)
    if gate.type == "topk":
        return topk_route(logits_TN, k, gate.normalize)
    if gate.type == "switch":
        return switch_route(logits_TN)
    return gshard_route(logits_TN, gate.random_routing and training, generator)
