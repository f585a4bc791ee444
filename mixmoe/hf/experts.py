"""mixmoe as a transformers experts implementation: ``ExpertsInterface`` entry ``"mixmoe"``.

Legend: T tokens, K top-k, D model dim, F hidden dim, S experts (weight slots), P padded rows.

transformers calls ``fn(self, hidden_states, top_k_index, top_k_weights)`` on an experts module
decorated with ``@use_experts_implementation`` once a model ran
``model.set_experts_implementation("mixmoe")`` (after ``import mixmoe.hf``). The module's
weights are read through the layout adapter (``hf_layout``: views, gradients reach the module's
own parameters), the rows are laid out by ``expert_row_layout`` (the one host sync), and the
experts run on mixmoe's fused ops:

    activation a mixmoe one, no post-norm:  token_expert_mlp (gather-GEMM, act, GEMM-combine)
    otherwise:  gather_grouped_linear -> the module's _apply_gate / act_fn -> GEMM
                -> [post_expert_norm, combine_rows] or grouped_linear_combine

Ids outside ``[0, num_experts)`` (transformers' expert-parallel sentinels, ``>= num_experts``)
are dropped choices: no compute, no output, no gradient to their routing weight.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.hf.layout import HFExpertsLayout, hf_experts_layout
from mixmoe.ops import (
    combine_rows,
    gather_grouped_linear,
    grouped_linear,
    grouped_linear_combine,
    token_expert_mlp,
)
from mixmoe.ops.expert_mlp import ExpertWeights, activate, split_gate_up
from mixmoe.schedule.blocks import BlockSchedule

BLOCK_SIZE = 64


def mixmoe_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``y_TD[t] = sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t])``,
    the transformers experts contract, computed by mixmoe. Output dtype: ``hidden_states``'."""
    if hidden_states.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(
            f"expected hidden_states [T, D] and top_k_index / top_k_weights [T, K], got "
            f"{tuple(hidden_states.shape)}, {tuple(top_k_index.shape)}, "
            f"{tuple(top_k_weights.shape)}"
        )
    spec = hf_experts_layout(self)
    S = spec.num_experts
    ids_TK = top_k_index.to(torch.int64)
    ids_TK = torch.where((ids_TK >= 0) & (ids_TK < S), ids_TK, -1)
    layout = expert_row_layout(ids_TK, S, BLOCK_SIZE)
    weights_TK = top_k_weights.to(combine_dtype(hidden_states, spec))
    y_TD = run_layout_rows(
        spec,
        spec.weights,
        hidden_states,
        layout.token_P,
        layout.pos_TK,
        weights_TK,
        layout.schedule,
    )
    return y_TD.to(hidden_states.dtype)


def combine_dtype(hidden_states: torch.Tensor, spec: HFExpertsLayout) -> torch.dtype:
    """The dtype the routing weights are combined in: ``promote(hidden_states, weights)``."""
    return torch.promote_types(hidden_states.dtype, spec.weights.w1_SDF.dtype)


def run_layout_rows(
    spec: HFExpertsLayout,
    w: ExpertWeights,
    x_TD: torch.Tensor,
    token_P: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    sched: BlockSchedule,
) -> torch.Tensor:
    """One pass of a transformers experts layout over mixmoe's row layout: the rows
    ``x_TD[token_P]`` through the experts of their block's slot in ``w`` (the module's own
    weights, or replicas shaped like them), written through ``pos_TK`` with ``weights_TK`` (None:
    unit weights, e.g. received rows returned in order). ``spec`` says how to compute
    (activation, ``_apply_gate`` / ``act_fn``, post-norm); ``w`` which weights. Used by the
    single-device experts forward and by every work item of the expert-parallel path
    (``mixmoe.hf.ep``)."""
    if spec.activation is not None and spec.post_norm is None:
        return token_expert_mlp(x_TD, token_P, pos_TK, weights_TK, w, sched, spec.activation)
    meta = (sched.block_slot_Nb, sched.block_rows_Nb, sched.block_size)
    if spec.activation == "swiglu":
        w = split_gate_up(w)
    h_PF = gather_grouped_linear(x_TD, token_P, pos_TK, w.w1_SDF, w.b1_SF, *meta)
    if spec.activation is not None:  # a mixmoe activation, but a post-norm follows
        h_PF = activate(h_PF, "silu" if spec.activation == "swiglu" else spec.activation)
        if spec.activation == "swiglu":
            h_PF = h_PF * gather_grouped_linear(x_TD, token_P, pos_TK, w.w3_SDF, w.b3_SF, *meta)
    else:
        # padding rows are zero here; whatever the function makes of them is masked by the
        # next GEMM, which reads only valid rows
        h_PF = spec.elementwise(h_PF)
    if spec.post_norm is None:
        return grouped_linear_combine(h_PF, w.w2_SFD, w.b2_SD, *meta, pos_TK, weights_TK)
    out_PD = spec.post_norm(grouped_linear(h_PF, w.w2_SFD, w.b2_SD, *meta))
    return combine_rows(out_PD, pos_TK, weights_TK)
