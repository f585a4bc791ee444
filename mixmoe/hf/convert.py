"""Exact conversion of Hugging Face transformers sparse-MoE blocks into mixmoe ``MoE`` layers.

Legend: B batch, L sequence, T = B*L tokens, D model dim, F expert hidden dim, N experts.

A transformers sparse-MoE block is ``gate`` (a top-k router), ``experts`` (decorated with
``@use_experts_implementation``) and, in some families, a SwiGLU shared MLP: ``shared_expert``
with a sigmoid ``shared_expert_gate`` ([1, D] linear; Qwen2-MoE) or ``shared_experts`` (DeepSeek,
GLM-4-MoE). ``convert_sparse_moe_block`` rebuilds it as ``MoEBlock``: a mixmoe ``MoE`` layer
holding copies of the router, expert and shared weights (the experts read through the one layout
adapter, ``hf_layout``; the shared MLP as the layer's ``shared`` experts). The converted block
computes the same function, forward and every gradient, up to float rounding; its ``moe`` can
then be expert-parallelized with ``mixmoe.parallel.parallelize_moe`` like any mixmoe layer.

Router semantics (``ROUTERS``, by router class; each kind's class list holds the routers whose
``forward`` is the same code in the installed transformers; anything else raises):

    softmax      (Mixtral, Qwen2/3-MoE, OLMoE, ...) softmax over N, top-k, renormalised when
                 the class always does (Mixtral) or ``norm_topk_prob`` -> ``softmax_renorm``,
                 else as they are -> ``softmax``; the router in the layer's dtype
    deepseek_v2  softmax scores in float32, top-k (``greedy``) or group-limited
                 (``group_limited_greedy``: groups scored by their best score), never
                 renormalised, times ``routed_scaling_factor`` -> score softmax, normalize
                 ``softmax``, group_score ``max``, route_scale, router_dtype float32
    deepseek_v3  sigmoid scores in float32; ``e_score_correction_bias`` added for SELECTION only
                 (groups scored by the sum of their two best biased scores, ``topk_group`` kept),
                 weights = the unbiased scores, renormalised iff ``norm_topk_prob``, times
                 ``routed_scaling_factor`` -> score sigmoid, normalize renorm | none, group_score
                 sum_top2, route_scale, router_dtype float32, expert_bias (copied: the layer's
                 aux-loss-free balancing then trains it, ``MoE.end_step``)

mixmoe picks the top k with ties going to the lower id; ``torch.topk`` leaves tie order
unspecified, so exact ties may pick differently. DeepSeek's renormalisation adds 1e-20 to the
denominator (a sum of positive scores): no float32 or float64 difference.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.config import GateConfig, MoEConfig
from mixmoe.hf.layout import hf_experts_layout, mixmoe_activation_of
from mixmoe.layers.moe import MoE
from mixmoe.types import MoEAux

# The router classes of the installed transformers (5.24) whose forward is the same code as the
# kind's first class, each checked by converting the family's whole tiny model
# (tests/unit/test_hf_convert.py). Same router code but not listed: AXK1 (a norm after the
# block), HY-V4 (clamped SwiGLU experts), Nemotron-H (relu^2 experts) cannot convert exactly;
# DeepSeek-OCR2, GLM-5-Next, HY-V4-VL, Qwen3-Omni have no tiny text model to check.
SOFTMAX_ALWAYS_RENORM = ("MixtralTopKRouter", "MiniMaxTopKRouter")
SOFTMAX_NORM_TOPK_PROB = (
    "Qwen2MoeTopKRouter",
    "Qwen3MoeTopKRouter",
    "OlmoeTopKRouter",
    "FlexOlmoTopKRouter",
    "MellumTopKRouter",
    "Qwen3NextTopKRouter",
    "Qwen4ExpTextTopKRouter",
)
DEEPSEEK_V2 = ("DeepseekV2TopkRouter", "UnlimitedOcrTextTopkRouter")
DEEPSEEK_V3 = (
    "DeepseekV3TopkRouter",
    "DeepseekV32TopkRouter",
    "Glm4MoeTopkRouter",
    "Glm4MoeLiteTopkRouter",
    "Glm4vMoeTextTopkRouter",
    "GlmMoeDsaTopkRouter",
    "BailingHybridTopkRouter",
    "Dots1TopkRouter",
    "Dots3NoteTextTopkRouter",
    "ExaoneMoeTopkRouter",
    "KimiLinearTopkRouter",
    "MiMoV2FlashTopkRouter",
    "SolarOpenTopkRouter",
)
# router class -> kind (see the module docstring)
ROUTERS: dict[str, str] = {
    **dict.fromkeys(SOFTMAX_ALWAYS_RENORM + SOFTMAX_NORM_TOPK_PROB, "softmax"),
    **dict.fromkeys(DEEPSEEK_V2, "deepseek_v2"),
    **dict.fromkeys(DEEPSEEK_V3, "deepseek_v3"),
}
SHARED_NAMES = ("shared_expert", "shared_experts")
# what a convertible block may hold: anything else (a norm after the experts, ...) would be lost
BLOCK_PARTS = ("gate", "experts", *SHARED_NAMES, "shared_expert_gate")


class MoEBlock(nn.Module):
    """A drop-in for a transformers sparse-MoE block: ``forward(hidden_states [B, L, D]) ->
    [B, L, D]`` (what the decoder layer expects), computed by ``self.moe`` (its shared experts
    included).

    The block contract of transformers has no room for auxiliary losses, so the mixmoe layer's
    ``MoEAux`` of this block's last forward is kept on ``self.last_aux`` (per module, never
    global): add ``block.last_aux.loss`` to the task loss to train with mixmoe's balance loss.
    """

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe
        self.last_aux: MoEAux | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y, self.last_aux = self.moe(hidden_states)
        return y


def gate_config(router: nn.Module) -> GateConfig:
    """The ``GateConfig`` computing what ``router`` computes (ValueError for an unknown class)."""
    name = type(router).__name__
    kind = ROUTERS.get(name)
    if kind is None:
        raise ValueError(
            f"router {name} has no known mixmoe equivalent; supported: {sorted(ROUTERS)}"
        )
    if kind == "softmax":
        renorm = name in SOFTMAX_ALWAYS_RENORM or bool(router.norm_topk_prob)
        return GateConfig(normalize="softmax_renorm" if renorm else "softmax", bias=False)
    common = {
        "bias": False,
        "route_scale": float(router.routed_scaling_factor),
        "router_dtype": "float32",  # transformers casts input and weight to float32
    }
    if kind == "deepseek_v2":
        if router.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"{name}: topk_method {router.topk_method!r} is unknown")
        groups = {}  # greedy: no group limit (n_group may be None then)
        if router.topk_method == "group_limited_greedy":
            groups = {"n_groups": int(router.num_group), "topk_groups": int(router.topk_group)}
        return GateConfig(normalize="softmax", group_score="max", **groups, **common)
    return GateConfig(
        score="sigmoid",
        normalize="renorm" if router.norm_topk_prob else "none",
        n_groups=int(router.num_group or 1),
        topk_groups=int(router.topk_group or 1),
        group_score="sum_top2",
        expert_bias=True,
        **common,
    )


def _shared_mlp(block: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(shared SwiGLU MLP or None, its sigmoid gate or None)."""
    found = [getattr(block, n) for n in SHARED_NAMES if getattr(block, n, None) is not None]
    if len(found) > 1:
        raise ValueError(f"{type(block).__name__} has both {SHARED_NAMES}: which one runs?")
    if not found:
        return None, None
    mlp = found[0]
    if mixmoe_activation_of(mlp.act_fn) != "silu":
        raise ValueError(
            f"shared expert act_fn {type(mlp.act_fn).__name__} is not silu: mixmoe's shared "
            "experts use the layer's activation (swiglu)"
        )
    return mlp, getattr(block, "shared_expert_gate", None)


