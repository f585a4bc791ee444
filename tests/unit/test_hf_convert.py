"""Converted transformers sparse-MoE blocks equal the originals (forward and every gradient,
float32), for Mixtral, Qwen2-MoE (shared expert with its sigmoid gate; norm_topk_prob True and
False), Qwen3-MoE and OLMoE; the whole tiny Mixtral model too (logits and the loss gradient of
every parameter); and what has no exact equivalent raises.

Legend: T tokens, D model dim.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close
from transformers import (
    GptOssConfig,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from mixmoe.hf.convert import MoEBlock, convert_moe_model, convert_sparse_moe_block
from mixmoe.hf.layout import expert_weights, read_flags
from mixmoe.layers.moe import MoE

TOL = {"rtol": 1e-4, "atol": 1e-5}
SIZES = {"hidden_size": 16, "num_experts_per_tok": 2}


def _random_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))


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
}


def _expected_grads(block) -> dict[str, torch.Tensor]:
    """The original block's gradients, named as the converted block's parameters."""
    grads = {"moe.gate.wg.weight": block.gate.weight.grad}
    g = expert_weights(
        {n: p.grad for n, p in block.experts.named_parameters()}, read_flags(block.experts)
    )
    for name, t in (("w1", g.w1_SDF), ("w2", g.w2_SFD), ("w3", g.w3_SDF)):
        grads[f"moe.experts.{name}"] = t
    if getattr(block, "shared_expert", None) is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            grads[f"shared.{name}.weight"] = getattr(block.shared_expert, name).weight.grad
        grads["shared.gate.weight"] = block.shared_expert_gate.weight.grad
    return grads


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_converted_block_equals_original(name):
    block = BLOCKS[name]().float().eval()
    _random_(block, seed=len(name))
    converted = convert_sparse_moe_block(block)
    assert isinstance(converted, MoEBlock) and isinstance(converted.moe, MoE)
    assert (converted.shared is not None) == hasattr(block, "shared_expert")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 11, 16, generator=gen)
    dy = torch.randn(3, 11, 16, generator=gen)
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_ref = block(x_ref)
    y = converted(x_new)
    assert_close(y, y_ref, **TOL)
    (y_ref * dy).sum().backward()
    (y * dy).sum().backward()
    assert_close(x_new.grad, x_ref.grad, **TOL)
    expected = _expected_grads(block)
    params = dict(converted.named_parameters())
    assert set(params) == set(expected), set(params) ^ set(expected)
    for pname, g_ref in expected.items():
        assert_close(params[pname].grad, g_ref, **TOL, msg=lambda m, n=pname: f"{n}: {m}")
    # the aux of the last forward is reachable on the block, with its counts
    assert converted.last_aux.counts_N.sum().item() == 33 * 2


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
