"""Row movement between token order and the padded block layout.

Legend: T tokens, K top-k, D features, P padded rows.

``gather_rows``: x_PD[p] = x_TD[token_P[p]], zero where token_P[p] == T (padding).
``combine_rows``: y_TD[t] = sum_k weights_TK[t, k] * out_PD[pos_TK[t, k]], summed over k in
order 0..K-1 (deterministic, no atomics); pos_TK == P selects a zero row (dropped choice);
no weights: unit weights.
Both are plain differentiable torch; CUDA kernels fuse them into the grouped GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_rows(x_TD: torch.Tensor, token_P: torch.Tensor) -> torch.Tensor:
    return F.pad(x_TD, (0, 0, 0, 1))[token_P]


def combine_rows(
    out_PD: torch.Tensor, pos_TK: torch.Tensor, weights_TK: torch.Tensor | None
) -> torch.Tensor:
    """``weights_TK=None`` means unit weights (with K = 1: the rows of ``out_PD`` in the order
    ``pos_TK`` names, e.g. received rows put back in return order)."""
    rows_TKD = F.pad(out_PD, (0, 0, 0, 1))[pos_TK]
    if weights_TK is None:
        return rows_TKD.sum(dim=1)
    return (rows_TKD * weights_TK.unsqueeze(-1).to(rows_TKD.dtype)).sum(dim=1)
