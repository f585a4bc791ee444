"""``train`` on 2 gloo ranks equals the 1-rank run on the same global batch, step by step.

The 1-rank twin of W ranks is ``micro_batches=W`` (the same shards, gradients accumulated; see
``mixmoe.train.loop``): with it, the global-batch loss, the aux loss, the global gradient norm
and so every later step agree. float64: to rounding (rtol 1e-10). The router is skewed
(``router_skew``) under a compute-starved profile so that ``mix`` really replicates experts.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _train_helpers import run_many, tiny
from torch.testing import assert_close

from mixmoe.bench.spawn import spawn_gloo
from mixmoe.train.loop import train

pytestmark = pytest.mark.dist

STEPS = 3
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _curve(result) -> torch.Tensor:
    """[steps, 3]: loss, aux loss, global gradient norm (float64)."""
    return torch.tensor(
        [(s.loss, s.aux_loss, s.grad_norm) for s in result.steps], dtype=torch.float64
    )


@pytest.mark.parametrize("model", ["gpt2", "transformer-xl", "mixtral"])
def test_two_ranks_a2a_and_mix_equal_one_rank(model):
    # Mixtral's converted routers have no bias to skew: mix replicates what the planner likes
    skew = 0.0 if model == "mixtral" else 2.0
    ref = train(tiny(model=model, micro_batches=2, max_steps=STEPS, router_skew=skew))
    configs = [
        tiny(model=model, strategy=s, max_steps=STEPS, router_skew=skew) for s in ("a2a", "mix")
    ]
    if model == "gpt2":  # every rank stops at the same step when the time budget runs out
        configs.append(tiny(model=model, strategy="a2a", max_steps=10_000, time_budget_s=1.0))
    out = spawn_gloo(run_many, 2, configs)
    want = _curve(ref)
    assert want.shape == (STEPS, 3) and want[-1, 0] < want[0, 0]  # it learns
    for rank in range(2):
        for result in out[rank][:2]:
            what = f"{result.strategy} rank {rank}"
            assert_close(_curve(result), want, **TOL, msg=lambda m, w=what: f"{w}: {m}")
    a2a, mix = out[0][:2]
    assert all(s.replicas == 0 for s in a2a.steps)
    if skew:
        assert all(s.replicas > 0 for s in mix.steps), [s.replicas for s in mix.steps]
    if model == "gpt2":
        budget = [out[r][2] for r in range(2)]
        assert [b.stopped_by for b in budget] == ["time_budget"] * 2
        assert len(budget[0].steps) == len(budget[1].steps) >= 1
        assert_close(_curve(budget[0]), _curve(budget[1]), rtol=0, atol=0)


def test_expert_data_parallel_groups_equal_one_rank():
    """4 ranks, EP groups of 2 (expert gradients summed over the EDP pairs)."""
    cfg = tiny(model="transformer-xl", max_steps=2, batch_size=8)
    ref = train(tiny(model="transformer-xl", max_steps=2, batch_size=8, micro_batches=4))
    out = spawn_gloo(run_many, 4, [replace(cfg, strategy="a2a", ep_size=2)])
    for rank in range(4):
        assert_close(_curve(out[rank][0]), _curve(ref), **TOL, msg=lambda m, r=rank: f"{r}: {m}")


def test_plain_data_parallel_equals_one_rank():
    """ep_size 1: every expert on every rank (strategy local), and the dense twin (naive)."""
    configs = [
        tiny(model="transformer-xl", max_steps=2, strategy="local", ep_size=1),
        tiny(model="transformer-xl", max_steps=2, dense=True),
    ]
    out = spawn_gloo(run_many, 2, configs)
    for i, cfg in enumerate(configs):
        ref = train(replace(cfg, micro_batches=2, ep_size=None))
        for rank in range(2):
            assert_close(_curve(out[rank][i]), _curve(ref), **TOL)
    assert out[0][1].steps[0].aux_loss == 0.0 and out[0][0].steps[0].aux_loss > 0
