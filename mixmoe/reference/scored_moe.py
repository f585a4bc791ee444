"""The DeepSeek-style MoE computed token by token: scored routing (softmax | sigmoid, group
limit, selection bias, scale), shared experts, padding, and the three balance losses.

Shares no code with the fast path: selection is a Python sort over floats, groups are Python
lists, the losses are written from their textbook formulas with explicit loops. Slow on purpose.

Tie-breaking: among equal values the lower expert id (and the lower group id) wins.
"""

from __future__ import annotations

import torch

from mixmoe.reference.moe import _act, _expert


def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    if score == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-logits))
    e = torch.exp(logits - logits.detach().max())
    return e / e.sum()


def reference_scored_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    normalize: str = "renorm",
    n_groups: int = 1,
    topk_groups: int | None = None,
    group_score: str = "sum_top2",
    route_scale: float = 1.0,
    expert_bias: list[float] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """One token: ``logits`` [N] -> (chosen expert ids, in order of choice; their weights [K])."""
    N = logits.shape[0]
    scores = _scores(logits, score)
    values = scores.detach().tolist()
    if expert_bias is not None:
        values = [v + b for v, b in zip(values, expert_bias, strict=True)]
    eligible = list(range(N))
    if n_groups > 1 and topk_groups is not None and topk_groups < n_groups:
        size = N // n_groups
        group_values = []
        for grp in range(n_groups):
            members = sorted((values[g] for g in range(grp * size, (grp + 1) * size)), reverse=True)
            group_values.append(members[0] if group_score == "max" else members[0] + members[1])
        kept = sorted(range(n_groups), key=lambda grp: (-group_values[grp], grp))[:topk_groups]
        eligible = [g for g in range(N) if g // size in kept]
    chosen = sorted(eligible, key=lambda g: (-values[g], g))[:top_k]
    if normalize == "topk_softmax":
        picked = torch.stack([logits[g] for g in chosen])
        e = torch.exp(picked - picked.detach().max())
        weights = e / e.sum()
    else:
        weights = torch.stack([scores[g] for g in chosen])
        if normalize in ("renorm", "softmax_renorm"):
            weights = weights / weights.sum()
    return chosen, weights * route_scale


def _shared(params: dict, x_D: torch.Tensor, activation: str) -> torch.Tensor:
    def lin(w: str, b: str, v: torch.Tensor) -> torch.Tensor:
        out = v @ params[w]
        return out + params[b] if params.get(b) is not None else out

    h = _act(activation, lin("shared_w1", "shared_b1", x_D))
    if activation == "swiglu":
        h = h * lin("shared_w3", "shared_b3", x_D)
    y = lin("shared_w2", "shared_b2", h)
    if params.get("shared_gate_w") is not None:
        y = y / (1.0 + torch.exp(-(x_D @ params["shared_gate_w"])))
    return y


def _balance(rows: list[list[float]], chosen: list[list[int]], N: int, counts=None):
    """N * sum_i f_i P_i over these tokens (P rows, their choices); f from ``counts`` if given."""
    if counts is None:
        counts = [sum(1 for ids in chosen for g in ids if g == e) for e in range(N)]
    total = sum(counts)
    share = [c / total if total else 0.0 for c in counts]
    mean_p = [sum(r[e] for r in rows) / len(rows) for e in range(N)]
    return N * sum(share[e] * mean_p[e] for e in range(N))


def reference_scored_moe(
    x: torch.Tensor,
    params: dict,
    *,
    top_k: int,
    activation: str = "gelu",
    score: str = "softmax",
    normalize: str = "renorm",
    n_groups: int = 1,
    topk_groups: int | None = None,
    group_score: str = "sum_top2",
    route_scale: float = 1.0,
    expert_bias: list[float] | None = None,
    padding: list[bool] | None = None,
    balance_loss: str = "micro_batch",
    seq_len: int | None = None,
    global_counts: list[int] | None = None,
):
    """Returns ``(y, balance_loss, z_loss, counts)`` for ``x [..., D]``.

    params: as ``reference_moe`` (gate_w [N, D], gate_b, w1 [N, D, F], ...), plus the shared
    experts' shared_w1 [D, Fs], shared_b1, shared_w2 [Fs, D], shared_b2, shared_w3/shared_b3
    (swiglu) and shared_gate_w [D] where present. ``padding``: per token, True = padded (not
    routed, in no loss). ``seq_len``: tokens per sequence (sequence loss; None: one sequence).
    ``global_counts``: the batch's rows per expert for the global-batch loss.
    """
    D = x.shape[-1]
    xs = x.reshape(-1, D)
    T, N = xs.shape[0], params["gate_w"].shape[0]
    padding = padding or [False] * T
    outs, probs, chosen_all, logit_rows = [], [], [], []
    for t in range(T):
        logits = params["gate_w"] @ xs[t]
        if params.get("gate_b") is not None:
            logits = logits + params["gate_b"]
        y = torch.zeros_like(xs[t])
        if params.get("shared_w1") is not None:
            y = y + _shared(params, xs[t], activation)
        if padding[t]:
            outs.append(y)
            probs.append(None)
            chosen_all.append([])
            logit_rows.append(None)
            continue
        chosen, weights = reference_scored_route(
            logits,
            top_k,
            score=score,
            normalize=normalize,
            n_groups=n_groups,
            topk_groups=topk_groups,
            group_score=group_score,
            route_scale=route_scale,
            expert_bias=expert_bias,
        )
        for c, g in enumerate(chosen):
            y = y + weights[c] * _expert(params, g, xs[t], activation)
        outs.append(y)
        s = _scores(logits, "sigmoid") if score == "sigmoid" else _scores(logits, "softmax")
        probs.append(s / s.sum())
        chosen_all.append(chosen)
        logit_rows.append(logits)
    y = torch.stack(outs).reshape(x.shape) if outs else x * 0
    counts = [sum(1 for ids in chosen_all for g in ids if g == e) for e in range(N)]
    valid = [t for t in range(T) if not padding[t]]
    if not valid:
        zero = x.sum() * 0
        return y, zero, zero, counts
    if balance_loss == "sequence":
        S = seq_len or T
        losses = []
        for start in range(0, T, S):
            seq = [t for t in range(start, start + S) if not padding[t]]
            if seq:
                losses.append(_balance([probs[t] for t in seq], [chosen_all[t] for t in seq], N))
        balance = sum(losses) / len(losses)
    else:
        counts_for_f = global_counts if balance_loss == "global_batch" else None
        balance = _balance(
            [probs[t] for t in valid], [chosen_all[t] for t in valid], N, counts_for_f
        )
    z = sum(torch.log(torch.exp(logit_rows[t]).sum()) ** 2 for t in valid) / len(valid)
    return y, balance, z, counts
