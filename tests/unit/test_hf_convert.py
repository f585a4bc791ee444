"""Converted transformers sparse-MoE blocks equal the originals (forward and every gradient, in
float32 and float64), for Mixtral, Qwen2-MoE (shared expert with its sigmoid gate; norm_topk_prob
True and False), Qwen3-MoE, OLMoE, DeepSeek-V2 (greedy and group-limited), DeepSeek-V3 and
GLM-4-MoE (sigmoid, group-limited, scaled, e_score_correction_bias as the selection bias, shared
experts); whole tiny models too (logits, loss and the gradient of every parameter) for every
installed family whose router ``ROUTERS`` knows; and what has no exact equivalent raises.

float64: DeepSeek-style routers run in float32 whatever the model's dtype (transformers casts
input and weight; the converted gate keeps ``router_dtype="float32"``), so the router weight's
gradient, and what flows back through the router, carry float32 rounding on both sides.

Legend: T tokens, D model dim.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from mixmoe.hf.convert import ROUTERS, MoEBlock, convert_moe_model, convert_sparse_moe_block
from mixmoe.hf.layout import expert_weights, read_flags
from mixmoe.layers.moe import MoE

TOLS = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.float64: {"rtol": 1e-6, "atol": 1e-9},  # float32 routers (module docstring)
}
# float64, softmax routers: transformers takes the softmax of float64 logits in float32
# (``softmax(logits.float())``), which no mixmoe option spells (float32 logits round otherwise)
SOFTMAX_F64 = {"rtol": 1e-4, "atol": 1e-6}
TOL = TOLS[torch.float32]


def tolerance(router: torch.nn.Module, dtype: torch.dtype) -> dict[str, float]:
    softmax = ROUTERS[type(router).__name__] == "softmax"
    return SOFTMAX_F64 if softmax and dtype == torch.float64 else TOLS[dtype]


SIZES = {"hidden_size": 16, "num_experts_per_tok": 2}
DEEPSEEK = {
    **SIZES,
    "moe_intermediate_size": 12,
    "n_shared_experts": 2,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def _random_(module: torch.nn.Module, seed: int) -> None:
    """Noise on every parameter, and on the routers' selection bias (zero at init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for m in module.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.1 * torch.randn(m.num_experts, generator=gen))


BLOCKS = {
    "mixtral": lambda: MixtralSparseMoeBlock(
        MixtralConfig(**SIZES, intermediate_size=24, num_local_experts=4)
    ),
    "qwen2_moe-renorm": lambda: Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            **SIZES,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            num_experts=5,
            norm_topk_prob=True,
        )
    ),
    "qwen2_moe-no-renorm": lambda: Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            **SIZES,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            num_experts=5,
            norm_topk_prob=False,
        )
    ),
    "qwen3_moe": lambda: Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(**SIZES, moe_intermediate_size=12, num_experts=6, norm_topk_prob=False)
    ),
    "olmoe": lambda: OlmoeSparseMoeBlock(
        OlmoeConfig(**SIZES, intermediate_size=12, num_experts=4, norm_topk_prob=True)
    ),
    "deepseek_v2-greedy": lambda: DeepseekV2Moe(
        DeepseekV2Config(**{**DEEPSEEK, "n_group": None}, topk_method="greedy")
    ),
    "deepseek_v2-group-limited": lambda: DeepseekV2Moe(
        DeepseekV2Config(**DEEPSEEK, topk_method="group_limited_greedy")
    ),
    "deepseek_v3": lambda: DeepseekV3MoE(DeepseekV3Config(**DEEPSEEK, norm_topk_prob=True)),
    "deepseek_v3-no-renorm": lambda: DeepseekV3MoE(
        DeepseekV3Config(**DEEPSEEK, norm_topk_prob=False)
    ),
    "glm4_moe": lambda: Glm4MoeMoE(Glm4MoeConfig(**DEEPSEEK, norm_topk_prob=True)),
}


def _expected_grads(block) -> dict[str, torch.Tensor]:
    """The original block's gradients, named (and laid out) as the converted block's."""
    grads = {"moe.gate.wg.weight": block.gate.weight.grad}
    g = expert_weights(
        {n: p.grad for n, p in block.experts.named_parameters()}, read_flags(block.experts)
    )
    for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
        t = getattr(g, next(f for f in g.__dataclass_fields__ if f.startswith(name + "_")))
        if t is not None:
            grads[f"moe.experts.{name}"] = t
    mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if mlp is not None:  # nn.Linear [out, in] -> mixmoe [in, out]
        for name, lin in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            grads[f"moe.shared.{name}"] = getattr(mlp, lin).weight.grad.T
    if getattr(block, "shared_expert_gate", None) is not None:
        grads["moe.shared.gate_w"] = block.shared_expert_gate.weight.grad[0]
    return grads


