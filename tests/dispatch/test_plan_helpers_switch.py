"""``MoEConfig.plan_helpers``: the mix strategy balances with helper ranks by default and keeps the
best candidate plan (no share entries) when switched off; the switch is part of the agreement."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe import MoEConfig
from mixmoe.dispatch.strategies import config_fingerprint, strategy_spec
from mixmoe.placement import HardwareProfile, LayerShape

# compute-bound: moving rows to idle ranks always pays
PROFILE = HardwareProfile("compute-bound", gemm_flops=1e9, link_bandwidth=1e12, link_latency=1e-9)


def _counts(W: int, E: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    C_WN = torch.randint(0, 40, (W, W * E), generator=gen)
    C_WN[:, 0] += 900  # expert 0 (rank 0) is hot from every source
    return C_WN


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_helpers_on_by_default_and_off_when_asked(seed: int) -> None:
    W, E = 4, 2
    shape = LayerShape(32, 64, experts_per_rank=E, world_size=W, bytes_per_element=4)
    cfg = MoEConfig(model_dim=32, hidden_dim=64, num_experts=W * E, block_size=16)
    C_WN = _counts(W, E, seed)
    planner = strategy_spec("mix").planner
    on = planner(C_WN, shape, PROFILE, cfg)
    off = planner(C_WN, shape, PROFILE, dataclasses.replace(cfg, plan_helpers=False))
    assert on.ranges and not off.ranges and not off.shares
    assert on.prediction.step_s < off.prediction.step_s  # the helpers are why it is faster


def test_switch_is_validated_and_agreed() -> None:
    cfg = MoEConfig(model_dim=8, hidden_dim=8, num_experts=4)
    with pytest.raises(TypeError, match="plan_helpers must be True or False"):
        dataclasses.replace(cfg, plan_helpers=1)
    off = dataclasses.replace(cfg, plan_helpers=False)
    assert config_fingerprint(cfg, 2, "mix") != config_fingerprint(off, 2, "mix")
