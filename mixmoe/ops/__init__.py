"""Differentiable ops over the block layout (CPU torch implementations; CUDA kernels register
themselves on the same ops through ``torch.library``)."""

from mixmoe.ops.fused_linear import gather_grouped_linear, grouped_linear_combine
from mixmoe.ops.grouped_linear import grouped_linear, grouped_weight_grad
from mixmoe.ops.rows import combine_rows, gather_rows
from mixmoe.ops.token_expert_mlp import token_expert_mlp

__all__ = [
    "combine_rows",
    "gather_grouped_linear",
    "gather_rows",
    "grouped_linear",
    "grouped_linear_combine",
    "grouped_weight_grad",
    "token_expert_mlp",
]