def _close(got, ref, tol, what):
    assert_close(got.to(ref.dtype), ref, **tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_converted_block_equals_original(name, dtype):
    block = BLOCKS[name]().to(dtype).eval()
    _random_(block, seed=len(name))
    converted = convert_sparse_moe_block(block)
    assert isinstance(converted, MoEBlock) and isinstance(converted.moe, MoE)
    shared = hasattr(block, "shared_expert") or hasattr(block, "shared_experts")
    assert (converted.moe.shared is not None) == shared
    tol = tolerance(block.gate, dtype)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 11, 16, generator=gen, dtype=dtype)
    dy = torch.randn(3, 11, 16, generator=gen, dtype=dtype)
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_ref = block(x_ref)
    y = converted(x_new)
    _close(y, y_ref, tol, "output")
    (y_ref * dy).sum().backward()
    (y * dy).sum().backward()
    _close(x_new.grad, x_ref.grad, tol, "x grad")
    expected = _expected_grads(block)
    params = dict(converted.named_parameters())
    assert set(params) == set(expected), set(params) ^ set(expected)
    for pname, g_ref in expected.items():
        _close(params[pname].grad, g_ref, tol, pname)
    # the aux of the last forward is reachable on the block, with its counts
    assert converted.last_aux.counts_N.sum().item() == 33 * 2
    # the same choices as the original router (the bias counts for selection only)
    ids_ref = block.gate(x.reshape(-1, 16))[2]
    ids = converted.moe.gate(x.reshape(-1, 16))[0].ids_TK
    assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)


def test_deepseek_v3_selection_bias_is_kept_and_matters():
    """The converted gate holds e_score_correction_bias as its expert_bias (float32, selection
    only) and a large bias changes the choices of both the same way."""
    block = BLOCKS["deepseek_v3"]().float()
    _random_(block, seed=5)
    with torch.no_grad():
        block.gate.e_score_correction_bias[3] = 5.0  # expert 3 always chosen
    converted = convert_sparse_moe_block(block)
    gate = converted.moe.gate
    assert gate.expert_bias.dtype == torch.float32 and gate.wg.weight.dtype == torch.float32
    assert torch.equal(gate.expert_bias, block.gate.e_score_correction_bias)
    cfg = gate.config.gate
    assert (cfg.score, cfg.n_groups, cfg.topk_groups, cfg.route_scale) == ("sigmoid", 4, 2, 2.5)
    x = torch.randn(20, 16)
    ids = gate(x)[0].ids_TK
    assert bool((ids == 3).any(-1).all())
    assert torch.equal(ids.sort(-1).values, block.gate(x)[2].sort(-1).values)
    converted.moe.to(torch.float64)  # the router and its bias stay float32
    assert gate.wg.weight.dtype == torch.float32 and gate.expert_bias.dtype == torch.float32


def test_norm_topk_prob_false_keeps_probabilities():
    """Without renormalisation the routing weights sum to less than one (so the option matters)."""
    block = BLOCKS["qwen2_moe-no-renorm"]().float()
    _random_(block, seed=3)
    assert convert_sparse_moe_block(block).moe.config.gate.normalize == "softmax"
    x = torch.randn(9, 16)
    assert bool((block.gate(x)[1].sum(-1) < 1 - 1e-3).all())


def test_whole_tiny_mixtral_equals_original():
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).float().eval()
    model.set_experts_implementation("eager")
    converted = copy.deepcopy(model)
    names = convert_moe_model(converted)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    out_ref = model(input_ids=ids, labels=ids)
    out = converted(input_ids=ids, labels=ids)
    assert_close(out.logits, out_ref.logits, **TOL)
    assert_close(out.loss, out_ref.loss, **TOL)
    out_ref.loss.backward()
    out.loss.backward()
    params = dict(converted.named_parameters())
    seen = set()
    for pname, p in model.named_parameters():
        if ".mlp." in pname:
            continue
        assert_close(params[pname].grad, p.grad, **TOL, msg=lambda m, n=pname: f"{n}: {m}")
        seen.add(pname)
    for layer in names:
        block = model.get_submodule(layer)
        for pname, g_ref in _expected_grads(block).items():
            full = f"{layer}.{pname}"
            assert_close(params[full].grad, g_ref, **TOL, msg=lambda m, n=full: f"{n}: {m}")
            seen.add(full)
    assert seen == set(params), set(params) - seen


