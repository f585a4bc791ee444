"""The expert MLP from a row source back to token (or return) order: gather, MLP over blocks,
weighted combine, on the fused ops on every device.

Legend: T tokens, K top-k, D model dim, F hidden dim, P padded rows.

    y_TD = combine_rows(expert_mlp(gather_rows(x_TD, token_P), ...), pos_TK, weights_TK)

is what it computes (``fused=False`` runs exactly that composition of the reference ops: the
tests' twin). The default runs the fused ops (``mixmoe.ops.fused_linear``): the first GEMM reads
``x_TD`` through ``token_P`` (no permuted copy of the input), the second writes straight to
token-choice order and the K choices are summed in a fixed order. On CUDA they are Triton kernels.
On CPU the same computation runs as one autograd function over the pieces of valid rows
(``mixmoe.ops.cpu_expert_mlp``: each input gathered once, no pass over padding rows), for CPU
tensors of one dtype; other CPU calls (e.g. zero tokens, or ``x`` and the weights in different
dtypes: computed in ``promote(x, w)``, as the Triton launchers do) run the fused ops' torch
implementations. On a Hopper GPU, bf16 inputs over a slot-sorted layout (one device) run
through torch's grouped GEMM instead (``mixmoe.ops.grouped_mm_expert_mlp``;
``MIXMOE_GROUPED_MM=0`` keeps the Triton kernels). Same numbers up to float rounding, same autograd (dx, dW, db, d weights_TK).
"""

from __future__ import annotations

import torch

from mixmoe.ops.cpu_expert_mlp import cpu_path_applies, cpu_token_expert_mlp
from mixmoe.ops.expert_mlp import ExpertWeights, activate, expert_mlp, split_gate_up
from mixmoe.ops.fused_linear import gather_grouped_linear, grouped_linear_combine
from mixmoe.ops.grouped_mm_expert_mlp import (
    grouped_mm_path_applies,
    grouped_mm_token_expert_mlp,
)
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
    fused: bool = True,
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * mlp_{slot}(x_TD[t])`` over the row layout
    (``token_P``: token of each padded row, T for padding; ``pos_TK``: padded row of each choice,
    P for a dropped one; ``weights_TK=None``: unit weights). Output dtype: ``promote(x, w)``.

    ``fused``: True (default) runs the fused ops on every device; False the reference
    composition (same forward on CPU, backward equal up to float rounding)."""
    cpu = fused and cpu_path_applies(x_TD, pos_TK, weights, activation)
    grouped = fused and grouped_mm_path_applies(x_TD, pos_TK, weights, schedule, activation)
    if activation == "swiglu" and not (cpu or grouped):
        weights = split_gate_up(weights)  # [gate | up] in one w1: only these paths read it whole
    if grouped:
        return grouped_mm_token_expert_mlp(
            x_TD, token_P, pos_TK, weights_TK, weights, schedule, activation
        )
    if not fused:
        x_PD = gather_rows(x_TD, token_P)
        return combine_rows(expert_mlp(x_PD, weights, schedule, activation), pos_TK, weights_TK)
    if cpu:
        return cpu_token_expert_mlp(
            x_TD, token_P, pos_TK, weights_TK, weights, schedule, activation
        )
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
