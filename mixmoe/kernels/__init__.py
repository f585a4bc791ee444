"""Triton kernels over the block layout (no autograd, no torch.distributed).

- ``grouped_gemm``:          block-wise GEMM with fused gather (rows read through an index),
                             bias, per-row scale and scatter (rows written through an index);
                             with ``w.transpose(1, 2)`` it is the dX GEMM of the backward pass.
- ``grouped_weight_grad``:   per-slot dW / db reductions over a slot's blocks.
- ``combine_choices``:       deterministic weighted sum of each token's K choice rows.
- ``combine_weights_grad``:  gradient of the combine weights (row dot products).

Launchers check -> allocate -> launch, accept ``out=``, take the block size from the caller (the
schedule's), accumulate in fp32 and accept fp32/fp16/bf16. ``mixmoe.ops`` registers them as the
CUDA implementations of its ``torch.library`` ops and imports this package only when a CUDA tensor
reaches one of those ops, so ``import mixmoe`` never needs Triton.

Checking them: ``pytest tests/kernels`` runs every kernel against a torch reference under the
Triton CPU interpreter when no GPU is present (compiled on CUDA otherwise);
``pytest tests/kernels -m gpu`` adds real sizes, the autotuned launches and the whole MoE layer on
CUDA vs CPU; ``mixmoe bench kernels --dtype bf16 --model-dim 1024 --hidden-size 4096`` times them
against per-expert matmuls, ``torch.nn.functional.grouped_mm`` and a dense matmul of equal FLOPs.
"""

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mixmoe's CUDA kernels need Triton (>= 3.0): pip install 'mixmoe[triton]' "
        "(CUDA builds of torch usually ship it)"
    ) from exc

from mixmoe.kernels.combine import combine_choices, combine_weights_grad
from mixmoe.kernels.grouped_gemm import grouped_gemm
from mixmoe.kernels.launch import TileConfig
from mixmoe.kernels.weight_grad import grouped_weight_grad

__all__ = [
    "TileConfig",
    "combine_choices",
    "combine_weights_grad",
    "grouped_gemm",
    "grouped_weight_grad",
]
