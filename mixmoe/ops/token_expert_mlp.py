"""The expert MLP from token order back to token order: gather, MLP over blocks, weighted combine.

Legend: T tokens, K top-k, D model dim, F hidden dim, P padded rows.

    y_TD = combine_rows(expert_mlp(gather_rows(x_TD, token_P), ...), pos_TK, weights_TK)

On CPU it is exactly that composition of the reference ops (so CPU numbers do not change when a
strategy switches to this entry point). On CUDA the row movement is fused into the grouped GEMMs
(``mixmoe.ops.fused_linear``): the first GEMM reads ``x_TD`` through ``token_P`` (no permuted copy
of the input), the second writes straight to token-choice order and the K choices are summed in
a fixed order. Same numbers up to float rounding, same autograd (dx, dW, db, d weights_TK).
"""

from __future__ import annotations

import torch

from mixmoe.ops.expert_mlp import ExpertWeights, activate, expert_mlp
from mixmoe.ops.fused_linear import gather_grouped_linear, grouped_linear_combine
from mixmoe.ops.rows import combine_rows, gather_rows
from mixmoe.schedule.blocks import BlockSchedule


def token_expert_mlp(
    x_TD: torch.Tensor,
    token_P: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    weights: ExpertWeights,
    schedule: BlockSchedule,
    activation: str,
    *,
    fused: bool | None = None,
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * mlp_{slot}(x_TD[t])`` over the row layout
    (``token_P``: token of each padded row, T for padding; ``pos_TK``: padded row of each choice,
    P for a dropped one; ``weights_TK=None``: unit weights). Output dtype: ``promote(x, w)``.

    ``fused``: None (default) fuses on CUDA and keeps the reference composition elsewhere; True
    uses the fused ops on any device (on CPU their torch implementations: same forward, backward
    equal up to float rounding); False always uses the reference composition."""
    if fused is None:
        fused = x_TD.is_cuda
    if not fused:
        x_PD = gather_rows(x_TD, token_P)
        return combine_rows(expert_mlp(x_PD, weights, schedule, activation), pos_TK, weights_TK)
    meta = (schedule.block_slot_Nb, schedule.block_rows_Nb, schedule.block_size)
    h_PF = activate(
        gather_grouped_linear(x_TD, token_P, pos_TK, weights.w1_SDF, weights.b1_SF, *meta),
        activation,
    )
    if activation == "swiglu":
        h_PF = h_PF * gather_grouped_linear(
            x_TD, token_P, pos_TK, weights.w3_SDF, weights.b3_SF, *meta
        )
    return grouped_linear_combine(h_PF, weights.w2_SFD, weights.b2_SD, *meta, pos_TK, weights_TK)
