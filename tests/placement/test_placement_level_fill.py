"""The batched water-fill (``mixmoe.placement.level_fill``): its level against a bisection twin,
its bookkeeping against the cost model's pricing of the plan it emits, and ``plan_mix``'s
guarantees with it (the default fill) over random skewed counts, with and without a topology.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixmoe.placement.level_fill as level_module
import mixmoe.placement.planner as planner_module
from mixmoe.placement import CPU_PROFILE, HardwareProfile, LayerShape, plan_none, plan_shadow
from mixmoe.placement.cost_model import plan_pricing, predict, predict_plan, step_model
from mixmoe.placement.counts import counts_with_sums
from mixmoe.placement.level_fill import level_fill
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import BLOCK_SIZE, FILL_STOP, plan_mix, replica_slots
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.range_state import RangeState
from mixmoe.simulate.routing import counts_source

IB = HardwareProfile("ib-like", 593e12, 40e9, 30e-6)  # h100-ib's figures
CHEAP_LINK = HardwareProfile("cheap-link", 1e12, 1e13, 1e-9)  # compute-bound
NODES = dataclasses.replace(IB, ranks_per_node=2, inter_node_bandwidth=5e9, inter_node_latency=5e-5)
PROFILES = {"ib": IB, "cpu": CPU_PROFILE, "cheap": CHEAP_LINK, "nodes": NODES}


def _skewed_counts(W: int, E: int, rows: int, seed: int, hot: float, hot_rank: bool):
    """counts_WN: each rank routes ``rows`` rows, a share ``hot`` of them to one expert picked by
    the seed (``hot_rank``: to the experts of one rank, its own rows included), the rest
    uniformly at random."""
    gen = torch.Generator().manual_seed(seed)
    N = W * E
    C = torch.zeros(W, N, dtype=torch.int64)
    hot_rows = int(rows * hot)
    if hot_rank:
        r = int(torch.randint(0, W, (1,), generator=gen))
        for e in range(E):
            C[:, r * E + e] = hot_rows // E
        hot_rows = hot_rows // E * E
    else:
        C[:, int(torch.randint(0, N, (1,), generator=gen))] = hot_rows
    draws = torch.randint(0, N, (W, rows - hot_rows), generator=gen)
    return C.scatter_add_(1, draws, torch.ones_like(draws))


# -- the level -------------------------------------------------------------------------------


def _d(L, T, avail, save, start, cost, fresh, jump) -> float:
    """The level's balance from its definition: rows shed above L plus a copy per fresh donor
    above L, less the rows absorbed below L."""
    out = 0.0
    for r in range(len(T)):
        if avail[r] > 0:
            out += min(max((T[r] - L) / save[r], 0.0), avail[r])
            out += jump if fresh[r] and T[r] > L else 0.0
        if start[r] != float("inf"):
            out -= max(0.0, (L - start[r]) / cost[r])
    return out


def _bisection_level(T, avail, save, start, cost, fresh, copy) -> float:
    """The smallest L with d(L) <= 0, by bisection on the definition (the slow twin)."""
    jump = copy * len(cost) / sum(cost)
    lo, hi = min(min(T), min(start)) - 1.0, max(T) + 1.0
    while _d(hi, T, avail, save, start, cost, fresh, jump) > 0:
        hi += 2 * (hi - lo)
    if _d(lo, T, avail, save, start, cost, fresh, jump) <= 0:
        return lo
    for _ in range(200):
        mid = (lo + hi) / 2
        if _d(mid, T, avail, save, start, cost, fresh, jump) <= 0:
            hi = mid
        else:
            lo = mid
    return hi


@pytest.mark.parametrize("tensor", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_level_is_where_shed_meets_absorbed(seed: int, tensor: bool, monkeypatch) -> None:
    """``_level`` (the list walk, and the tensor walk past ``TENSOR_POINTS``) equals the
    bisection of its definition on random ranks: offers, caps, drops, full ranks."""
    rng = random.Random(seed)
    W = rng.randint(2, 150)
    T = [rng.uniform(1e-3, 1e-2) for _ in range(W)]
    avail = [rng.choice([0, rng.randint(64, 20000)]) for _ in range(W)]
    save = [rng.uniform(1e-7, 3e-7) for _ in range(W)]
    cost = [rng.uniform(1.5e-7, 3e-7) for _ in range(W)]
    start = [t + 8e-4 if rng.random() < 0.8 else float("inf") for t in T]
    start[0] = T[0] + 8e-4  # at least one receiver
    fresh = [rng.random() < 0.5 for _ in range(W)]
    monkeypatch.setattr(level_module, "TENSOR_POINTS", 0 if tensor else 10**9)
    got = level_module._level(T, avail, save, start, cost, fresh, 8e-4)
    want = _bisection_level(T, avail, save, start, cost, fresh, 8e-4)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


INF = float("inf")
# Crossings the random ranks above almost never meet (a mutation run's survivors: the walks'
# thresholds moved by one row, and the first segment's branch, went unnoticed; mutation-log,
# "Twentieth run"): (T, avail, save, start, fresh, cost, copy, the level). Unit-scale numbers,
# every one exact in binary, so each level is exact too; d is in rows, so "within a row of 0"
# is a real crossing a threshold of 1 instead of 0 would take for one.
# fmt: off
LEVEL_EDGES = {
    # d is 0.5 at the start 9.5, where its slope goes from -1 to -2: 9.5 + 0.5 / 2
    "within a row of 0 at a receiver's start": (
        [10.0, 9.0], [5, 0], [1.0, 1.0], [INF, 9.5], [False, False], 1.0, 0.0, 9.75),
    # the fresh donor's copy (jump 2 * 3 / 3 = 2) drops d from 2.5 to 0.5 at 10 (the third
    # donor's one row keeps it above 0), and the receiver's slope -1 takes it to 0: 10 + 0.5
    "within a row of 0 after a fresh donor's drop": (
        [10.0, 0.0, 30.0], [5, 0, 1], [1.0, 1.0, 1.0], [INF, 9.5, INF], [True, False, False],
        1.0, 2.0, 10.5),
    # d is 0.5 just left of 10 and -1.5 right of it: the crossing is the drop itself
    "in a fresh donor's drop": (
        [10.0, 0.0], [5, 0], [1.0, 1.0], [INF, 8.5], [True, False], 1.0, 2.0, 10.0),
    # the receiver's start is the first breakpoint: d = 5 - 8 L reaches 0 before the next one
    "in the first segment": (
        [10.0, 0.0], [5, 0], [1.0, 1.0], [INF, 0.0], [False, False], 0.125, 0.0, 0.625),
    # no receiver: the rows shed reach 0 at the hottest donor's total
    "donors only": ([10.0, 12.0], [5, 3], [1.0, 1.0], [INF, INF], [False, False], 1.0, 0.0, 12.0),
}
# fmt: on


@pytest.mark.parametrize("tensor", [False, True])
@pytest.mark.parametrize("case", list(LEVEL_EDGES))
def test_level_at_the_walks_edges(case: str, tensor: bool, monkeypatch) -> None:
    """``_level`` (both walks) on crossings at the walks' thresholds: d within one row of 0 at
    a breakpoint where its slope changes or after a drop, a crossing in a drop, in the first
    segment, and with no receiver; each the level its definition gives (the bisection)."""
    T, avail, save, start, fresh, cost, copy, want = LEVEL_EDGES[case]
    monkeypatch.setattr(level_module, "TENSOR_POINTS", 0 if tensor else 10**9)
    costs = [cost] * len(T)
    assert level_module._level(T, avail, save, start, costs, fresh, copy) == want
    assert _bisection_level(T, avail, save, start, costs, fresh, copy) == pytest.approx(want)


@pytest.mark.parametrize("tensor", [False, True])
def test_level_without_offers_is_the_lowest_start(tensor: bool, monkeypatch) -> None:
    """With nothing offered d is never positive, and any level at or below the lowest start
    balances it; the walks answer that start (no rank sheds, so the fill uses the level only
    for the receivers' room, which nothing fills). Pinned: the C++ walk answers the same
    (``test_native_fill.test_compiled_level_is_the_python_level``)."""
    monkeypatch.setattr(level_module, "TENSOR_POINTS", 0 if tensor else 10**9)
    T, start = [5.0, 6.0, 4.0], [7.0, 6.5, INF]
    got = level_module._level(T, [0, 0, 0], [1.0] * 3, start, [1.0] * 3, [True] * 3, 2.0)
    assert got == 6.5


# -- the fill's bookkeeping ------------------------------------------------------------------


def _fill(W, E, rows, seed, hot, hot_rank, profile, start_hot: bool):
    shape = LayerShape(64, 128, E, W, 2)
    C_WN, colsum_N, _ = counts_with_sums(_skewed_counts(W, E, rows, seed, hot, hot_rank), shape)
    model = step_model(shape, profile, True)
    start = {}
    if start_hot:  # a replica of the heaviest expert on the last rank (its owner excluded)
        g = int(colsum_N.argmax())
        start = {g: (W - 1,)} if g // E != W - 1 else {g: (0,)}
    P = predict(C_WN, (), shape, profile)
    hot_g = tuple(sorted(start))
    plan = Plan(hot_g, tuple((g, start[g]) for g in hot_g), P, P, relay=True)
    loads, _ = plan_pricing(C_WN, plan, E)
    fill = RangeState(model, C_WN, E, start, 8, BLOCK_SIZE, None, colsum_N, bool(loads[2].any()),
                      loads)  # fmt: skip
    return fill, C_WN, P


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 16),
    st.integers(1, 4),
    st.sampled_from([300, 2000]),
    st.sampled_from([0.3, 0.8]),
    st.integers(0, 10**6),
    st.sampled_from(["ib", "cheap", "cpu"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_level_fill_bookkeeping_is_the_priced_plan(
    W, E, rows, hot, seed, name, hot_rank, start_hot, kept
) -> None:
    """After every pass, the fill's own loads, rounds and totals equal the cost model's
    pricing of the plan with its amounts as ranges and its kept holders' local rows (before
    they are cut or rounded to whole blocks), both in closed form and expanded into share
    entries (the share loop: no ranges code); the plan it emits (cut) passes
    ``check_shares``, expanded too, and no rank holds more replicas than its slots. ``kept``:
    new holders keep only the own rows that fit under the level."""
    fill, C_WN, P = _fill(W, E, rows, seed, hot, hot_rank, PROFILES[name], start_hot)
    for _ in range(6):
        if not level_fill(fill, 1, 1.0, kept):
            break
        hot_g = tuple(sorted(g for g, h in fill.holders.items() if h))
        replicas = tuple((g, tuple(fill.holders[g])) for g in hot_g)
        uncut = tuple(
            (g, tuple(sorted((y, n) for y, n in fill.amounts[g].items() if n)))
            for g in sorted(fill.amounts)
            if any(fill.amounts[g].values())
        )
        unrounded = tuple((g, tuple(sorted(k.items()))) for g, k in sorted(fill.kept.items()))
        plan = Plan(hot_g, replicas, P, P, relay=True, ranges=uncut, kept=unrounded)
        want = [fill.rows, fill.local, fill.remote, fill.replica]
        for priced_plan in (plan, plan.expanded(C_WN, E)):
            priced, rounds = plan_pricing(C_WN, priced_plan, E)
            assert priced.tolist() == want
            assert rounds == fill.rounds
        pred = fill.model.prediction_W(priced, rounds)
        assert list(map(float.__add__, pred.compute_s, pred.comm_s)) == fill.totals
        hot_g, replicas, ranges, kept = fill.plan_fields()
        emitted = Plan(hot_g, replicas, P, P, relay=True, ranges=ranges, kept=kept)
        emitted.check_shares(C_WN.tolist(), E, BLOCK_SIZE)
        emitted.expanded(C_WN, E).check_shares(C_WN.tolist(), E, BLOCK_SIZE)
        held = [0] * W
        for _, holders in emitted.replicas:
            for h in holders:
                held[h] += 1
        assert held == fill.held and max(held) <= fill.slots


def test_level_fill_relieves_a_hot_rank_in_a_few_passes() -> None:
    """A hot rank (half of every rank's rows go to rank 0's experts) at W = 16 on cheap links:
    the passes bring the max total within 10% of the mean, rank 0's own rows included."""
    fill, C_WN, _ = _fill(16, 2, 4000, 3, 0.5, True, CHEAP_LINK, False)
    before = max(fill.totals)
    assert before > 3 * sum(fill.totals) / 16
    assert level_fill(fill, 8, FILL_STOP) > 0
    assert max(fill.totals) <= 1.10 * sum(fill.totals) / 16
    assert max(fill.totals) < before / 2


