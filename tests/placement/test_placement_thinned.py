"""The thinned fill starts (``placement/thinned.py``) and their use by ``plan_mix``.

``thinned_starts`` is checked against a reference written here from its definition (which experts
each start keeps: the k with the most rows, ties to the lower id). ``plan_mix`` fills from them
last, only from a best candidate in shadow's form, walking down while each fill lowers the step
of the one before: on ``bench balance``'s DeepSeek-like zipf counts, where 8 shadowed experts
fill every rank's 8 slots, a planted no-op (no thinned start) gives the much higher step back;
the compiled planner walks the same starts (the twin checks, one link and nodes), and with the
thinned starts a plan is never predicted slower than without them.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_planner import _both, _canon

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import HardwareProfile, LayerShape
from mixmoe.placement import planner as planner_module
from mixmoe.placement.planner import BLOCK_SIZE, plan_mix, replica_slots
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.thinned import thinned_starts
from mixmoe.simulate.routing import counts_source
from mixmoe.simulate.workloads import layer_shape, shape_spec

IB = HardwareProfile("ib-like", 593e12, 40e9, 30e-6)
NVLINK = load_profile("h100-nvlink")
NODES = dataclasses.replace(load_profile("h100-nvlink-ib"), ranks_per_node=4)


def _reference(replicas, colsum, W):
    """The definition, by brute force: for k = n - 1 down to 1, the k-subset of the experts
    that the ordering (more rows first, then the lower id) puts first."""
    experts = [g for g, _ in replicas]
    if len(experts) < 2 or any(len(h) != W - 1 for _, h in replicas):
        return []
    holders = dict(replicas)
    out = []
    for k in range(len(experts) - 1, 0, -1):
        # the k-subset every left-out expert ranks below: fewer rows, or as many and a higher id
        for keep in itertools.combinations(experts, k):
            out_ = [g for g in experts if g not in keep]
            if all((colsum[g], -g) > (colsum[x], -x) for g in keep for x in out_):
                out.append({g: holders[g] for g in sorted(keep)})
                break
    return out


def _everywhere(W, experts, E):
    return tuple((g, tuple(r for r in range(W) if r != g // E)) for g in sorted(experts))


@settings(max_examples=80, deadline=None)
@given(W=st.integers(2, 9), E=st.integers(1, 3), data=st.data())
def test_thinned_starts_follow_their_definition(W: int, E: int, data) -> None:
    N = W * E
    experts = data.draw(st.lists(st.integers(0, N - 1), unique=True, max_size=N))
    colsum = torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=N, max_size=N)))
    replicas = _everywhere(W, experts, E)
    got = thinned_starts(replicas, colsum, W)
    assert got == _reference(replicas, colsum.tolist(), W)
    assert got == thinned_starts(replicas, colsum.clone(), W)  # a function of its arguments
    if len(experts) >= 2:
        assert [len(s) for s in got] == list(range(len(experts) - 1, 0, -1))
        for start in got:
            assert list(start) == sorted(start), "each start ascending by expert"
            assert all(start[g] == dict(replicas)[g] for g in start), "holders kept as they are"
        for bigger, smaller in itertools.pairwise(got):
            assert set(smaller) < set(bigger), "each start drops one expert of the one before"


def test_thinned_starts_only_from_shadows_form() -> None:
    """Fewer than two experts, or one held by fewer than W - 1 ranks: no thinned start."""
    W, colsum = 4, torch.tensor([9, 8, 7, 6])
    assert thinned_starts((), colsum, W) == []
    assert thinned_starts(((0, (1, 2, 3)),), colsum, W) == []
    assert thinned_starts(((0, (1, 2, 3)), (1, (0, 2))), colsum, W) == []
    two = ((0, (1, 2, 3)), (3, (0, 1, 2)))
    assert thinned_starts(two, colsum, W) == [{0: (1, 2, 3)}]  # expert 3: 6 rows, the coldest
    tie = torch.tensor([5, 5, 5, 5])
    assert thinned_starts(two, tie, W) == [{0: (1, 2, 3)}]  # a tie: the lower id is hotter


def _bench_case(name: str, W: int, workload: str):
    spec = shape_spec(name)
    shape = layer_shape(spec, W)
    (C,) = counts_source(workload, W, shape.num_experts, 8192, spec.top_k, seed=0)[:1]
    return C, shape


@pytest.mark.parametrize(
    ("profile", "most"), [("h100-ib", 0.60), ("h100-nvlink-ib", 0.55)]
)  # measured: 0.571 and 0.503
def test_plan_mix_walks_the_thinned_starts(monkeypatch, profile: str, most: float) -> None:
    """DeepSeek-like shape, W = 64, zipf:2.0 (``bench balance``'s counts): the best candidate
    shadows 8 experts at every rank, every rank's 8 slots. Dropping its coldest lets the fill
    give helpers to the next hottest experts: the step falls by 43% on one link and 50% under
    8-GPU nodes. A planted no-op (no thinned start) gives the higher step back; the compiled
    plan is the Python plan."""
    prof = load_profile(profile)
    C, shape = _bench_case("deepseek", 64, "zipf:2.0")
    fast, slow = _both(monkeypatch, C, shape, prof, 4)
    assert _canon(fast) == _canon(slow)
    monkeypatch.setattr(planner_module, "planned", lambda *a: None)  # the Python steps
    monkeypatch.setattr(planner_module, "thinned_starts", lambda *a: [])
    without = plan_mix(C, shape, prof, 4)
    best = plan_mix(C, shape, prof, 4, balance=False)  # the best candidate: shadow's form
    everywhere = [g for g, h in best.replicas if len(h) == 63]
    assert len(everywhere) == len(best.hot) == replica_slots(4, shape.experts_per_rank) == 8
    assert fast.prediction.step_s < most * without.prediction.step_s
    assert len([g for g, h in fast.replicas if len(h) == 63]) < 8
    fast.check_shares(C, shape.experts_per_rank, BLOCK_SIZE)


@pytest.mark.parametrize(
    ("name", "W", "workload", "profile", "deep"),
    [
        ("seeds", 64, "zipf:2.0", "h100-nvlink-ib", 2),
        ("deepseek", 256, "zipf:1.2", "h100-ib", 2),
        ("deepseek", 64, "zipf:2.0", "h100-ib", 1),
        ("seeds", 256, "zipf:2.0", "h100-ib", 1),  # 2 shadowed: one start, the hottest alone
    ],
)
def test_the_walk_goes_as_deep_as_each_start_lowers_the_step(
    monkeypatch, name: str, W: int, workload: str, profile: str, deep: int
) -> None:
    """Keeping only the first j thinned starts: the step falls with each j up to ``deep`` and
    not after it. The compiled plan (every start) is the Python one."""
    prof = load_profile(profile)
    C, shape = _bench_case(name, W, workload)
    fast, slow = _both(monkeypatch, C, shape, prof, 4)
    assert _canon(fast) == _canon(slow)
    monkeypatch.setattr(planner_module, "planned", lambda *a: None)
    steps = []
    for j in range(deep + 2):
        monkeypatch.setattr(
            planner_module, "thinned_starts", lambda *a, j=j: thinned_starts(*a)[:j]
        )
        steps.append(plan_mix(C, shape, prof, 4).prediction.step_s)
    assert all(b < a for a, b in itertools.pairwise(steps[: deep + 1]))
    assert steps[deep + 1] == steps[deep] == fast.prediction.step_s


def _thinned_fills(monkeypatch) -> list:
    """The starts of the fills ``plan_mix``'s Python steps run from a thinned start."""
    monkeypatch.setattr(planner_module, "planned", lambda *a: None)
    thinned, ran = [], []
    fill = planner_module._water_fill

    def listed(*args):
        out = thinned_starts(*args)
        thinned.extend(out)
        return out

    def spy(C, colsum, shape, model, start, *args, **kwargs):
        if any(start is t for t in thinned):
            ran.append(start)
        return fill(C, colsum, shape, model, start, *args, **kwargs)

    monkeypatch.setattr(planner_module, "thinned_starts", listed)
    monkeypatch.setattr(planner_module, "_water_fill", spy)
    return ran


def _walked(monkeypatch, C, shape, prof, **constants) -> tuple:
    """(the compiled plan, the thinned fills the Python steps ran) with the planner's
    ``constants`` set (e.g. THIN_WHEN=2.0); asserts the compiled plan is the Python one."""
    with monkeypatch.context() as m:
        for name, value in constants.items():
            m.setattr(planner_module, name, value)
        fast, slow = _both(m, C, shape, prof, 4)
        assert _canon(fast) == _canon(slow)
        ran = _thinned_fills(m)
        plan_mix(C, shape, prof, 4)
    return fast, ran


def test_the_walk_stops_below_thin_gain(monkeypatch) -> None:
    """DeepSeek-like W = 8 zipf:2.0 (one node): the first thinned fill ends 0.17% below the fill
    from the candidate (4.6359 against 4.6436 ms), less than THIN_GAIN: it wins, and the walk
    stops there (the next fill would cost as much planning); with THIN_GAIN 0 it goes on, and
    the compiled planner reads the constant as the Python does."""
    prof = load_profile("h100-nvlink-ib")
    C, shape = _bench_case("deepseek", 8, "zipf:2.0")
    plan, ran = _walked(monkeypatch, C, shape, prof)
    assert len(ran) == 1 and 4.6358 < 1e3 * plan.prediction.step_s < 4.636
    _, ran = _walked(monkeypatch, C, shape, prof, THIN_GAIN=0.0)
    assert len(ran) >= 2


def test_no_walk_where_the_fill_from_the_candidate_moved_little(monkeypatch) -> None:
    """DeepSeek-like W = 64 hotset:8:0.5: the best candidate shadows the 8 hot experts at every
    rank and the fill from it ends less than 10% below it (THIN_WHEN): no thinned fill runs (in
    ``bench balance`` such walks lost 2-39% and cost a fill each). With THIN_WHEN above 1 the
    walk runs, and ends at its first fill, which is not the best: the same plan. The compiled
    planner reads the constant as the Python does."""
    prof = load_profile("h100-ib")
    C, shape = _bench_case("deepseek", 64, "hotset:8:0.5")
    best = plan_mix(C, shape, prof, 4, balance=False)
    assert thinned_starts(best.replicas, C.sum(0), 64)
    gated, ran = _walked(monkeypatch, C, shape, prof)
    assert ran == []
    fast, ran = _walked(monkeypatch, C, shape, prof, THIN_WHEN=2.0)
    assert len(ran) == 1
    assert fast.prediction.step_s == gated.prediction.step_s


def test_small_counts_walk_past_the_gate(monkeypatch) -> None:
    """DeepSeek-like W = 8 zipf:1.2 on one node: the fill from the candidate ends only 3% below
    it, but C has 2048 counts (THIN_ALWAYS): the walk runs, each of 5 starts the best fill so
    far and the 6th not, 5.7% in all (4.769 against 5.057 ms); with THIN_ALWAYS 0 the gate
    holds and no thinned fill runs. The compiled planner reads the constant as the Python
    does."""
    prof = load_profile("h100-nvlink")
    C, shape = _bench_case("deepseek", 8, "zipf:1.2")
    fast, ran = _walked(monkeypatch, C, shape, prof)
    assert len(ran) == 6
    gated, ran = _walked(monkeypatch, C, shape, prof, THIN_ALWAYS=0)
    assert ran == []
    assert fast.prediction.step_s < 0.95 * gated.prediction.step_s


def _shadowed_counts(rng: random.Random, W: int, E: int, tie: bool = False) -> torch.Tensor:
    """DeepSeek-like routing (4096 tokens a rank, top-8, zipf 1.0-2.2 over W * E experts):
    FasterMoE's rule shadows its hottest experts, as in ``bench balance``'s DeepSeek-like
    cases. ``tie``: the 8 hottest experts' columns made equal (their column sums tie)."""
    skew = rng.uniform(1.0, 2.2)
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    C = synthetic_counts(RoutingSpec.parse(f"zipf:{skew:.2f}"), W, 4096, 8, W * E, gen,
                         shuffle_experts=True)  # fmt: skip
    if tie:
        hot = C.sum(0).argsort(descending=True)[:8]
        C[:, hot] = C[:, hot[:1]]
    return C


def _deepseek_like(W: int, E: int) -> LayerShape:
    return LayerShape(2048, 1024, E, W, 2, gemms_per_expert=3)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), W=st.integers(6, 12), E=st.sampled_from([4, 8]))
