"""Ranks must agree on the strategy they run, and layers built for their rank are the single-device
layer's shards.

- ``parallelize_moe(..., "mix")`` on one rank and ``(..., "a2a")`` on the other: the first forward
  raises a ValueError naming both strategies on EVERY rank (never a silent divergent plan, never a
  hang).
- ``MoE(config, ep_rank=r, ep_size=W)`` allocates only rank r's experts and, after
  ``parallelize_moe``, equals the full single-device layer built from the same seed.
"""

from __future__ import annotations

import pytest
import torch
from _cases import make_config, rank_inputs

from mixmoe import MoE
from mixmoe.parallel import parallelize_moe

pytestmark = pytest.mark.dist

CASE = {"num_experts": 4, "top_k": 2, "dtype": torch.float64, "seed": 5, "tokens": [40, 23]}


def _mismatch(comm) -> str:
    torch.manual_seed(CASE["seed"])
    layer = parallelize_moe(
        MoE(make_config(CASE), dtype=torch.float64), comm, ("mix", "a2a")[comm.rank]
    )
    x, _ = rank_inputs(CASE, comm.rank)
    try:
        layer(x)
    except ValueError as err:
        return str(err)
    return "no error"


def test_strategy_mismatch_raises_on_every_rank() -> None:
    from mixmoe.comm.launch import spawn_gloo

    for msg in spawn_gloo(_mismatch, 2, timeout_s=120):
        assert "differs across ranks" in msg, msg
        assert "'mix'" in msg and "'a2a'" in msg, msg


def _built_for_rank(comm) -> dict:
    torch.manual_seed(CASE["seed"])
    layer = MoE(make_config(CASE), ep_rank=comm.rank, ep_size=comm.world_size, dtype=torch.float64)
    assert layer.experts.num_experts == CASE["num_experts"] // comm.world_size
    parallelize_moe(layer, comm, "mix")
    x, dy = rank_inputs(CASE, comm.rank)
    x.requires_grad_(True)
    y, _ = layer(x)
    (y * dy).sum().backward()
    return {
        "y": y.detach(),
        "dx": x.grad,
        **{n: p.grad for n, p in layer.experts.named_expert_parameters()},
    }


def test_layer_built_for_its_rank_equals_single_device() -> None:
    from mixmoe.comm.launch import spawn_gloo

    got = spawn_gloo(_built_for_rank, 2, timeout_s=120)
    torch.manual_seed(CASE["seed"])
    full = MoE(make_config(CASE), dtype=torch.float64)
    xs, dys = zip(*(rank_inputs(CASE, r) for r in range(2)), strict=True)
    x = torch.cat(xs).requires_grad_(True)
    y, _ = full(x)
    (y * torch.cat(dys)).sum().backward()
    tol = {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), y.detach(), **tol)
    torch.testing.assert_close(torch.cat([g["dx"] for g in got]), x.grad, **tol)
    for name, p in full.experts.named_expert_parameters():
        torch.testing.assert_close(torch.cat([g[name] for g in got]), p.grad, **tol, msg=name)