# -- plan_mix with the batched fill ----------------------------------------------------------


@st.composite
def _cases(draw):
    W = draw(st.integers(2, 16))
    E = draw(st.integers(1, 4))
    rows = draw(st.sampled_from([64, 300, 2000]))
    hot = draw(st.sampled_from([0.0, 0.3, 0.8]))
    seed = draw(st.integers(0, 10**6))
    profile = draw(st.sampled_from(sorted(PROFILES)))
    max_replicas = draw(st.sampled_from([0, 1, 4]))
    return W, E, rows, hot, draw(st.booleans()), seed, profile, max_replicas


@settings(max_examples=40, deadline=None)
@given(_cases())
def test_plan_mix_level_guarantees(case) -> None:
    """With the batched fill: deterministic (tensor or list counts, a fresh copy), valid shares,
    the replica budget, never predicted worse than a2a nor than shadow where shadow fits the
    budget, and its prediction is the cost model's price of the plan it returns (the
    topology's two links included)."""
    W, E, rows, hot, hot_rank, seed, name, max_replicas = case
    profile = PROFILES[name]
    shape = LayerShape(64, 128, E, W, 2)
    C_WN = _skewed_counts(W, E, rows, seed, hot, hot_rank)
    plan = plan_mix(C_WN, shape, profile, max_replicas)
    assert plan_mix(C_WN.clone(), shape, profile, max_replicas) == plan
    assert plan_mix(C_WN.tolist(), shape, profile, max_replicas, fill="level") == plan
    plan.check_shares(C_WN.tolist(), E, BLOCK_SIZE)
    held = [0] * W
    for _, holders in plan.replicas:
        for h in holders:
            held[h] += 1
    assert max(held) <= replica_slots(max_replicas, E)
    step = plan.prediction.step_s
    assert step <= plan_none(C_WN, shape, profile).prediction.step_s
    shadow = plan_shadow(C_WN, shape, profile)
    if len(shadow.hot) <= replica_slots(max_replicas, E):
        assert step <= shadow.prediction.step_s
    assert step <= plan.baseline.step_s
    assert predict_plan(C_WN, plan, shape, profile, True) == plan.prediction


