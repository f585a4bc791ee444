"""``plan_ahead`` on 2, 3 and 4 gloo ranks (4: one link and two nodes): each step fits the
plan of the step before's counts (made on the planning thread while that step ran), or plans
afresh on the first step and when the fit is stale (the hot experts moved); every step equals
the single-rank layer, forward and every gradient; each fit takes the step before's counts to
the step's own; a planner error of the background plan fails every rank cleanly at the step it
was for, and the step after plans afresh."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from _cases import make_layer, rank_inputs

from mixmoe.dispatch.replicas import RelayPlan
from mixmoe.parallel import parallelize_moe
from mixmoe.placement.profile import HardwareProfile

pytestmark = pytest.mark.dist

# compute-bound: replicas and helpers pay, so the plans carry something to fit
REPLICATE = HardwareProfile(
    "test-replicate", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)
# the same in nodes of 2 ranks joined by a slower link: the fits priced by the 6-row pricing
NODES = dataclasses.replace(REPLICATE, name="test-replicate-nodes", ranks_per_node=2,
                            inter_node_bandwidth=1e11, inter_node_latency=1e-8)  # fmt: skip
STEPS = 5
MOVE_AT = 3  # from this step on the gate prefers the last experts: the carried plan is stale


def _case(world: int, dtype: torch.dtype) -> dict:
    return {"num_experts": 2 * world, "top_k": 2, "dtype": dtype, "seed": 70 + world,
            "skew": "hot", "tokens": [400, 250, 330, 0][:world], "block_size": 16,
            "plan_ahead": True}  # fmt: skip


def _move_hot(layer) -> None:
    """The hot experts move from the first rank's to the last rank's."""
    with torch.no_grad():
        bias = layer.gate.wg.bias
        bias.copy_(bias.flip(0))


def _step(layer, case: dict, step: int, x: torch.Tensor, dy: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    y, aux = layer(x)
    (y * dy).sum().backward()
    return {
        "y": y.detach(),
        "dx": x.grad,
        "stats": None if aux is None else aux.stats,
        "gate_w": layer.gate.wg.weight.grad.clone(),
        "gate_b": layer.gate.wg.bias.grad.clone(),
        **{f"d{n}": p.grad.clone() for n, p in layer.experts.named_expert_parameters()},
    }


def _inputs(case: dict, step: int, rank: int):
    return rank_inputs(dict(case, seed=case["seed"] + step), rank)


def _worker(comm, cases: list[dict], profile: HardwareProfile) -> list:
    return [
        *(_run_case(comm, case, profile) for case in cases),
        _fail_then_recover(comm, cases[0], profile),
    ]


def _run_case(comm, case: dict, profile: HardwareProfile) -> list[dict]:
    import mixmoe.dispatch.expert_parallel as expert_parallel

    layer = parallelize_moe(make_layer(case), comm, "mix", profile)
    disp = layer.dispatcher
    assert disp.plans_ahead()
    disp.check_plans = True  # every fitted plan checked against its counts
    disp.shared_sums_min = 0  # the sums path, as at scale
    counts, fits = [], []
    real_plan, real_carry = disp._plan, expert_parallel.carried_plan

    def plan(C, *args, **kwargs):  # each plan made, afresh or ahead: its counts
        counts.append(C)
        return real_plan(C, *args, **kwargs)

    def carry(made, before, after, *args, **kwargs):  # each fit: which counts to which
        fits.append((before, after))
        return real_carry(made, before, after, *args, **kwargs)

    builds = []  # each replica route built: on the main thread (the step's) or the planner's
    real_build = RelayPlan.build

    def build(*args, **kwargs):
        builds.append(threading.current_thread() is threading.main_thread())
        return real_build(*args, **kwargs)

    disp._plan = plan
    expert_parallel.carried_plan = carry
    RelayPlan.build = staticmethod(build)
    steps = []
    try:
        for step in range(STEPS):
            if step == MOVE_AT:
                _move_hot(layer)
            steps.append(_step(layer, case, step, *_inputs(case, step, comm.rank)))
    finally:
        expert_parallel.carried_plan = real_carry
        RelayPlan.build = staticmethod(real_build)
    disp.close()
    # a fitted step (it kept its holders: replicas at every step here) reuses the route built
    # with its plan on the planning thread; a step planned afresh builds its own
    fresh = sum(not s["stats"]["plan_fitted"] for s in steps)
    assert builds.count(True) == fresh and builds.count(False) == STEPS - fresh, builds
    # every step from the second fits the plan of the step before's counts to its own: the
    # counts each step saw are the fits' `after` (step 0: its fresh plan's)
    seen = [counts[0], *(after for _, after in fits)]
    assert len(fits) == STEPS - 1
    assert all(before is seen[k] for k, (before, _) in enumerate(fits))
    # one plan per step: step 0's, then each step's own for the next (afresh where stale)
    assert len(counts) == STEPS and all(C is seen[k] for k, C in enumerate(counts))
    return steps


def _fail_then_recover(comm, case: dict, profile: HardwareProfile) -> list[str]:
    """The first background plan (step 1's counts, for step 2; step 0's own plan serves step 1)
    raises on every rank: step 2 raises it on every rank; step 3 plans afresh and runs."""
    layer = parallelize_moe(make_layer(case), comm, "mix", profile)
    spec, calls = layer.dispatcher.spec, []

    def planner(C, shape, profile, config, sums=None):
        calls.append(1)
        if len(calls) == 2:  # the first background plan (the first is step 0's own)
            raise ValueError("planner failed on purpose")
        return spec.planner(C, shape, profile, config, sums=sums)

    layer.dispatcher.spec = dataclasses.replace(spec, planner=planner)
    seen = []
    for step in range(4):
        try:
            y, _ = layer(_inputs(case, step, comm.rank)[0])
            seen.append(f"ok {y.isfinite().all().item()}")
        except ValueError as e:
            seen.append(str(e))
    layer.dispatcher.close()
    return seen


def _reference(case: dict, world: int) -> list[dict]:
    layer = make_layer(case)
    out = []
    for step in range(STEPS):
        if step == MOVE_AT:
            _move_hot(layer)
        xs, dys = zip(*(_inputs(case, step, r) for r in range(world)), strict=True)
        out.append(_step(layer, case, step, torch.cat(xs), torch.cat(dys)))
    return out


@pytest.mark.parametrize(
    "world, profile", [(2, REPLICATE), (3, REPLICATE), (4, NODES), (4, REPLICATE)]
)
def test_plan_ahead_steps_equal_the_single_rank_layer(world: int, profile) -> None:
    """W = 4: one link, and two nodes of 2 ranks (the fits priced per link class); the last
    rank routes no tokens. Their plans have kept holders: fits that dropped them went stale
    at every step under nodes (1.39x the plan's step) and at step 4 on one link."""
    from mixmoe.comm.launch import spawn_gloo

    cases = [_case(world, torch.float64), _case(world, torch.float32)]
    per_rank = spawn_gloo(_worker, world, cases, profile, timeout_s=600)
    for i, case in enumerate(cases):
        tol = {"rtol": 1e-10, "atol": 1e-10} if case["dtype"] == torch.float64 else {
            "rtol": 1e-4, "atol": 2e-5}  # fmt: skip
        ref = _reference(case, world)
        fitted = []
        for step in range(STEPS):
            got = [per_rank[r][i][step] for r in range(world)]
            want = ref[step]
            torch.testing.assert_close(torch.cat([g["y"] for g in got]), want["y"], **tol)
            torch.testing.assert_close(torch.cat([g["dx"] for g in got]), want["dx"], **tol)
            for key in ("gate_w", "gate_b"):  # data-parallel gate: summed over ranks
                torch.testing.assert_close(sum(g[key] for g in got), want[key], **tol)
            for key in [k for k in want if k.startswith("d") and k != "dx"]:
                torch.testing.assert_close(torch.cat([g[key] for g in got]), want[key], **tol)
            stats = [g["stats"] for g in got]
            assert all(s == stats[0] for s in stats)  # every rank took the same branch
            fitted.append(stats[0]["plan_fitted"])
            assert stats[0]["replicas"] > 0 or step == MOVE_AT, (step, stats[0])
        # the first step plans afresh; the next ones fit, until the hot experts move, where the
        # fit of the old hot set is stale (afresh), and fit again after
        assert fitted == [False, True, True, False, True], fitted
    for r in range(world):
        assert per_rank[r][-1] == ["ok True", "ok True", "planner failed on purpose", "ok True"]
