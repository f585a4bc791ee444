"""The way back from ``mixmoe.hf.convert``: a converted transformers model (its sparse-MoE blocks
replaced by ``MoEBlock``, then trained) as a plain transformers model again, so
``save_pretrained`` writes safetensors any transformers user can load, evaluate and serve.

Legend: S experts of a transformers module, D model dim, F expert hidden dim, N experts.

``export_moe_model(converted)`` builds a fresh model of the same class from the same config and
copies every weight in: the blocks' routers and experts through the one layout adapter
(``hf_experts_layout`` gives views of the fresh experts' parameters in mixmoe's layout, so a
copy into them writes transformers' own layout, transposed or concatenated as that family
stores it), a DeepSeek-V3 selection bias, the shared experts; every other tensor by name. The
result computes what the converted model computes (the conversion is exact both ways).
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.hf.convert import SHARED_NAMES, MoEBlock
from mixmoe.hf.layout import hf_experts_layout

# mixmoe Experts parameter -> ExpertWeights field (views of the transformers module)
_PAIRS = (
    ("w1", "w1_SDF"),
    ("w2", "w2_SFD"),
    ("w3", "w3_SDF"),
    ("b1", "b1_SF"),
    ("b2", "b2_SD"),
    ("b3", "b3_SF"),
)


def _copy_block(block: MoEBlock, target: nn.Module, name: str) -> None:
    moe = block.moe
    ex = moe.experts
    if ex.num_experts != ex.num_global_experts:
        raise ValueError(
            f"{name} holds {ex.num_experts} of {ex.num_global_experts} experts (an "
            "expert-parallel shard); export a model with every expert (gather it first, e.g. "
            "mixmoe checkpoint consolidate)"
        )
    router = target.gate
    if router.weight.shape != moe.gate.wg.weight.shape:
        raise ValueError(
            f"{name}: router {tuple(router.weight.shape)} vs mixmoe gate "
            f"{tuple(moe.gate.wg.weight.shape)}; export into the model's own config"
        )
    router.weight.copy_(moe.gate.wg.weight)
    bias = getattr(moe.gate, "expert_bias", None)
    if bias is not None:  # DeepSeek-V3's selection bias (moved by aux-loss-free balancing)
        router.e_score_correction_bias.copy_(bias)
    dst = hf_experts_layout(target.experts, require_mixmoe_activation=True).weights
    src = moe.experts
    for field, hf_field in _PAIRS:
        to, frm = getattr(dst, hf_field), getattr(src, field)
        if (to is None) != (frm is None):
            raise ValueError(f"{name}: expert {field} exists on one side only")
        if to is not None:
            to.copy_(frm)  # a view of transformers' tensor: writes its layout
    mlp = next((getattr(target, n) for n in SHARED_NAMES if hasattr(target, n)), None)
    shared = getattr(moe, "shared", None)
    if (mlp is None) != (shared is None):
        raise ValueError(f"{name}: a shared expert on one side only")
    if mlp is not None:
        # mixmoe's shared MLP holds [in, out]; nn.Linear [out, in]
        for part, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            getattr(mlp, part).weight.copy_(getattr(shared, w).T)
            lin_bias = getattr(mlp, part).bias
            if lin_bias is not None:
                lin_bias.copy_(getattr(shared, "b" + w[1:]))
        gate = getattr(target, "shared_expert_gate", None)
        if gate is not None:
            gate.weight.copy_(shared.gate_w[None, :])  # [D] -> [1, D]


@torch.no_grad()
def export_moe_model(converted: nn.Module) -> nn.Module:
    """A fresh transformers model of ``converted``'s class and config holding its weights
    (device and dtype of ``converted``); every ``MoEBlock`` back as the family's sparse-MoE
    block. ``converted`` is left unchanged. Call ``save_pretrained`` on the result."""
    config = getattr(converted, "config", None)
    if config is None or not hasattr(type(converted), "from_pretrained"):
        raise TypeError(f"{type(converted).__name__} is not a transformers model")
    blocks = {n: m for n, m in converted.named_modules() if isinstance(m, MoEBlock)}
    if not blocks:
        raise ValueError(f"{type(converted).__name__} has no converted MoEBlock to export")
    param = next(converted.parameters())
    fresh = type(converted)(config).to(device=param.device, dtype=param.dtype)
    for name, block in blocks.items():
        _copy_block(block, fresh.get_submodule(name), name)
    own = fresh.state_dict()
    for key, value in converted.state_dict().items():
        if any(key.startswith(f"{name}.") for name in blocks):
            continue
        if key not in own:
            raise ValueError(f"{key} of the converted model has no place in {type(fresh).__name__}")
        own[key].copy_(value)
    return fresh.eval() if not converted.training else fresh.train()