def test_never_slower_for_the_thinned_starts(seed: int, W: int, E: int) -> None:
    """The thinned fills run last and a winner must be below every fill before it, each fill
    judged by its own loads: with them a plan is never predicted slower than without them, but
    for the rows its plan's block cuts move (a fill's own step and its plan's price differ by
    those: seed 338686, W = 10, 12.12672 ms against 12.12614, 0.005%; Python steps both)."""
    rng = random.Random(seed)
    C = _shadowed_counts(rng, W, E)
    shape = _deepseek_like(W, E)
    profile = rng.choice([NVLINK, IB, NODES])
    saved, compiled = planner_module.thinned_starts, planner_module.planned
    planner_module.planned = lambda *a: None
    try:
        plan = plan_mix(C, shape, profile, 4)
        planner_module.thinned_starts = lambda *a: []
        without = plan_mix(C, shape, profile, 4)
    finally:
        planner_module.thinned_starts, planner_module.planned = saved, compiled
    assert plan.prediction.step_s <= 1.001 * without.prediction.step_s
    plan.check_shares(C, E, BLOCK_SIZE)


def test_equals_the_python_plan_on_shadowed_counts(monkeypatch) -> None:
    """DeepSeek-like random counts whose hottest experts FasterMoE shadows, half of them with
    the 8 hottest tied (the lower id is hotter in both twins), one link and nodes of 4: the
    compiled plan is the Python one; in many of them the thinned fills win."""
    rng = random.Random(3)
    won = 0
    for case in range(24):
        W, E = rng.choice([(6, 16), (8, 8), (12, 8), (16, 4)])
        C = _shadowed_counts(rng, W, E, tie=case % 2 == 1)
        shape = _deepseek_like(W, E)
        profile = rng.choice([NVLINK, IB, NODES])
        fast, slow = _both(monkeypatch, C, shape, profile, 4)
        assert _canon(fast) == _canon(slow), case
        with monkeypatch.context() as m:
            m.setattr(planner_module, "planned", lambda *a: None)
            m.setattr(planner_module, "thinned_starts", lambda *a: [])
            won += plan_mix(C, shape, profile, 4).prediction.step_s > fast.prediction.step_s
    assert won >= 4, won