def test_plan_mix_fill_option() -> None:
    """``fill`` picks the batched passes (default) or the move-by-move search; anything else
    is refused with the choices named."""
    shape = LayerShape(64, 128, 2, 8, 2)
    C_WN = _skewed_counts(8, 2, 2000, 5, 0.5, True)  # a hot rank on compute-bound links
    level = plan_mix(C_WN, shape, CHEAP_LINK, 4)
    moves = plan_mix(C_WN, shape, CHEAP_LINK, 4, fill="moves")
    none = plan_mix(C_WN, shape, CHEAP_LINK, 4, balance=False)
    assert level.ranges and moves.shares
    assert level.prediction.step_s < none.prediction.step_s
    assert moves.prediction.step_s < none.prediction.step_s
    with pytest.raises(ValueError, match="fill must be one of"):
        plan_mix(C_WN, shape, IB, 4, fill="greedy")


def test_level_fill_prefers_receivers_in_the_owners_node() -> None:
    """Nodes of 2 ranks: rank 0 owns the hot expert 0; rank 3 (the other node) is the least
    loaded, rank 1 (rank 0's node) close behind. With one link rank 3 is served first and takes
    the larger piece; with the topology rank 1 is (its replica crosses no slow link)."""
    from mixmoe.placement.relay import node_distance

    W, E = 4, 1
    C_WN = torch.tensor([[1200, 0, 0, 0], [0, 620, 0, 0], [0, 0, 1100, 0], [0, 0, 0, 600]])
    shape = LayerShape(64, 128, E, W, 2)
    nodes = dataclasses.replace(
        CHEAP_LINK, ranks_per_node=2, inter_node_bandwidth=1e12, inter_node_latency=1e-9
    )
    amounts = {}
    for name, profile in (("one-link", CHEAP_LINK), ("nodes", nodes)):
        C, colsum_N, _ = counts_with_sums(C_WN, shape)
        P = predict(C, (), shape, profile)
        loads, _ = plan_pricing(C, Plan((), (), P, P, relay=True), E)
        fill = RangeState(step_model(shape, profile, True), C, E, {}, 8, BLOCK_SIZE,
                          node_distance(profile), colsum_N, True, loads)  # fmt: skip
        assert level_fill(fill, 1, 1.0) > 0
        amounts[name] = fill.amounts[0]
    assert amounts["one-link"][3] > amounts["one-link"][1], amounts
    assert amounts["nodes"][1] > amounts["nodes"][3], amounts


