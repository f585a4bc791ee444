"""Gradient accumulation: several forward/backward passes before one optimizer step.

Under ``mix`` the second micro-batch is served from the replica cache (the owners' weights are
unchanged), yet its replica gradients must still go home and add to the owners' ``.grad``;
``shadow`` refetches every time. Every expert gradient accumulated over the micro-batches must
equal ``a2a``'s and the single-rank layer's (the training test steps every iteration, so it never
sees a cached replica under autograd). Then the expert weights are rewritten through ``.data``
(no version change, so the cache cannot see it) and ``invalidate_replicas`` is called: the next
step must compute with the new weights.
"""

from __future__ import annotations

import pytest
import torch
from _cases import make_layer, rank_inputs
from test_strategies import REPLICATE

from mixmoe.parallel import parallelize_moe

pytestmark = pytest.mark.dist

CASE = {
    "num_experts": 4,
    "top_k": 2,
    "skew": "hot",
    "dtype": torch.float64,
    "seed": 13,
    "tokens": [70, 45],
}
WORLD = 2
MICRO_BATCHES = 3
STRATEGIES = ("a2a", "shadow", "mix")
WRITE_SCALE = -1.5  # expert weights rewritten through ``.data`` after the micro-batches


def _micro_batch(rank: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same x every micro-batch (same counts, same plan: the cache can serve it), a fresh dy."""
    x, _ = rank_inputs(CASE, rank)
    _, dy = rank_inputs(dict(CASE, seed=CASE["seed"] + 1000 * (m + 1)), rank)
    return x, dy


def _accumulate(comm, strategy: str) -> dict:
    layer = parallelize_moe(make_layer(CASE), comm, strategy, profile=REPLICATE)
    stats = []
    for m in range(MICRO_BATCHES):
        x, dy = _micro_batch(comm.rank, m)
        y, aux = layer(x)
        (y * dy).sum().backward()  # no optimizer step, no zero_grad: grads accumulate
        stats.append({k: aux.stats[k] for k in ("replicas", "replica_cached")})
    return {
        "stats": stats,
        "gate": {n: p.grad.clone() for n, p in layer.gate.named_parameters()},
        "experts": {n: p.grad.clone() for n, p in layer.experts.named_expert_parameters()},
        "after_write": _after_weight_write(layer, comm.rank),
    }


def _write_expert_weights(layer) -> None:
    """Through ``.data``: the parameters' version counters do not change, so the replica cache
    cannot see the write (the case ``invalidate_replicas`` is for)."""
    with torch.no_grad():
        for _, p in layer.experts.named_expert_parameters():
            p.data.mul_(WRITE_SCALE)


def _after_weight_write(layer, rank: int) -> dict:
    _write_expert_weights(layer)
    layer.dispatcher.invalidate_replicas()
    x, _ = _micro_batch(rank, 0)  # the counts the cache was filled for
    with torch.no_grad():
        y, aux = layer(x)
    return {"y": y, "replica_cached": aux.stats["replica_cached"]}


def _worker(comm) -> dict:
    return {s: _accumulate(comm, s) for s in STRATEGIES}


def _single_rank(world: int) -> dict:
    layer = make_layer(CASE)
    for m in range(MICRO_BATCHES):
        xs, dys = zip(*(_micro_batch(r, m) for r in range(world)), strict=True)
        y, _ = layer(torch.cat(xs))
        (y * torch.cat(dys)).sum().backward()
    _write_expert_weights(layer)
    with torch.no_grad():
        y_after = layer(torch.cat([_micro_batch(r, 0)[0] for r in range(world)]))[0]
    return {
        "gate": {n: p.grad for n, p in layer.gate.named_parameters()},
        "experts": {n: p.grad for n, p in layer.experts.named_expert_parameters()},
        "y_after_write": y_after.split(CASE["tokens"]),
    }


@pytest.fixture(scope="module")
def runs() -> tuple[list, dict]:
    """One gloo world for both tests: every strategy on every rank, and the single-rank layer."""
    from mixmoe.comm.launch import spawn_gloo

    return spawn_gloo(_worker, WORLD), _single_rank(WORLD)


def test_accumulated_gradients_through_cached_replicas(runs) -> None:
    out, ref = runs
    tol = {"rtol": 1e-10, "atol": 1e-10}
    for strategy in STRATEGIES:
        stats = [s for rank_out in out for s in rank_out[strategy]["stats"]]
        if strategy != "a2a":  # replication forced, or the test proves nothing
            assert all(s["replicas"] > 0 for s in stats), (strategy, stats)
        if strategy == "mix":  # micro-batches after the first are served from the cache
            for rank_out in out:
                cached = [s["replica_cached"] for s in rank_out["mix"]["stats"]]
                assert cached == [False] + [True] * (MICRO_BATCHES - 1), cached
        for name, grad in ref["experts"].items():
            got = torch.cat([rank_out[strategy]["experts"][name] for rank_out in out])
            torch.testing.assert_close(got, grad, **tol, msg=f"{strategy} d{name} vs single rank")
            a2a = torch.cat([rank_out["a2a"]["experts"][name] for rank_out in out])
            torch.testing.assert_close(got, a2a, **tol, msg=f"{strategy} d{name} vs a2a")
        for name, grad in ref["gate"].items():  # data-parallel: the reference sees the sum
            got = sum(rank_out[strategy]["gate"][name] for rank_out in out)
            torch.testing.assert_close(got, grad, **tol, msg=f"{strategy} gate d{name}")


def test_invalidated_replicas_are_fetched_again_after_a_weight_write(runs) -> None:
    """After ``.data`` writes the cache key is unchanged; ``invalidate_replicas`` must make the
    next step fetch the new weights (a stale replica would compute with the old ones)."""
    out, single = runs
    ref = single["y_after_write"]
    for strategy in STRATEGIES:
        for rank, rank_out in enumerate(out):
            after = rank_out[strategy]["after_write"]
            assert after["replica_cached"] is False, (strategy, rank)
            torch.testing.assert_close(
                after["y"], ref[rank], rtol=1e-10, atol=1e-10, msg=f"{strategy} rank {rank}"
            )
