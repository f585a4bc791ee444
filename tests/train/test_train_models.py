"""Every preset family trains on one process (BERT: masked bytes, Mixtral: converted sparse
blocks), and the data shards of the ranks are exactly the global batch."""

from __future__ import annotations

import math

import pytest
import torch
from _train_helpers import tiny

from mixmoe.train.data import global_batch, shard, split_corpus
from mixmoe.train.loop import train
from mixmoe.train.presets import IGNORE, MASK_ID, build_model, moe_layers_of, preset


@pytest.mark.parametrize("model", ["bert", "mixtral"])
def test_family_trains(model):
    cfg = tiny(model=model, dtype="float32", max_steps=3, lr=1e-2, eval_every=3, router_skew=0.0)
    result = train(cfg)
    losses = [s.loss for s in result.steps]
    assert all(math.isfinite(x) for x in losses)
    # random init over a byte vocabulary starts near ln(256); three AdamW steps lower it
    assert abs(losses[0] - math.log(256)) < 1.0 and losses[-1] < losses[0], losses
    assert result.steps[0].aux_loss > 0 and math.isfinite(result.final_eval_loss)


def test_presets_build_the_moe_layers_asked_for():
    spec = preset("gpt2", "tiny", moe_layers="every:2", num_experts=4)
    torch.manual_seed(0)
    names = [n for n, _ in moe_layers_of(build_model(spec))]
    assert names == ["transformer.h.1.mlp.moe"]
    base = preset("transformer-xl", "base")
    assert (base.d_model, base.d_ff, base.seq_len, base.n_layer) == (1024, 4096, 512, 12)


@pytest.mark.parametrize("objective", ["causal", "masked", "stream"])
def test_shards_are_the_global_batch(objective):
    train_data, eval_data = split_corpus()
    assert train_data.numel() > 10 * eval_data.numel() > 0
    inputs, targets = global_batch(objective, train_data, 5, 8, 16, seed=3)
    again = global_batch(objective, train_data, 5, 8, 16, seed=3)
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
    parts = [shard(inputs, targets, i, 4) for i in range(4)]
    assert torch.equal(torch.cat([p.inputs_BL for p in parts]), inputs)
    assert torch.equal(torch.cat([p.targets_BL for p in parts]), targets)
    assert {p.num_targets for p in parts} == {int((targets != IGNORE).sum())}
    if objective == "masked":
        masked = inputs == MASK_ID
        assert torch.equal(masked, targets != IGNORE) and 0.05 < masked.float().mean() < 0.3
    else:
        assert (targets != IGNORE).all()
    if objective == "stream":  # the next step continues every stream where this one ended
        nxt, _ = global_batch(objective, train_data, 6, 8, 16, seed=3)
        assert torch.equal(nxt[:, 0], targets[:, -1])