@pytest.mark.parametrize("rest", [1, 2, 64])
def test_matched_gives_a_kept_holders_last_rows_back(rest: int) -> None:
    """``_matched`` hands a kept holder back its own rows from the owner's shed, however few
    are left in the stream: one row too (a mutation run's survivor, ``k > 1`` for ``k > 0``,
    went unnoticed: the fills met no kept holder one row short). Expert 0 (owner rank 0) with
    rank 1 a kept holder computing all but ``rest`` of its 129 own rows; the owner sheds two
    blocks and rank 1 has room for ten: it takes its ``rest`` rows back and is a plain holder
    after; nothing else moves (no receiver queue)."""
    W, E, blk = 4, 1, BLOCK_SIZE
    C = torch.tensor([[1000, 0, 0, 0], [129, 100, 0, 0], [300, 0, 100, 0], [0, 0, 0, 100]])
    shape = LayerShape(64, 128, E, W, 2)
    C_WN, colsum_N, _ = counts_with_sums(C, shape)
    P = predict(C_WN, (), shape, IB)
    loads, _ = plan_pricing(C_WN, Plan((), (), P, P, relay=True), E)
    fill = RangeState(step_model(shape, IB, True), C_WN, E, {}, 8, blk, None, colsum_N,
                      bool(loads[2].any()), loads)  # fmt: skip
    fill.add_holder(0, 1, 129 - rest)
    assert fill.kept_rest(0, 1) == rest
    a, cost = 1e-6, 2e-6
    room_W = [0.0, 10 * blk * cost, 0.0, 0.0]
    offers = [[[0, 0, 0]], [], [], []]  # the owner's offer of expert 0: its stream's rows
    new, moved = level_module._matched(fill, offers, [(0, 2 * blk)], room_W, [], [cost] * W,
                                       0.0, a, True)  # fmt: skip
    assert (new, moved) == ({}, 1)
    assert fill.kept_rest(0, 1) == 0 and 0 not in fill.kept  # all its rows local now
    assert fill.rows[1] == 100 + 129 and room_W[1] == 10 * blk * cost - rest * a


