"""Shared helpers of the unit tests: reproducible per-case seeds, layer construction, and the
oracle's parameter dict built from a layer's own parameters.

Legend: T tokens, D model dim, F hidden dim, N experts, K top-k.
"""

from __future__ import annotations

import zlib

import torch

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.layers.experts import EXPERT_PARAM_NAMES

# float32 layer vs float32 oracle: different summation orders (blocked GEMM vs per-token loop,
# vectorised vs Python-sum losses) differ by a few ulps of intermediate values, up to ~1e-6
# relative after the backward; 1e-4 / 1e-5 leaves headroom without hiding real bugs (those are O(1)).
F32_TOL = {"rtol": 1e-4, "atol": 1e-5}


def seed_for(*params: object) -> int:
    """A stable seed per test case (``hash`` of strings is salted per process, crc32 is not)."""
    return zlib.crc32(repr(params).encode())


def default_top_k(gate: str, num_experts: int) -> int:
    return {"switch": 1, "gshard": 2}.get(gate, min(2, num_experts))


def make_layer(
    *,
    gate: str = "topk",
    normalize: str = "topk_softmax",
    activation: str = "gelu",
    num_experts: int = 4,
    top_k: int | None = None,
    model_dim: int = 8,
    hidden_dim: int = 12,
    block_size: int = 64,
    dtype: torch.dtype = torch.float64,
    bias: bool = True,
    gate_bias: bool = True,
    random_routing: bool = False,
    jitter_eps: float = 0.0,
    aux_loss_coef: float = 0.1,
    z_loss_coef: float = 0.01,
) -> MoE:
    cfg = MoEConfig(
        model_dim=model_dim,
        hidden_dim=hidden_dim,
        num_experts=num_experts,
        top_k=default_top_k(gate, num_experts) if top_k is None else top_k,
        activation=activation,
        bias=bias,
        gate=GateConfig(
            type=gate,
            normalize=normalize,
            bias=gate_bias,
            random_routing=random_routing,
            jitter_eps=jitter_eps,
        ),
        aux_loss_coef=aux_loss_coef,
        z_loss_coef=z_loss_coef,
        block_size=block_size,
    )
    return MoE(cfg, dtype=dtype)


def reference_params(layer: MoE) -> dict:
    """The oracle's params: detached clones of the layer's own, so each side gets its own grads."""
    params = {"gate_w": layer.gate.wg.weight, "gate_b": layer.gate.wg.bias}
    for name in EXPERT_PARAM_NAMES:
        params[name] = getattr(layer.experts, name)
    return {
        k: (None if v is None else v.detach().clone().requires_grad_()) for k, v in params.items()
    }


def layer_params(layer: MoE) -> dict:
    """The layer's parameters under the oracle's names (None where absent)."""
    params = {"gate_w": layer.gate.wg.weight, "gate_b": layer.gate.wg.bias}
    for name in EXPERT_PARAM_NAMES:
        params[name] = getattr(layer.experts, name)
    return params
