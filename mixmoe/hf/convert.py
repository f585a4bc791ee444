"""Exact conversion of Hugging Face transformers sparse-MoE blocks into mixmoe ``MoE`` layers.

Legend: B batch, L sequence, T = B*L tokens, D model dim, F expert hidden dim, N experts.

A transformers sparse-MoE block is ``gate`` (a top-k router), ``experts`` (decorated with
``@use_experts_implementation``) and, in some families, ``shared_expert`` (a SwiGLU MLP) with
``shared_expert_gate`` (a [1, D] linear, sigmoid). ``convert_sparse_moe_block`` rebuilds it as
``MoEBlock``: a mixmoe ``MoE`` layer holding copies of the router and expert weights (read through
the one layout adapter, ``hf_layout``), plus ``SharedExpert`` beside it. The converted block
computes the same function, forward and every gradient, up to float rounding; its ``moe`` can
then be expert-parallelized with ``mixmoe.parallel.parallelize_moe`` like any mixmoe layer.

Router semantics (``ROUTERS``, by router class; anything else raises):

    MixtralTopKRouter                 softmax over N, top-k, renormalised   -> softmax_renorm
    Qwen2Moe / Qwen3Moe / Olmoe       softmax over N, top-k, renormalised iff norm_topk_prob
                                      (``softmax_renorm``), else as they are (``softmax``)

mixmoe picks the top k of the logits (the same order as of the probabilities) with ties going to
the lower id; ``torch.topk`` leaves tie order unspecified, so exact ties may pick differently.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.config import GateConfig, MoEConfig
from mixmoe.hf.layout import hf_experts_layout, mixmoe_activation_of
from mixmoe.layers.moe import MoE
from mixmoe.types import MoEAux

# router class -> whether it always renormalises (True) or follows its ``norm_topk_prob``
ROUTERS: dict[str, bool | None] = {
    "MixtralTopKRouter": True,
    "Qwen2MoeTopKRouter": None,
    "Qwen3MoeTopKRouter": None,
    "OlmoeTopKRouter": None,
}


class SharedExpert(nn.Module):
    """``y = [sigmoid(x @ g)] * down(silu(gate(x)) * up(x))``: the shared expert of Qwen-MoE
    style blocks (``gated=False``: without the sigmoid gate). No biases."""

    def __init__(self, model_dim: int, hidden_dim: int, *, gated: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(model_dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(model_dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, model_dim, bias=False)
        self.gate = nn.Linear(model_dim, 1, bias=False) if gated else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h = nn.functional.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD)
        y_TD = self.down_proj(h)
        return y_TD if self.gate is None else torch.sigmoid(self.gate(x_TD)) * y_TD


class MoEBlock(nn.Module):
    """A drop-in for a transformers sparse-MoE block: ``forward(hidden_states [B, L, D]) ->
    [B, L, D]`` (what the decoder layer expects), computed by ``self.moe`` (+ ``self.shared``).

    The block contract of transformers has no room for auxiliary losses, so the mixmoe layer's
    ``MoEAux`` of this block's last forward is kept on ``self.last_aux`` (per module, never
    global): add ``block.last_aux.loss`` to the task loss to train with mixmoe's balance loss.
    """

    def __init__(self, moe: MoE, shared: SharedExpert | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.shared = shared
        self.last_aux: MoEAux | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y, self.last_aux = self.moe(hidden_states)
        if self.shared is not None:
            y = y + self.shared(hidden_states)
        return y


def _router_normalize(router: nn.Module) -> str:
    name = type(router).__name__
    if name not in ROUTERS:
        raise ValueError(
            f"router {name} has no known mixmoe equivalent; supported: {sorted(ROUTERS)}"
        )
    always = ROUTERS[name]
    renorm = always if always is not None else bool(router.norm_topk_prob)
    return "softmax_renorm" if renorm else "softmax"


def _check_shared(mlp: nn.Module) -> None:
    if mixmoe_activation_of(mlp.act_fn) != "silu":
        raise ValueError(
            f"shared_expert act_fn {type(mlp.act_fn).__name__} is not silu: SharedExpert is SwiGLU"
        )
    for name in ("gate_proj", "up_proj", "down_proj"):
        if getattr(mlp, name).bias is not None:
            raise ValueError(f"shared_expert.{name} has a bias; SharedExpert has none")


@torch.no_grad()
def convert_sparse_moe_block(block: nn.Module) -> MoEBlock:
    """``MoEBlock`` computing what ``block`` computes, with copies of its weights (same device
    and dtype). Raises ValueError naming what has no exact mixmoe equivalent (router class,
    router jitter, a custom ``_apply_gate``, a non-SwiGLU activation, ...)."""
    for part in ("gate", "experts"):
        if not hasattr(block, part):
            raise TypeError(f"{type(block).__name__} has no .{part}: not a sparse-MoE block")
    if getattr(block, "jitter_noise", 0) or 0:
        raise ValueError(
            f"{type(block).__name__}: router_jitter_noise={block.jitter_noise} (multiplicative "
            "input noise in training) has no mixmoe equivalent; set it to 0 before converting"
        )
    router, experts = block.gate, block.experts
    normalize = _router_normalize(router)
    layout = hf_experts_layout(experts, require_mixmoe_activation=True)
    w = layout.weights
    N, D, F = w.w1_SDF.shape
    if router.weight.shape != (N, D):
        raise ValueError(f"router weight {tuple(router.weight.shape)} does not match [{N}, {D}]")
    config = MoEConfig(
        model_dim=D,
        hidden_dim=F,
        num_experts=N,
        top_k=int(router.top_k),
        activation=layout.activation,
        bias=w.b1_SF is not None,
        gate=GateConfig(type="topk", normalize=normalize, bias=False),
    )
    kw = {"device": router.weight.device, "dtype": router.weight.dtype}
    moe = MoE(config, **kw)
    moe.gate.wg.weight.copy_(router.weight)
    for name, src in (("w1", w.w1_SDF), ("w2", w.w2_SFD), ("w3", w.w3_SDF)):
        dst = getattr(moe.experts, name)
        if (dst is None) != (src is None):
            raise ValueError(f"expert weight {name}: layout and mixmoe layer disagree")
        if dst is not None:
            dst.copy_(src)
    for name, src in (("b1", w.b1_SF), ("b2", w.b2_SD), ("b3", w.b3_SF)):
        dst = getattr(moe.experts, name)
        if dst is not None:
            dst.copy_(src)
    shared = None
    mlp = getattr(block, "shared_expert", None)
    if mlp is not None:
        _check_shared(mlp)
        gate = getattr(block, "shared_expert_gate", None)
        shared = SharedExpert(D, mlp.gate_proj.out_features, gated=gate is not None).to(**kw)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(shared, name).weight.copy_(getattr(mlp, name).weight)
        if gate is not None:
            if gate.bias is not None:
                raise ValueError("shared_expert_gate has a bias; SharedExpert's gate has none")
            shared.gate.weight.copy_(gate.weight)
    return MoEBlock(moe, shared)


def convert_moe_model(model: nn.Module) -> list[str]:
    """Replace, in place, every sparse-MoE block of ``model`` whose router ``ROUTERS`` knows by
    its ``MoEBlock``; returns the names of the replaced modules (ValueError if there is none)."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(getattr(module, "gate", None)).__name__ in ROUTERS and hasattr(module, "experts")
    ]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no sparse-MoE block with a router in {sorted(ROUTERS)}"
        )
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, convert_sparse_moe_block(module))
    return [name for name, _ in targets]