def test_plan_mix_kept_holders_where_own_rows_do_not_fit(monkeypatch) -> None:
    """seeds W = 8 zipf:2.0 (``bench balance``'s counts): a new holder of the hottest expert
    would compute ~30% of its rows as its own; the kept fill (new holders keep only the whole
    blocks that fit) wins with kept holders, > 3% below the plan without that fill (1.64
    against 1.70 ms: its other fills, the thinned starts' included; > 10% below before them),
    and its plan is valid and priced the same expanded into share entries."""
    W, E = 8, 4
    shape = LayerShape(1024, 4096, E, W, 2)
    (C,) = counts_source("zipf:2.0", W, E * W, 8192, 2, seed=0)
    profile = load_profile("h100-nvlink")
    plan = plan_mix(C, shape, profile, 4)
    assert plan.kept and all(local % BLOCK_SIZE == 0 for _, k in plan.kept for _, local in k)
    plan.check_shares(C, E, BLOCK_SIZE)
    expanded = plan.expanded(C, E)
    assert predict_plan(C, expanded, shape, profile, True) == plan.prediction
    fill = planner_module._water_fill
    monkeypatch.setattr(
        planner_module, "planned", lambda *a: None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)

    def no_kept(*args, **kwargs):
        return fill(*args, **{**kwargs, "kept": False})

    monkeypatch.setattr(planner_module, "_water_fill", no_kept)
    without = plan_mix(C, shape, profile, 4)
    assert not without.kept
    assert plan.prediction.step_s < 0.97 * without.prediction.step_s
