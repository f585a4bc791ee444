"""``mix`` plans on a background thread while the own rows are computed: the numbers are those of
planning first, and a planner that raises fails every rank cleanly (never a hang), whether it
raises on every rank or on one.

Same plan, same forward and same gate gradients bit for bit. The input gradient may differ by
one rounding: autograd sums x's gradient contributions (own rows, replica rows, rows sent) in
graph order, and under an async plan the own rows are computed before the rows to send are
gathered (synchronously: after, so that they overlap the token exchange). So may the owned
experts' gradients, for the same reason: under a plan with share entries an owner's gradient
sums its own rows, the rows it received, and its replicas' gradients coming back through the
relay rounds (each round one more contribution), in graph order too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _cases import make_layer, rank_inputs

from mixmoe.parallel import parallelize_moe
from mixmoe.placement.profile import HardwareProfile

pytestmark = pytest.mark.dist

REPLICATE = HardwareProfile(
    "test-replicate", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)
BASE = {"top_k": 2, "dtype": torch.float64, "seed": 5}
CASES = [
    dict(BASE, num_experts=6, skew="hot", tokens=[70, 45, 30]),  # replicas and moved rows
    dict(BASE, num_experts=3, skew="one", tokens=[40, 0, 33], activation="swiglu"),  # T = 0
    dict(BASE, num_experts=6, tokens=[17, 64, 5], block_size=16, max_replicas=1),
]


def _steps(comm, case: dict, plan_async: bool) -> list[dict]:
    layer = parallelize_moe(make_layer(dict(case, plan_async=plan_async)), comm, "mix", REPLICATE)
    assert layer.dispatcher.plans_async() is plan_async
    out = []
    for step in range(2):  # the second step reuses the thread and the replica cache
        x, dy = rank_inputs(dict(case, seed=case["seed"] + step), comm.rank)
        x.requires_grad_(True)
        layer.zero_grad()
        y, aux = layer(x)
        (y * dy).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        out.append({"y": y.detach(), "dx": x.grad, "stats": aux.stats, **grads})
    layer.dispatcher.close()
    return out


def _both(comm, cases: list[dict]) -> tuple[list, list[str]]:
    every_rank = tuple(range(comm.world_size))
    return [(_steps(comm, c, True), _steps(comm, c, False)) for c in cases], _fail_then_recover(
        comm, every_rank
    )


def test_async_plan_gives_the_numbers_of_a_synchronous_plan_and_surfaces_errors() -> None:
    from mixmoe.comm.launch import spawn_gloo

    out = spawn_gloo(_both, 3, CASES)
    replicated = False
    for rank in range(3):
        for case, (fast, slow) in zip(CASES, out[rank][0], strict=True):
            for a, b in zip(fast, slow, strict=True):
                assert a.keys() == b.keys()
                assert a["stats"] == b["stats"], case
                replicated |= a["stats"]["replicas"] > 0
                for key in a:
                    if key == "dx" or key.startswith("experts."):  # one rounding: module doc
                        torch.testing.assert_close(a[key], b[key], rtol=1e-14, atol=1e-14)
                    elif key != "stats":
                        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    assert replicated  # the cases exercise the replica path
    # a planner raising on every rank (as a deterministic planner does: its error is a function
    # of the counts) fails every rank with that error; the next step works
    for rank in range(3):
        seen = out[rank][1]
        assert seen[0].startswith(f"planner: planner failed on rank {rank}"), seen
        assert seen[1].startswith("recovered: "), seen
        assert not seen[1].endswith("replicas=0"), seen


class PlannerFailure(ValueError):
    pass


def _failing_planner(spec, bad_ranks: tuple[int, ...], rank: int):
    def planner(C, shape, profile, config, sums=None):
        if rank in bad_ranks:
            raise PlannerFailure(f"planner failed on rank {rank} for counts {C.tolist()}")
        return spec.planner(C, shape, profile, config, sums=sums)

    return planner


def _fail_then_recover(comm, bad_ranks: tuple[int, ...]) -> list[str]:
    case = dict(CASES[0], tokens=[30, 20, 25][: comm.world_size])
    layer = parallelize_moe(make_layer(case), comm, "mix", profile=REPLICATE)
    good = layer.dispatcher.spec
    layer.dispatcher.spec = dataclasses.replace(
        good, planner=_failing_planner(good, bad_ranks, comm.rank)
    )
    x, _ = rank_inputs(case, comm.rank)
    seen = []
    try:
        layer(x)
        seen.append("no error")
    except PlannerFailure as err:
        seen.append(f"planner: {err}")
    except RuntimeError as err:  # a peer failed between collectives: the process group says so
        seen.append(f"runtime: {err}")
        return seen
    if bad_ranks == tuple(range(comm.world_size)):  # every rank failed alike: the layer recovers
        layer.dispatcher.spec = good
        y, aux = layer(x)
        seen.append(f"recovered: {tuple(y.shape)}, replicas={aux.stats['replicas']}")
    return seen


def test_a_planner_error_on_one_rank_fails_every_rank() -> None:
    """A rank-local failure (not the deterministic planner's kind: e.g. memory) raises on its
    rank; its peers, already in the next collective, fail by the process group (closed peer or
    timeout), never hang."""
    from mixmoe.comm.launch import spawn_gloo

    out = spawn_gloo(_fail_then_recover, 2, (1,), timeout_s=120, pg_timeout_s=5.0)
    assert len(out[1]) == 1 and out[1][0].startswith("planner: planner failed on rank 1"), out
    assert len(out[0]) == 1 and out[0][0].startswith("runtime: "), out
