"""Expert parameters stay out of DDP; expert-data-parallel groups average expert gradients."""

from __future__ import annotations

import pytest
import torch
from _cases import make_layer, rank_inputs
from test_strategies import REPLICATE

from mixmoe.comm import new_expert_groups
from mixmoe.parallel import average_expert_gradients, parallelize_moe

pytestmark = pytest.mark.dist

CASE = {
    "num_experts": 4,
    "top_k": 2,
    "skew": "hot",
    "dtype": torch.float64,
    "seed": 21,
    "tokens": [40, 60, 50, 30],
}


def _grads(layer) -> dict:
    out = {f"d{n}": p.grad.clone() for n, p in layer.experts.named_expert_parameters()}
    out["gate_w"] = layer.gate.wg.weight.grad.clone()
    return out


def _ddp(comm) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    layer = parallelize_moe(make_layer(CASE), comm, "mix", profile=REPLICATE)
    assert all(
        getattr(p, "skip_allreduce", False) for _, p in layer.experts.named_expert_parameters()
    )
    model = DDP(layer)  # must neither broadcast nor all-reduce the (rank-specific) experts
    x, dy = rank_inputs(CASE, comm.rank)
    y, _ = model(x)
    (y * dy).sum().backward()
    return _grads(layer)


def _reference(ranks: list[int]) -> dict:
    layer = make_layer(CASE)
    xs, dys = zip(*(rank_inputs(CASE, r) for r in ranks), strict=True)
    y, _ = layer(torch.cat(xs))
    (y * torch.cat(dys)).sum().backward()
    return _grads(layer)


def test_ddp_averages_gate_and_leaves_experts_alone() -> None:
    from mixmoe.comm.launch import spawn_gloo

    got = spawn_gloo(_ddp, 2)
    ref = _reference([0, 1])
    for g in got:  # gate: DDP's average of the per-rank grads = the full-batch grad / W
        torch.testing.assert_close(g["gate_w"], ref["gate_w"] / 2)
    for key in [k for k in ref if k != "gate_w"]:
        torch.testing.assert_close(torch.cat([g[key] for g in got]), ref[key], msg=key)


def _edp(comm) -> dict:
    ep, edp = new_expert_groups(2)  # EP {0,1} and {2,3}; EDP {0,2} and {1,3}
    layer = parallelize_moe(make_layer(CASE), ep, "mix", profile=REPLICATE)
    x, dy = rank_inputs(CASE, comm.rank)
    y, _ = layer(x)
    (y * dy).sum().backward()
    average_expert_gradients(layer, edp)
    return {"ep_rank": ep.rank, **_grads(layer)}


def test_expert_data_parallel_groups_average_expert_grads() -> None:
    from mixmoe.comm.launch import spawn_gloo

    got = spawn_gloo(_edp, 4)
    refs = [_reference([0, 1]), _reference([2, 3])]  # one reference per EP group
    assert [g["ep_rank"] for g in got] == [0, 1, 0, 1]
    for key in [k for k in refs[0] if k != "gate_w"]:
        expected = (refs[0][key] + refs[1][key]) / 2
        for group in (0, 1):
            shards = [got[2 * group][key], got[2 * group + 1][key]]
            torch.testing.assert_close(torch.cat(shards), expected, msg=key)