def test_conversion_errors_name_the_problem():
    block = MixtralSparseMoeBlock(
        MixtralConfig(**SIZES, intermediate_size=8, num_local_experts=4, router_jitter_noise=0.1)
    )
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        convert_sparse_moe_block(block)
    gpt_oss = GptOssMLP(
        GptOssConfig(
            hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2
        )
    )
    with pytest.raises(TypeError, match="GptOssMLP has no .gate"):
        convert_sparse_moe_block(gpt_oss)  # its router is `.router`: not a known block
    block = BLOCKS["olmoe"]()
    block.gate = gpt_oss.router
    with pytest.raises(ValueError, match="router GptOssTopKRouter has no known mixmoe"):
        convert_sparse_moe_block(block)
    with pytest.raises(ValueError, match="custom _apply_gate"):
        from mixmoe.hf.layout import hf_experts_layout

        hf_experts_layout(gpt_oss.experts, require_mixmoe_activation=True)
    with pytest.raises(ValueError, match="has no sparse-MoE block"):
        convert_moe_model(torch.nn.Linear(2, 2))
    block = BLOCKS["deepseek_v3"]()
    block.post_mlp_layernorm = torch.nn.LayerNorm(16)  # AXK1's block: a norm after the experts
    with pytest.raises(ValueError, match=r"\['post_mlp_layernorm'\] beside"):
        convert_sparse_moe_block(block)
    block = BLOCKS["deepseek_v2-greedy"]()
    block.gate.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is unknown"):
        convert_sparse_moe_block(block)


def _families_with_known_routers() -> dict[str, list[str]]:
    """Installed families whose modeling module defines a router class ``ROUTERS`` knows."""
    from _hf_families import moe_families, transformers_models_dir

    out = {}
    for family, experts in moe_families().items():
        src = (transformers_models_dir() / family / f"modeling_{family}.py").read_text()
        if any(f"class {name}(" in src for name in ROUTERS):
            out[family] = experts
    return out


FAMILIES = _families_with_known_routers()
# sizes where the routing options matter: 8 experts in 4 groups, 2 kept, scaled
FAMILY_EXTRA = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
for _key in ("num_local_experts", "num_experts", "n_routed_experts"):
    FAMILY_EXTRA[_key] = 8


def _logits_loss(model, ids):
    """A causal LM's logits and loss; a base model's last hidden state and a fixed projection."""
    out = model(input_ids=ids, labels=ids, use_cache=False)
    if getattr(out, "logits", None) is not None:
        return out.logits, out.loss
    h = out.last_hidden_state
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(1), dtype=h.dtype)
    return h, (h * probe).sum()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_whole_tiny_model_equals_eager(family):
    """logits, loss and the gradient of every parameter of the family's tiny model, converted
    (every block with a known router), equal the original (eager experts), float32 and float64."""
    from _hf_families import NotBuildable, build_tiny

    try:
        extra = {k: v for k, v in FAMILY_EXTRA.items()}
        base, _ = build_tiny(family, FAMILIES[family], seed=sum(map(ord, family)), extra=extra)
    except NotBuildable as e:
        pytest.fail(f"{family} has a known router but no tiny model: {e}")
    base.set_experts_implementation("eager")
    ids = torch.randint(
        1, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3)
    )
    for dtype in (torch.float32, torch.float64):
        model = copy.deepcopy(base).to(dtype)
        model.train(False)
        converted = copy.deepcopy(model)
        names = convert_moe_model(converted)
        tol = tolerance(model.get_submodule(names[0]).gate, dtype)
        (logits_ref, loss_ref), (logits, loss) = (_logits_loss(m, ids) for m in (model, converted))
        _close(logits, logits_ref, tol, f"{family} {dtype} logits")
        _close(loss, loss_ref, tol, f"{family} {dtype} loss")
        loss_ref.backward()
        loss.backward()
        params = dict(converted.named_parameters())
        blocks = tuple(f"{n}." for n in names)
        expected = {n: p.grad for n, p in model.named_parameters() if not n.startswith(blocks)}
        for layer in names:
            for pname, g in _expected_grads(model.get_submodule(layer)).items():
                expected[f"{layer}.{pname}"] = g
        assert set(expected) == set(params), set(expected) ^ set(params)
        for pname, g_ref in expected.items():
            if g_ref is None:
                assert params[pname].grad is None, pname
            else:
                _close(params[pname].grad, g_ref, tol, f"{family} {dtype} grad of {pname}")
