"""The MoE computed token by token, choice by choice, over dense weights.

Shares no code with the fast path: its own gate arithmetic, its own activations written from their
formulas, no sorting, no blocks. Slow on purpose; tests compare forward and every gradient to it.

Tie-breaking: among equal logits the lower expert id is chosen first (as documented for the gates).
"""

from __future__ import annotations

import math

import torch


def _act(name: str, h: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return torch.where(h > 0, h, torch.zeros_like(h))
    if name == "gelu":  # exact (erf) GELU
        return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    return h / (1.0 + torch.exp(-h))  # silu, also the gate half of swiglu


def _expert(params: dict, g: int, x_D: torch.Tensor, activation: str) -> torch.Tensor:
    def lin(w: str, b: str) -> torch.Tensor:
        out = x_D @ params[w][g]
        return out + params[b][g] if params.get(b) is not None else out

    h = _act(activation, lin("w1", "b1"))
    if activation == "swiglu":
        h = h * lin("w3", "b3")
    out = h @ params["w2"][g]
    return out + params["b2"][g] if params.get("b2") is not None else out


def _choose(logits: torch.Tensor, k: int) -> list[int]:
    values = logits.detach().tolist()
    return sorted(range(len(values)), key=lambda g: (-values[g], g))[:k]


def _softmax(v: torch.Tensor) -> torch.Tensor:
    e = torch.exp(v - v.detach().max())
    return e / e.sum()


def reference_moe(
    x: torch.Tensor,
    params: dict,
    *,
    top_k: int,
    gate_type: str = "topk",
    normalize: str = "topk_softmax",
    activation: str = "gelu",
    dropped: set[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Returns ``(y, balance_loss, z_loss, counts)`` for ``x [..., D]``.

    params: gate_w [N, D], gate_b [N] or None, w1 [N, D, F], b1 [N, F], w2 [N, F, D], b2 [N, D],
    optionally w3/b3 (swiglu). ``dropped`` lists (token, choice) pairs removed by GShard random
    routing (weight 0, not computed).
    """
    D = x.shape[-1]
    xs = x.reshape(-1, D)
    N = params["gate_w"].shape[0]
    dropped = dropped or set()
    outs, logit_rows, choices = [], [], []
    for t in range(xs.shape[0]):
        logits = params["gate_w"] @ xs[t]
        if params.get("gate_b") is not None:
            logits = logits + params["gate_b"]
        logit_rows.append(logits)
        k = 1 if gate_type == "switch" else 2 if gate_type == "gshard" else top_k
        chosen = _choose(logits, k)
        if gate_type == "topk" and normalize == "topk_softmax":
            weights = _softmax(torch.stack([logits[g] for g in chosen]))
        else:
            probs = _softmax(logits)
            picked = torch.stack([probs[g] for g in chosen])
            keep = gate_type == "switch" or (gate_type == "topk" and normalize == "softmax")
            weights = picked if keep else picked / picked.sum()
        y = torch.zeros_like(xs[t])
        for c, g in enumerate(chosen):
            if (t, c) in dropped:
                continue
            y = y + weights[c] * _expert(params, g, xs[t], activation)
            choices.append((c, g))
        outs.append(y)
    y = torch.stack(outs).reshape(x.shape) if outs else x * 0

    # textbook losses
    T = len(logit_rows)
    counted = [g for c, g in choices if gate_type != "gshard" or c == 0]
    counts = [sum(1 for _, g in choices if g == e) for e in range(N)]
    if T == 0:
        zero = x.sum() * 0
        return y, zero, zero, counts
    mean_prob = [sum(_softmax(row)[e] for row in logit_rows) / T for e in range(N)]
    share = [sum(1 for g in counted if g == e) / max(len(counted), 1) for e in range(N)]
    balance = N * sum(share[e] * mean_prob[e] for e in range(N))
    z = sum(torch.log(torch.exp(row).sum()) ** 2 for row in logit_rows) / T
    return y, balance, z, counts
