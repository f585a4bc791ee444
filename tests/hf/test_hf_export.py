"""Export: a converted transformers model, trained (its weights moved), goes back to a plain
transformers model with equal logits, through save_pretrained (safetensors) and
from_pretrained. Mixtral (separate, transposed layouts vary by family), Qwen2-MoE (shared expert
with its gate), OLMoE; a sharded layer is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from mixmoe.hf.convert import MoEBlock, convert_moe_model
from mixmoe.hf.export import export_moe_model

SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}
MODELS = {
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(**SIZES, intermediate_size=24, num_local_experts=4)
    ),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **SIZES,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            num_experts=4,
            norm_topk_prob=True,
        )
    ),
    "olmoe": lambda: OlmoeForCausalLM(
        OlmoeConfig(**SIZES, intermediate_size=12, num_experts=4, norm_topk_prob=False)
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_export_equals_the_trained_converted_model(name, tmp_path):
    torch.manual_seed(0)
    original = MODELS[name]().double().eval()
    original.set_experts_implementation("eager")  # grouped_mm has no float64 on the CPU
    converted = copy.deepcopy(original)
    convert_moe_model(converted)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # "training": every weight moves away from the original's
        for p in converted.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    want = converted(input_ids=ids).logits
    exported = export_moe_model(converted)
    assert type(exported) is type(original)
    assert not any(isinstance(m, MoEBlock) for m in exported.modules())
    exported.set_experts_implementation("eager")
    got = exported(input_ids=ids).logits
    # float64, but transformers' routers take their softmax in float32 (mixmoe's: float64)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(original(input_ids=ids).logits, want)  # it did move
    exported.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    back = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    assert_close(back(input_ids=ids).logits, got, rtol=0, atol=0)


def test_a_sharded_model_is_refused():
    converted = MODELS["mixtral"]()
    convert_moe_model(converted)
    block = converted.get_submodule("model.layers.0.mlp")
    from mixmoe.parallel.shard import _shard_experts

    block.moe.experts = _shard_experts(block.moe.experts, 0, 2)
    with pytest.raises(ValueError, match="holds 2 of 4 experts"):
        export_moe_model(converted)
    with pytest.raises(ValueError, match="no converted MoEBlock"):
        export_moe_model(MODELS["olmoe"]())


def test_a_trained_mixtral_checkpoint_exports_with_equal_logits(tmp_path, capsys):
    """mixmoe train --model mixtral, then mixmoe checkpoint export: transformers' model of the
    export computes the trained model's logits."""
    from mixmoe import cli
    from mixmoe.train.loop import TrainConfig, Trainer, train

    cfg = TrainConfig(
        model="mixtral", num_experts=4, batch_size=2, seq_len=16, max_steps=2, dtype="float64",
        progress=False, save_dir=str(tmp_path / "ck"),
    )  # fmt: skip
    train(cfg)
    step = tmp_path / "ck" / "step-00000002"
    assert cli.main(["checkpoint", "export", str(step), str(tmp_path / "hf")]) == 0
    assert "MixtralForCausalLM saved" in capsys.readouterr().out
    trained = Trainer(TrainConfig(**{**cfg.__dict__, "resume": str(step), "max_steps": 2})).model
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    back = AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert_close(
            back(input_ids=ids).logits, trained.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-6
        )
    assert cli.main(["checkpoint", "export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
