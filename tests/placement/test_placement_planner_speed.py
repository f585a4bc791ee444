"""The planner's speed devices keep its numbers: cached segment orders and grown relay trees equal
a fresh computation after every move, ``Plan.priced`` equals ``dataclasses.replace``,
``plan_pricing``'s ``base_4W`` changes nothing, and the garbage collector's pause is restored.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixmoe.placement.planner as planner_module
from mixmoe.placement import CPU_PROFILE, LayerShape, plan_mix
from mixmoe.placement.balance import WaterFill
from mixmoe.placement.cost_model import plan_pricing, predict, step_model
from mixmoe.placement.counts import baseline_loads, counts_with_sums
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import BLOCK_SIZE, _fill_step, _prediction
from mixmoe.placement.relay import relay_degrees

# a link fast enough next to compute that skewed counts of a few hundred rows get balanced
CPU = CPU_PROFILE
NODES = dataclasses.replace(
    CPU,
    ranks_per_node=2,
    inter_node_bandwidth=CPU.link_bandwidth / 4,
    inter_node_latency=2 * CPU.link_latency,
)


def _skewed(W: int, E: int, rows: int, seed: int) -> torch.Tensor:
    """counts_WN: every rank sends a third of its rows to one hot expert and the rest at random
    (Zipf-like weights over the experts), fresh per seed; one rank sends nothing when seed is
    odd (a rank with zero rows)."""
    gen = torch.Generator().manual_seed(seed)
    N = W * E
    weights = 1.0 / torch.arange(1, N + 1, dtype=torch.float64) ** 1.2
    weights = weights[torch.randperm(N, generator=gen)]
    C_WN = torch.zeros(W, N, dtype=torch.int64)
    for s in range(W):
        picks = torch.multinomial(weights, rows, replacement=True, generator=gen)
        C_WN[s] = torch.bincount(picks, minlength=N)
    C_WN[:, int(torch.randint(0, N, (1,), generator=gen))] += rows // 3
    if seed % 2:
        C_WN[int(torch.randint(0, W, (1,), generator=gen))] = 0
    return C_WN


def _fill(W: int, E: int, seed: int, start: dict[int, tuple[int, ...]]):
    shape = LayerShape(256, 1024, E, W, 2)
    C_WN, colsum_N, _ = counts_with_sums(_skewed(W, E, 900, seed), shape)
    model = step_model(shape, CPU, True)
    P = predict(C_WN, (), shape, CPU)
    hot = tuple(sorted(start))
    plan = Plan(hot, tuple((g, start[g]) for g in hot), P, P, relay=True)
    loads, _ = plan_pricing(C_WN, plan, E)
    fill = WaterFill(model, C_WN, E, start, 8, BLOCK_SIZE, None, colsum_N, bool(loads[2].any()))
    fill.set_loads([*loads[:3].to(torch.int64).tolist(), loads[3].tolist()])  # copies: float
    return fill, C_WN


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 4), st.integers(0, 10**6), st.booleans())
def test_cached_orders_and_trees_equal_a_fresh_computation(W, E, seed, replicated) -> None:
    """After every move, each cached segment order (``WaterFill._ordered``: kept up to date by
    bisection) equals a fresh sort of the expert's placement at that rank, with its row sum and
    sort keys, and each cached grown tree (``_grown``) equals ``relay_degrees`` of the current
    holders plus the receiver, with the edge changes against the current tree."""
    start = {}
    if replicated:  # a start plan with replicas: the trees grow from existing holders
        start = {0: tuple(range(1, W))} if E == 1 else {E: (0,)}
    fill, _ = _fill(W, E, seed, start)
    for _ in range(30):
        if not fill.step():
            break
        assert fill._order or fill.moves  # the search used its caches
        for (g, r), (order, rows, keys) in fill._order.items():
            at_r = fill._where(g).get(r, {})
            assert order == sorted(at_r.items(), key=lambda p: (-p[1], p[0]))
            assert rows == sum(at_r.values())
            assert keys == [(-n, s) for s, n in order]
        for g, holders in fill.holders.items():  # the trees the moves built
            assert fill.degrees[g] == relay_degrees(g // E, holders, None)[0]
        for g, grown in fill._grow.items():
            old = fill.degrees.get(g, {})
            for y, (depth, extra, h, degrees) in grown.items():
                want_h = sorted([*fill.holders.get(g, ()), y])
                want_degrees, want_depth = relay_degrees(g // E, want_h, None)
                assert (depth, h, degrees) == (want_depth, want_h, want_degrees)
                diff = {r: want_degrees.get(r, 0) - old.get(r, 0) for r in {*want_degrees, *old}}
                assert extra == {r: d for r, d in diff.items() if d}


def test_plan_priced_equals_replace() -> None:
    """``Plan.priced`` is ``dataclasses.replace`` of the prediction and baseline: an equal plan
    whose lookups (holders, segment runs) work."""
    shape = LayerShape(256, 1024, 2, 4, 2)
    C_WN = _skewed(4, 2, 700, 3)
    plan = plan_mix(C_WN, shape, CPU, 4, fill="moves")
    assert plan.shares  # a balanced plan with share entries
    other = predict(C_WN, (), shape, CPU)
    priced = plan.priced(other, plan.prediction)
    assert priced == dataclasses.replace(plan, prediction=other, baseline=plan.prediction)
    ranged = plan_mix(C_WN, shape, CPU, 4)
    assert ranged.ranges  # and one with ranges
    assert ranged.priced(other, other) == dataclasses.replace(ranged, prediction=other,
                                                              baseline=other)  # fmt: skip
    s, g, runs = plan.shares[0]
    assert priced.segment_runs(s, g, int(C_WN[s, g]), 2) == runs
    assert priced.holders(g) == plan.holders(g)


@pytest.mark.parametrize("profile", [CPU, NODES], ids=["one-link", "nodes"])
def test_plan_pricing_with_base_loads_is_unchanged(profile) -> None:
    """``plan_pricing(..., base_4W=baseline_loads(...))`` equals the pricing without it."""
    W, E = 6, 3
    shape = LayerShape(256, 1024, E, W, 2)
    for seed in range(4):
        C_WN = _skewed(W, E, 800, seed)
        plan = plan_mix(C_WN, shape, profile, 4)
        base_4W = baseline_loads(C_WN, E)[0]
        for candidate in (plan, dataclasses.replace(plan, shares=(), ranges=(), relay=False)):
            want = plan_pricing(C_WN, candidate, E, profile)
            got = plan_pricing(C_WN, candidate, E, profile, base_4W=base_4W)
            assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.mark.parametrize("fill", ["level", "moves"])
@pytest.mark.parametrize("enabled", [True, False])
def test_collector_paused_during_the_search_and_restored(enabled, fill, monkeypatch) -> None:
    """The cyclic garbage collector is off while the fill runs (either fill) and back in its
    entry state after ``plan_mix``."""
    seen = []
    monkeypatch.setattr(
        planner_module, "planned", lambda *a: None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)
    if fill == "level":  # the compiled fill (native_fill.filled; the Python fill's twin)
        run = planner_module.filled
        monkeypatch.setattr(planner_module, "filled", lambda *a: spy(*a))
    else:
        run = WaterFill.run
        monkeypatch.setattr(WaterFill, "run", lambda *a: spy(*a))

    def spy(*args):
        seen.append(gc.isenabled())
        return run(*args)

    shape = LayerShape(256, 1024, 2, 8, 2)
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        plan = plan_mix(_skewed(8, 2, 900, 5), shape, CPU, 4, fill=fill)
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
    assert (plan.ranges if fill == "level" else plan.shares) and seen and not any(seen)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 4), st.integers(0, 10**6), st.booleans())
def test_start_totals_from_the_tensor_equal_total_fn(W, E, seed, replicated) -> None:
    """``WaterFill.set_loads`` with the loads tensor gives the start totals ``total_fn`` gives
    rank by rank, bit for bit (relay rounds of the start's replicas included)."""
    start = {}
    if replicated:
        start = {0: tuple(range(1, W))} if E == 1 else {E: (0,), 0: tuple(range(1, W))}
    fill, C_WN = _fill(W, E, seed, start)
    shape = LayerShape(256, 1024, E, W, 2)
    hot = tuple(sorted(start))
    P = predict(C_WN, (), shape, CPU)
    plan = Plan(hot, tuple((g, start[g]) for g in hot), P, P, relay=True)
    loads_4W, _ = plan_pricing(C_WN, plan, E)
    fill.set_loads([*loads_4W[:3].to(torch.int64).tolist(), loads_4W[3].tolist()], loads_4W)
    total = fill.model.total_fn(fill.any_remote, fill.rounds)
    want = list(map(total, fill.rows, fill.local, fill.remote, fill.replica))
    assert fill.totals == want
    assert fill.rounds == max((relay_degrees(g // E, h)[1] for g, h in start.items()), default=0)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 12), st.integers(1, 4), st.integers(0, 10**6))
def test_fill_step_is_the_priced_step_of_the_fill_plan(W, E, seed) -> None:
    """``planner._fill_step`` (the search's own max when its flags hold) equals the step of
    the plan the fill would emit, priced by ``plan_pricing``, after every move."""
    fill, C_WN = _fill(W, E, seed, {})
    shape = LayerShape(256, 1024, E, W, 2)
    P = predict(C_WN, (), shape, CPU)
    for _ in range(20):
        if not fill.step():
            break
        hot = tuple(sorted(g for g, h in fill.holders.items() if h))
        replicas = tuple((g, tuple(fill.holders[g])) for g in hot)
        plan = Plan(hot, replicas, P, P, fill.shares(), relay=True)
        want = fill.model.prediction_W(*plan_pricing(C_WN, plan, E)).step_s
        assert _fill_step(fill, fill.model, C_WN, E, CPU) == want


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(0, 10**6), st.sampled_from([None, 0, 1, 3]))
def test_list_prediction_equals_the_tensor_one(W, seed, rounds) -> None:
    """``planner._prediction`` (lists up to 64 ranks) and ``prediction_lists(..., rounds)`` give
    ``prediction_W``'s Prediction exactly, relay rounds included."""
    gen = torch.Generator().manual_seed(seed)
    shape = LayerShape(256, 1024, 2, W, 2)
    loads_4W = torch.randint(0, 5000, (4, W), generator=gen).to(torch.float64)
    loads_4W[1] = torch.minimum(loads_4W[1], loads_4W[0])  # local rows are rows computed
    loads_4W[3] = torch.randint(0, 6, (W,), generator=gen).to(torch.float64)
    if seed % 2:  # the relay's fractional copies (scatter + all-gather: 2 - 1/H per holder)
        loads_4W[3] += torch.randint(0, 2**24, (W,), generator=gen).to(torch.float64) / 2**24
    for overlap in (False, True):
        model = step_model(shape, CPU, overlap)
        want = model.prediction_W(loads_4W, rounds)
        rows, local, remote = loads_4W[:3].to(torch.int64).tolist()
        replica = [int(x) if x.is_integer() else x for x in loads_4W[3].tolist()]
        got = model.prediction_lists(rows, local, remote, replica, rounds=rounds)
        assert got == want
        if rounds is not None:
            assert _prediction(model, loads_4W, rounds) == want


@pytest.mark.parametrize(
    ("shares", "match"),
    [
        (((1, 2, ((0, 5),)), (0, 3, ((0, 5),))), "strictly ascending"),  # out of order
        (((0, 3, ((0, 5),)), (0, 3, ((1, 5),))), "strictly ascending"),  # a segment twice
        (((0, 3, ()),), "distinct ranks with rows > 0"),  # no run
        (((0, 3, ((0, 0),)),), "distinct ranks with rows > 0"),  # one empty run
        (((0, 3, ((0, 64), (0, 5))),), "distinct ranks with rows > 0"),  # a rank twice
        (((0, 3, ((0, 64), (1, -1))),), "distinct ranks with rows > 0"),  # a negative run
    ],
)
def test_plan_rejects_malformed_shares(shares, match) -> None:
    """``Plan``'s checks of share entries (the fast path for one-run entries included)."""
    P = predict([[1, 1], [1, 1]], (), LayerShape(8, 8, 1, 2, 2), CPU)
    with pytest.raises(ValueError, match=match):
        Plan((), (), P, P, shares)
    Plan((), (), P, P, ((0, 1, ((0, 64), (1, 5))), (1, 0, ((1, 3),))))  # well formed