@pytest.mark.parametrize("profile", ["h100-ib", "h100-nvlink-ib"])
def test_beaten_fills_are_dropped_and_change_no_plan(monkeypatch, profile: str) -> None:
    """Seeds' shape, W = 64, zipf:2.0: fills whose mean total reaches the step they must beat
    stop there (``level_fill``'s beat; their max could not come below it) and are dropped. The
    plan is the one the fills make run to their end (the Python steps with the beat off), and
    the compiled planner's (the same stops: ``tests/placement/test_native_fill.py``)."""
    prof = load_profile(profile)
    C, shape = _bench_case("seeds", 64, "zipf:2.0")
    fast, slow = _both(monkeypatch, C, shape, prof, 4)
    assert _canon(fast) == _canon(slow)
    real = planner_module.level_fill
    beaten = []

    def spy(state, *args):
        moves = real(state, *args)
        beaten.append(state.beaten)
        return moves

    with monkeypatch.context() as m:  # the Python fills, then with no beat
        m.setattr(planner_module, "planned", lambda *a, **k: None)
        m.setattr(planner_module, "filled", lambda *a, **k: None)
        m.setattr(planner_module, "level_fill", spy)
        stopped = plan_mix(C, shape, prof, 4)
        assert sum(beaten) >= 1 and len(beaten) >= 3
        m.setattr(planner_module, "level_fill", lambda state, *args: real(state, *args[:3]))
        unstopped = plan_mix(C, shape, prof, 4)
    assert _canon(stopped) == _canon(unstopped) == _canon(fast)
