"""Differentiable ops over the block layout (CPU torch implementations; CUDA kernels register
themselves on the same ops through ``torch.library``)."""

from mixmoe.ops.grouped_linear import grouped_linear, grouped_weight_grad
from mixmoe.ops.rows import combine_rows, gather_rows

__all__ = ["combine_rows", "gather_rows", "grouped_linear", "grouped_weight_grad"]