@torch.no_grad()
def convert_sparse_moe_block(block: nn.Module) -> MoEBlock:
    """``MoEBlock`` computing what ``block`` computes, with copies of its weights (same device
    and dtype; a float32 router stays float32). Raises ValueError naming what has no exact mixmoe
    equivalent (router class, router jitter, a custom ``_apply_gate``, a non-SwiGLU activation,
    shared-expert biases, ...)."""
    for part in ("gate", "experts"):
        if not hasattr(block, part):
            raise TypeError(f"{type(block).__name__} has no .{part}: not a sparse-MoE block")
    if getattr(block, "jitter_noise", 0) or 0:
        raise ValueError(
            f"{type(block).__name__}: router_jitter_noise={block.jitter_noise} (multiplicative "
            "input noise in training) has no mixmoe equivalent; set it to 0 before converting"
        )
    extra = [n for n, _ in block.named_children() if n not in BLOCK_PARTS]
    if extra:
        raise ValueError(
            f"{type(block).__name__} has {extra} beside {BLOCK_PARTS}: the converted block "
            "would not run them; it has no exact mixmoe equivalent"
        )
    router, experts = block.gate, block.experts
    gate = gate_config(router)
    layout = hf_experts_layout(experts, require_mixmoe_activation=True)
    w = layout.weights
    N, D, F = w.w1_SDF.shape
    if router.weight.shape != (N, D):
        raise ValueError(f"router weight {tuple(router.weight.shape)} does not match [{N}, {D}]")
    mlp, mlp_gate = _shared_mlp(block)
    if mlp is not None:
        _check_shared(mlp, mlp_gate, w.b1_SF is not None, layout.activation)
    config = MoEConfig(
        model_dim=D,
        hidden_dim=F,
        num_experts=N,
        top_k=int(router.top_k),
        activation=layout.activation,
        bias=w.b1_SF is not None,
        gate=gate,
        shared_experts=0 if mlp is None else 1,
        shared_hidden_dim=None if mlp is None else mlp.gate_proj.out_features,
        shared_gate=mlp_gate is not None,
    )
    kw = {"device": experts.down_proj.device, "dtype": experts.down_proj.dtype}
    moe = MoE(config, **kw)
    moe.gate.wg.weight.copy_(router.weight)
    if gate.expert_bias:
        moe.gate.expert_bias.copy_(router.e_score_correction_bias)
    _copy_experts(moe, w)
    if mlp is not None:
        shared = moe.shared
        # nn.Linear holds [out, in]; mixmoe's shared MLP [in, out]
        shared.w1.copy_(mlp.gate_proj.weight.T)
        shared.w3.copy_(mlp.up_proj.weight.T)
        shared.w2.copy_(mlp.down_proj.weight.T)
        for name, lin in (("b1", mlp.gate_proj), ("b3", mlp.up_proj), ("b2", mlp.down_proj)):
            if lin.bias is not None:
                getattr(shared, name).copy_(lin.bias)
        if mlp_gate is not None:
            shared.gate_w.copy_(mlp_gate.weight[0])  # [1, D] -> [D]
    return MoEBlock(moe)


def _check_shared(mlp: nn.Module, gate: nn.Module | None, bias: bool, activation: str) -> None:
    if activation != "swiglu":
        raise ValueError(
            f"the routed experts run {activation!r} but the shared expert is SwiGLU: mixmoe's "
            "shared experts use the layer's activation"
        )
    for name in ("gate_proj", "up_proj", "down_proj"):
        if (getattr(mlp, name).bias is not None) != bias:
            raise ValueError(
                f"shared expert {name} bias={getattr(mlp, name).bias is not None} but the routed "
                f"experts have bias={bias}: mixmoe's shared experts follow the layer's bias"
            )
    if gate is not None and (gate.bias is not None or gate.weight.shape[0] != 1):
        raise ValueError("shared_expert_gate must be a [1, D] linear without bias")


def _copy_experts(moe: MoE, w) -> None:
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
