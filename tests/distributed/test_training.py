"""Several optimizer steps: replicas stay equal to their owners, a2a and mix train identically,
the replica cache is reused only while the owners' weights are unchanged."""

from __future__ import annotations

import pytest
import torch
from _cases import make_layer, rank_inputs
from test_strategies import REPLICATE

from mixmoe.dispatch.replicas import pack_experts
from mixmoe.parallel import parallelize_moe

pytestmark = pytest.mark.dist

CASE = {
    "num_experts": 4,
    "top_k": 2,
    "skew": "hot",
    "dtype": torch.float64,
    "seed": 7,
    "tokens": [96, 80],
}


def _train(comm, strategy: str, steps: int) -> dict:
    case = dict(CASE, strategy=strategy)
    layer = parallelize_moe(make_layer(case), comm, strategy, profile=REPLICATE)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x, dy = rank_inputs(case, comm.rank)
    replica_errors, fetched = [], []
    for _ in range(steps):
        y, aux = layer(x)
        disp = layer.dispatcher
        if disp.replica_cache.replicas_HQ is not None and aux.stats["replicas"]:
            # what this rank computed with == what the owners hold right now
            plan = disp.replica_cache.last_fetch
            owned = pack_experts(layer.experts.weights(), list(range(layer.experts.num_experts)))
            every = comm.all_gather_rows(owned.detach().reshape(-1)).reshape(
                case["num_experts"], -1
            )
            truth = every[list(plan.recv_experts)]
            replica_errors.append(
                (disp.replica_cache.replicas_HQ - truth).abs().max().item()
                if truth.numel()
                else 0.0
            )
            fetched.append(len(plan.recv_experts))
        (y * dy).sum().backward()
        # gate is data-parallel: average its grads like DDP would
        for p in layer.gate.parameters():
            comm.all_reduce(p.grad)
            p.grad /= comm.world_size
        opt.step()
        opt.zero_grad()
    return {
        "params": {n: p.detach().clone() for n, p in layer.named_parameters()},
        "replica_errors": replica_errors,
        "fetched": fetched,
    }


def _eval_cache(comm) -> dict:
    case = dict(CASE, strategy="mix")
    layer = parallelize_moe(make_layer(case), comm, "mix", profile=REPLICATE)
    x, _ = rank_inputs(case, comm.rank)
    with torch.no_grad():
        y1, a1 = layer(x)
        y2, a2 = layer(x)  # weights unchanged: the fetch is served from the cache
        layer.experts.w1.add_(0.5)  # an in-place write bumps the version: refetch
        y3, a3 = layer(x)
    return {
        "cached": [
            a1.stats["replica_cached"],
            a2.stats["replica_cached"],
            a3.stats["replica_cached"],
        ],
        "same": torch.equal(y1, y2),
        "changed": not torch.equal(y2, y3),
    }


def _worker(comm) -> dict:
    return {"a2a": _train(comm, "a2a", 5), "mix": _train(comm, "mix", 5), "eval": _eval_cache(comm)}


def test_replicas_track_owners_and_mix_trains_like_a2a() -> None:
    from mixmoe.comm.launch import spawn_gloo

    out = spawn_gloo(_worker, 2)
    for rank_out in out:
        mix, a2a = rank_out["mix"], rank_out["a2a"]
        for name, p in a2a["params"].items():
            torch.testing.assert_close(mix["params"][name], p, rtol=1e-9, atol=1e-10, msg=name)
        assert all(err == 0.0 for err in mix["replica_errors"]), mix["replica_errors"]
    assert sum(sum(r["mix"]["fetched"]) for r in out) > 0, "mix never replicated anything"
    ev = out[0]["eval"]
    assert ev["cached"] == [False, True, False]
    assert ev["same"] and ev["changed"]
