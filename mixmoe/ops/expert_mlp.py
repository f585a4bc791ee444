"""The expert MLP over the block layout: grouped GEMM, activation, grouped GEMM.

Legend: S weight slots, D model dim, F hidden dim, P padded rows.

Weights are passed explicitly (``ExpertWeights``) so a strategy can run the same computation over
its own slots (owned experts plus replicas) without touching the module that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixmoe.ops.grouped_linear import grouped_linear
from mixmoe.schedule.blocks import BlockSchedule


@dataclass(frozen=True)
class ExpertWeights:
    """w1_SDF, w2_SFD, optional biases b1_SF / b2_SD, and for SwiGLU w3_SDF (+ b3_SF).

    SwiGLU may also come with w3 None and w1 [S, D, 2F] holding the gate columns then the up
    columns (``is_gate_up_concatenated``; b1 [S, 2F] likewise): transformers' concatenated
    ``gate_up_proj``. The CPU path computes both halves with one GEMM and returns one gradient
    for the whole tensor (no gradient of two slices to sum back); other paths split it into
    views first (``split_gate_up``)."""

    w1_SDF: torch.Tensor
    w2_SFD: torch.Tensor
    b1_SF: torch.Tensor | None = None
    b2_SD: torch.Tensor | None = None
    w3_SDF: torch.Tensor | None = None
    b3_SF: torch.Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.w1_SDF.shape[0]


def is_gate_up_concatenated(weights: ExpertWeights) -> bool:
    """True when w3 is None and w1 is twice as wide as w2 is tall: [gate | up] in w1."""
    return weights.w3_SDF is None and weights.w1_SDF.shape[2] == 2 * weights.w2_SFD.shape[1]


def split_gate_up(weights: ExpertWeights) -> ExpertWeights:
    """SwiGLU weights with [gate | up] concatenated in w1 (``is_gate_up_concatenated``) as w1
    (gate) and w3 (up) views; any other weights unchanged."""
    if not is_gate_up_concatenated(weights):
        return weights
    F = weights.w2_SFD.shape[1]
    w, b = weights.w1_SDF, weights.b1_SF
    return ExpertWeights(
        w[..., :F],
        weights.w2_SFD,
        None if b is None else b[..., :F],
        weights.b2_SD,
        w[..., F:],
        None if b is None else b[..., F:],
    )


ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")


def activate(h_PF: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h_PF)
    if activation == "relu":
        return F.relu(h_PF)
    return F.silu(h_PF)  # silu, and the gate half of swiglu


def activate_backward(grad: torch.Tensor, a: torch.Tensor, activation: str) -> torch.Tensor:
    """d activate(a) given d out, the derivative each activation's own autograd uses (the
    hand-written backward passes of the CPU and grouped-GEMM bodies)."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, a)
    if activation == "relu":
        return grad.masked_fill(a <= 0, 0.0)
    return torch.ops.aten.silu_backward(grad, a)


def expert_params(weights: ExpertWeights) -> list[torch.Tensor]:
    """Every tensor of ``weights`` that is not None."""
    return [
        p
        for p in (weights.w1_SDF, weights.w2_SFD, weights.b1_SF, weights.b2_SD)
        + (weights.w3_SDF, weights.b3_SF)
        if p is not None
    ]


def function_inputs(
    x_TD: torch.Tensor,
    token_P: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    weights: ExpertWeights,
) -> tuple:
    """The leading inputs of the hand-written expert-MLP autograd functions (CPU and grouped
    GEMM): ``x_TD, token_P, pos_TK`` (int64), ``weights_TK``, then w1, b1, w3, b3, w2, b2."""
    w = weights
    return (
        x_TD,
        token_P.to(torch.int64),
        pos_TK.to(torch.int64),
        weights_TK,
        w.w1_SDF,
        w.b1_SF,
        w.w3_SDF,
        w.b3_SF,
        w.w2_SFD,
        w.b2_SD,
    )


def gate_up_fits(weights: ExpertWeights, activation: str) -> bool:
    """The weights match the activation: SwiGLU with w3 or a [gate | up] w1; others without w3."""
    if activation == "swiglu":
        return weights.w3_SDF is not None or is_gate_up_concatenated(weights)
    return weights.w3_SDF is None


def expert_mlp(
    x_PD: torch.Tensor, weights: ExpertWeights, schedule: BlockSchedule, activation: str
) -> torch.Tensor:
    """out_PD = act(x @ w1 + b1) [* (x @ w3 + b3)] @ w2 + b2, per block with its slot's weights;
    masked rows are zero."""
    if activation == "swiglu":
        weights = split_gate_up(weights)
    meta = (schedule.block_slot_Nb, schedule.block_rows_Nb, schedule.block_size)
    h_PF = activate(grouped_linear(x_PD, weights.w1_SDF, weights.b1_SF, *meta), activation)
    if activation == "swiglu":
        h_PF = h_PF * grouped_linear(x_PD, weights.w3_SDF, weights.b3_SF, *meta)
    return grouped_linear(h_PF, weights.w2_SFD, weights.b2_SD, *meta)
