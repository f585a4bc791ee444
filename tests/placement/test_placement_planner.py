"""Replica plans: determinism, the placement rule, the replica cap, never-worse-than-a2a, the
skew / uniform extremes, FasterMoE's shadow rule on hand-checked toys, and input validation.

Legend: W ranks, E experts per rank, N = W*E experts, counts_WN[s][g] = rows s routes to g.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import (
    CPU_PROFILE,
    GPU_PROFILE,
    HardwareProfile,
    LayerShape,
    Plan,
    plan_none,
    plan_shadow,
    predict,
)
from mixmoe.placement.cost_model import StepModel
from mixmoe.placement.replica_search import plan_replicas
from mixmoe.reference.planner import plan_mix_rescan, plan_shadow_lists

COMPUTE_BOUND = HardwareProfile(
    "compute-bound", gemm_flops=1e9, link_bandwidth=1e11, link_latency=1e-6
)
LINK_BOUND = HardwareProfile("link-bound", gemm_flops=1e9, link_bandwidth=1e6, link_latency=1e-6)
# with tiny experts (F = 16) a replica costs a few dozen rows on the wire: a bottleneck rank can
# gain by fetching one for an expert it sends rows to (a "source" candidate)
TOKEN_BOUND = HardwareProfile("token-bound", gemm_flops=1e13, link_bandwidth=1e8, link_latency=1e-6)
# the optional fixed costs switched on (every term of the cost model nonzero)
FIXED_COSTS = HardwareProfile(
    "fixed-costs",
    gemm_flops=1e9,
    link_bandwidth=1e9,
    link_latency=1e-5,
    step_fixed_s=3e-3,
    row_overhead_s=7e-7,
    replica_fixed_s=2e-3,
)
PROFILES = [CPU_PROFILE, GPU_PROFILE, COMPUTE_BOUND, LINK_BOUND, FIXED_COSTS]
# Shadow toys: D=1, F=1, fp32 -> flops_per_row = 12, row_bytes = 4, P = (2 + 1 + 1) * 4 = 16 B.
# Profile 12 FLOP/s, 16 B/s: t_row = 1, t_feat = 4 * 4 / 16 = 1, t_model = 16 / 16 = 1, so
# lat(S) = 2 * max_r B_r(S) + |S|.
UNIT = HardwareProfile("unit", gemm_flops=12.0, link_bandwidth=16.0, link_latency=1e-3)


def _random_counts(W: int, N: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    probs_N = torch.rand(N, generator=g) ** 4  # skewed
    return torch.stack(
        [
            torch.bincount(torch.multinomial(probs_N, 512, True, generator=g), minlength=N)
            for _ in range(W)
        ]
    )


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_deterministic_and_input_form_independent(profile: HardwareProfile) -> None:
    W, E = 4, 3
    counts_WN = _random_counts(W, W * E, seed=7)
    shape = LayerShape(64, 256, E, W, 2)
    for plan_fn in (
        lambda c: plan_replicas(c, shape, profile, max_replicas=4),
        lambda c: plan_shadow(c, shape, profile),
        lambda c: plan_none(c, shape, profile),
    ):
        ref = plan_fn(counts_WN)
        assert plan_fn(counts_WN) == ref
        assert plan_fn(counts_WN.tolist()) == ref
        assert plan_fn(counts_WN.to(torch.int32)) == ref
        assert plan_fn(tuple(tuple(row) for row in counts_WN.tolist())) == ref


def _check_segments(plan: Plan, counts_WN: list[list[int]], E: int) -> None:
    """Every (s, g) with rows is computed at exactly one rank, s or the owner, and the rows the
    prediction puts on each rank are exactly those segments."""
    W = len(counts_WN)
    rows_W = [0] * W
    for s in range(W):
        for g, c in enumerate(counts_WN[s]):
            at = plan.computed_at(s, g, E)
            assert at in (s, g // E)
            assert (at == s) == (s == g // E or s in plan.holders(g))
            rows_W[at] += c
    assert tuple(rows_W) == plan.prediction.rows


@settings(max_examples=150, deadline=None)
@given(
    W=st.integers(1, 8),
    E=st.integers(1, 8),
    max_replicas=st.integers(0, 10),
    profile=st.sampled_from(PROFILES),
    overlap=st.booleans(),
    data=st.data(),
)
def test_mix_properties(
    W: int, E: int, max_replicas: int, profile: HardwareProfile, overlap: bool, data: st.DataObject
) -> None:
    N = W * E
    cell = st.one_of(st.just(0), st.integers(1, 8), st.integers(0, 2000))
    counts_WN = data.draw(st.lists(st.lists(cell, min_size=N, max_size=N), min_size=W, max_size=W))
    shape = LayerShape(64, 256, E, W, data.draw(st.sampled_from([2, 4])))
    plan = plan_replicas(counts_WN, shape, profile, max_replicas, overlap=overlap)

    assert plan.prediction.step_s <= plan.baseline.step_s
    assert (plan.prediction.step_s < plan.baseline.step_s) == bool(plan.hot)
    assert plan.baseline == predict(counts_WN, {}, shape, profile, overlap)
    assert plan.prediction == predict(counts_WN, plan.replicas, shape, profile, overlap)
    assert list(plan.hot) == sorted(set(plan.hot))
    for g, holders in plan.replicas:  # the mixed rule: exactly the other ranks with rows for g
        assert holders == tuple(s for s in range(W) if s != g // E and counts_WN[s][g] > 0)
    for r in range(W):
        slots = plan.replica_slots(r)
        assert len(slots) <= max_replicas
        assert slots == tuple(g for g in plan.hot if r in plan.holders(g))
    _check_segments(plan, counts_WN, E)

    # with a width that fits every shortlist the search stops only where an exhaustive greedy
    # would: no single further expert that fits strictly helps
    plan = plan_replicas(
        counts_WN, shape, profile, max_replicas, overlap=overlap, search_width=10**6
    )
    assert plan.prediction.step_s <= plan.baseline.step_s
    held = [len(plan.replica_slots(r)) for r in range(W)]
    for g in range(N):
        holders = tuple(s for s in range(W) if s != g // E and counts_WN[s][g] > 0)
        if g in plan.hot or not holders or any(held[s] >= max_replicas for s in holders):
            continue
        more = predict(counts_WN, [*plan.hot, g], shape, profile, overlap)
        assert not more.step_s < plan.prediction.step_s


def _reference_mix_hot(counts_WN, shape, profile, max_replicas, overlap) -> tuple[int, ...]:
    """The greedy of ``plan_mix_rescan`` (today's planner) spelled out with ``predict`` only: full passes over the
    rejected candidates until a pass accepts nothing."""
    W, E = shape.world_size, shape.experts_per_rank
    candidates = []
    for g in range(shape.num_experts):
        holders = tuple(s for s in range(W) if s != g // E and counts_WN[s][g] > 0)
        if holders:
            candidates.append((-sum(counts_WN[s][g] for s in holders), g, holders))
    pending = sorted(candidates)
    hot: dict[int, tuple[int, ...]] = {}
    best = predict(counts_WN, {}, shape, profile, overlap).step_s
    while pending:
        rejected = []
        for cand in pending:
            _, g, holders = cand
            held = [sum(r in h for h in hot.values()) for r in range(W)]
            if any(held[s] >= max_replicas for s in holders):
                continue
            step = predict(counts_WN, {**hot, g: holders}, shape, profile, overlap).step_s
            if step < best:
                best, hot[g] = step, holders
            else:
                rejected.append(cand)
        if len(rejected) == len(pending):
            break
        pending = rejected
    return tuple(sorted(hot))


@settings(max_examples=100, deadline=None)
@given(
    W=st.integers(2, 6),
    E=st.integers(1, 6),
    max_replicas=st.integers(1, 6),
    profile=st.sampled_from(PROFILES),
    overlap=st.booleans(),
    data=st.data(),
)
def test_rescan_planner_matches_its_spelled_out_greedy(
    W: int, E: int, max_replicas: int, profile: HardwareProfile, overlap: bool, data: st.DataObject
) -> None:
    N = W * E
    cell = st.one_of(st.just(0), st.integers(1, 8), st.integers(0, 2000))
    counts_WN = data.draw(st.lists(st.lists(cell, min_size=N, max_size=N), min_size=W, max_size=W))
    shape = LayerShape(64, 256, E, W, 4)
    plan = plan_mix_rescan(counts_WN, shape, profile, max_replicas, overlap=overlap)
    assert plan.hot == _reference_mix_hot(counts_WN, shape, profile, max_replicas, overlap)
    assert plan.prediction == predict(counts_WN, plan.replicas, shape, profile, overlap)


@pytest.mark.parametrize("W,E,seed", [(3, 2, 3), (1, 4, 0), (5, 3, 1), (8, 1, 2)])
def test_plan_none(W: int, E: int, seed: int) -> None:
    """The vectorised a2a plan equals the per-rank cost model (``predict`` on lists) exactly,
    from lists and from int64 / int32 tensors."""
    counts_WN = _random_counts(W, W * E, seed=seed)
    shape = LayerShape(64, 256, E, W, 2)
    want = predict(counts_WN.tolist(), {}, shape, CPU_PROFILE, False)
    for counts in (counts_WN.tolist(), counts_WN, counts_WN.to(torch.int32)):
        plan = plan_none(counts, shape, CPU_PROFILE)
        assert plan.hot == () and plan.replicas == () and plan.replica_slots(0) == ()
        assert plan.prediction == plan.baseline == want
    with_overlap = plan_none(counts_WN, shape, CPU_PROFILE, overlap=True)
    assert with_overlap.prediction == predict(counts_WN, {}, shape, CPU_PROFILE)


@settings(max_examples=100, deadline=None)
@given(W=st.integers(1, 8), E=st.integers(1, 8), profile=st.sampled_from(PROFILES), data=st.data())
def test_shadow_properties(W: int, E: int, profile: HardwareProfile, data: st.DataObject) -> None:
    N = W * E
    cell = st.one_of(st.just(0), st.integers(0, 2000))
    counts_WN = data.draw(st.lists(st.lists(cell, min_size=N, max_size=N), min_size=W, max_size=W))
    shape = LayerShape(64, 256, E, W, 2)
    plan = plan_shadow(counts_WN, shape, profile)
    for g, holders in plan.replicas:  # broadcast to every other rank
        assert holders == tuple(r for r in range(W) if r != g // E)
    assert plan.prediction == predict(counts_WN, plan.replicas, shape, profile, overlap=False)
    _check_segments(plan, counts_WN, E)


@settings(max_examples=150, deadline=None)
@given(
    W=st.integers(1, 9),
    E=st.integers(1, 6),
    top=st.sampled_from([3, 40, 2000]),  # small counts: many tied loads (tie order matters)
    profile=st.sampled_from([*PROFILES, UNIT]),
    data=st.data(),
)
def test_shadow_on_the_counts_tensor_equals_its_list_twin(
    W: int, E: int, top: int, profile: HardwareProfile, data: st.DataObject
) -> None:
    N = W * E
    counts_WN = data.draw(
        st.lists(st.lists(st.integers(0, top), min_size=N, max_size=N), min_size=W, max_size=W)
    )
    shape = LayerShape(1, 1, E, W, 4) if profile is UNIT else LayerShape(64, 256, E, W, 2)
    for overlap in (False, True):
        want = plan_shadow_lists(counts_WN, shape, profile, overlap=overlap)
        got = plan_shadow(
            torch.tensor(counts_WN, dtype=torch.int64), shape, profile, overlap=overlap
        )
        assert got == want  # hot set, holders, prediction and baseline, exactly


def test_shadow_twin_on_random_skewed_cases_that_shadow() -> None:
    shadowed = 0
    for seed in range(30):
        W, E = 2 + seed % 7, 1 + seed % 4
        counts_WN = _random_counts(W, W * E, seed) * (1 + seed % 3)
        counts_WN[:, seed % (W * E)] += 300  # a hot expert
        shape = LayerShape(64, 256, E, W, 2)
        for profile in (COMPUTE_BOUND, GPU_PROFILE, UNIT):
            want = plan_shadow_lists(counts_WN.tolist(), shape, profile)
            assert plan_shadow(counts_WN, shape, profile) == want, (seed, profile.name)
            shadowed += len(want.hot)
    assert shadowed > 30  # the cases really shadow (several experts at a time)


def test_extreme_skew() -> None:
    """All rows to expert 0 (owner: rank 0). 64 rows per rank, D=64, F=256, fp32:
    per row 196608 FLOP, 256 B; one expert's parameters P = 132352 B.

    compute-bound (1 GFLOP/s, 100 GB/s): a2a puts 256 rows (~50 ms) on rank 0; replicas on ranks
    1-3 leave 64 rows (~12.6 ms) each, for ~4 us of weight traffic -> replicate.
    link-bound (1 MB/s): a2a costs rank 0 ~50 ms of compute + ~86 ms of exposed token traffic
    (192 remote rows x 512 B); replicas cost it 3 x P = 397 KB of weights (~0.4 s) -> don't.
    """
    W, E = 4, 2
    counts_WN = [[64] + [0] * (W * E - 1) for _ in range(W)]
    shape = LayerShape(64, 256, E, W, 4)
    plan = plan_replicas(counts_WN, shape, COMPUTE_BOUND, max_replicas=1)
    assert plan.replicas == ((0, (1, 2, 3)),)
    assert plan.prediction.rows == (64, 64, 64, 64)
    assert plan.baseline.rows == (256, 0, 0, 0)
    assert plan_replicas(counts_WN, shape, LINK_BOUND, max_replicas=1).hot == ()
    assert plan_replicas(counts_WN, shape, COMPUTE_BOUND, max_replicas=0).hot == ()


def test_uniform_routing_cheap_compute_replicates_nothing() -> None:
    W, E = 4, 2
    counts_WN = [[100] * (W * E) for _ in range(W)]
    shape = LayerShape(64, 256, E, W, 2)
    cheap_compute = HardwareProfile(
        "cheap-compute", gemm_flops=1e18, link_bandwidth=1e9, link_latency=1e-5
    )
    for profile in (cheap_compute, GPU_PROFILE, CPU_PROFILE):
        assert plan_replicas(counts_WN, shape, profile, max_replicas=8).hot == ()


def test_shadow_toy_two_ranks() -> None:
    counts_WN = [[4, 0], [4, 2]]  # loads: e0 = 8, e1 = 2
    shape = LayerShape(1, 1, experts_per_rank=1, world_size=2, bytes_per_element=4)
    # lat({})     = 2 * max(8, 2) = 16
    # lat({0})    = 2 * max(4, 2 + 4) + 1 = 13 < 16 -> shadow e0
    # lat({0, 1}) = 2 * max(4 + 0, 6 - 2 + 2) + 2 = 14 >= 13 -> stop
    plan = plan_shadow(counts_WN, shape, UNIT)
    assert plan.replicas == ((0, (1,)),)
    assert plan.computed_at(1, 0, 1) == 1 and plan.computed_at(0, 1, 1) == 1


def test_shadow_needs_a_strict_drop() -> None:
    """An expert joins S only if the estimate drops strictly. D = 1, F = 3, fp32: flops_per_row
    36, row_bytes 4, params 40 B; 144 FLOP/s, 16 B/s: t_row + t_feat = 0.25 + 1 = 1.25 and
    t_model = 2.5 (exact in binary), so lat(S) = 1.25 * (max_r B_r(S) + 2 |S|): shadowing an
    expert that lowers the busiest rank by exactly 2 rows leaves the estimate equal."""
    shape = LayerShape(1, 3, experts_per_rank=1, world_size=2, bytes_per_element=4)
    tie = HardwareProfile("tie", gemm_flops=144.0, link_bandwidth=16.0, link_latency=1e-3)
    # lat({}) = 1.25 * 12 = 15; lat({0}) = 1.25 * max(10, 2 + 2) + 2.5 = 15: not lower
    assert plan_shadow([[10, 1], [2, 1]], shape, tie).hot == ()
    # one more row from rank 1: lat({}) = 16.25, lat({0}) = 1.25 * 10 + 2.5 = 15 -> shadow e0
    assert plan_shadow([[10, 1], [3, 1]], shape, tie).hot == (0,)


def test_shadow_toy_three_ranks_stops_at_first_useless() -> None:
    counts_WN = [[10, 25, 0], [60, 10, 0], [60, 25, 10]]  # loads: e0 = 130, e1 = 60, e2 = 10
    shape = LayerShape(1, 1, experts_per_rank=1, world_size=3, bytes_per_element=4)
    # lat({})        = 2 * 130 = 260
    # lat({0})       = 2 * max(10, 60 + 60, 10 + 60) + 1 = 241 -> shadow e0
    # lat({0, 1})    = 2 * max(10 + 25, 120 - 60 + 10, 70 + 25) + 2 = 192 -> shadow e1
    # lat({0, 1, 2}) = 2 * max(35, 70, 95 - 10 + 10) + 3 = 193 >= 192 -> stop
    plan = plan_shadow(counts_WN, shape, UNIT)
    assert plan.replicas == ((0, (1, 2)), (1, (0, 2)))
    assert plan.replica_slots(2) == (0, 1) and plan.replica_slots(0) == (1,)
    assert plan.prediction.rows == (35, 70, 95)


def test_plan_accessors() -> None:
    shape = LayerShape(4, 8, experts_per_rank=2, world_size=3, bytes_per_element=2)
    counts_WN = [[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1], [1, 1, 1, 1, 1, 1]]
    base = predict(counts_WN, {}, shape, CPU_PROFILE)
    plan = Plan((1, 4), ((1, (2,)), (4, (0, 1))), base, base)
    assert plan.holders(4) == (0, 1) and plan.holders(0) == ()
    assert plan.replica_slots(0) == (4,) and plan.replica_slots(2) == (1,)
    assert plan.computed_at(2, 1, 2) == 2  # replica
    assert plan.computed_at(1, 1, 2) == 0  # no replica -> owner
    assert plan.computed_at(0, 0, 2) == 0  # own expert
    with pytest.raises(ValueError, match="ascending"):
        Plan((4, 1), ((4, (0,)), (1, (2,))), base, base)
    with pytest.raises(ValueError, match="exactly hot"):
        Plan((1,), (), base, base)


def test_bad_planner_inputs() -> None:
    shape = LayerShape(4, 8, experts_per_rank=2, world_size=2, bytes_per_element=2)
    counts_WN = [[1, 2, 3, 4], [4, 3, 2, 1]]
    with pytest.raises(ValueError, match="max_replicas must be >= 0, got -1"):
        plan_replicas(counts_WN, shape, CPU_PROFILE, max_replicas=-1)
    with pytest.raises(TypeError, match="max_replicas"):
        plan_replicas(counts_WN, shape, CPU_PROFILE, max_replicas=True)
    with pytest.raises(TypeError, match="overlap"):
        plan_replicas(counts_WN, shape, CPU_PROFILE, 2, overlap=1)
    for plan_fn in (plan_none, plan_shadow, lambda c, s, p: plan_replicas(c, s, p, 2)):
        with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
            plan_fn(torch.ones(2, 3, dtype=torch.int64), shape, CPU_PROFILE)
        with pytest.raises(ValueError, match=r"counts_WN\[1\]\[2\] = -2"):
            plan_fn([[1, 2, 3, 4], [4, 3, -2, 1]], shape, CPU_PROFILE)


# -- plan_replicas (the source-replica search) at scale: agreement with the rescan, determinism --

GRID = [
    (routing, W, N, profile, max_replicas)
    for routing in ("uniform", "zipf:1.2", "hot:0.3")
    for W, N in ((4, 16), (8, 64), (16, 64))
    for profile in (GPU_PROFILE, CPU_PROFILE)
    for max_replicas in (1, 4)
]


@pytest.mark.parametrize("contiguous", [False, True], ids=["shuffled", "contiguous"])
def test_mix_within_tolerance_of_todays_planner(contiguous: bool) -> None:
    """The stated tolerance: predicted mix / a2a at most 0.02 above today's planner's on every
    case of a grid of routings, sizes, profiles and replica caps (768 tokens/rank, top-2)."""
    gaps = []
    for routing, W, N, profile, max_replicas in GRID:
        gen = torch.Generator().manual_seed(W * N)
        counts_WN = synthetic_counts(
            RoutingSpec.parse(routing), W, 768, 2, N, gen, shuffle_experts=not contiguous
        )
        shape = LayerShape(1024, 4096, N // W, W, 2)
        a2a = plan_none(counts_WN, shape, profile).prediction.step_s
        new = plan_replicas(counts_WN, shape, profile, max_replicas).prediction.step_s / a2a
        old = plan_mix_rescan(counts_WN, shape, profile, max_replicas).prediction.step_s / a2a
        gaps.append((new - old, routing, W, N, profile.name, max_replicas))
    assert max(gaps)[0] <= 0.02, max(gaps)


def _layouts(counts_WN: torch.Tensor):
    """The same counts in every form a caller may hand over."""
    W, N = counts_WN.shape
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.randperm(W, generator=g), torch.randperm(N, generator=g)
    shuffled = counts_WN[rows][:, cols]
    restored = torch.empty_like(shuffled)
    restored[rows] = shuffled[:, cols.argsort()]
    assert torch.equal(restored, counts_WN) and not torch.equal(shuffled, counts_WN)
    yield counts_WN
    yield restored  # shuffled, then restored: other memory, same counts
    yield counts_WN.t().contiguous().t()  # non-contiguous
    yield counts_WN.to(torch.int32)
    yield counts_WN.tolist()


def test_mix_same_plan_from_every_layout_and_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    counts_WN = synthetic_counts(RoutingSpec.parse("zipf:1.2"), 16, 512, 2, 64, torch.Generator())
    shape = LayerShape(1024, 4096, 4, 16, 2)
    ref = plan_replicas(counts_WN, shape, COMPUTE_BOUND, 4)
    assert ref.hot  # the case replicates something
    for counts in _layouts(counts_WN):
        assert plan_replicas(counts, shape, COMPUTE_BOUND, 4) == ref
    # background threads (how the layer may run it off the critical path) give the same plan
    with ThreadPoolExecutor(4) as pool:
        plans = list(
            pool.map(lambda _: plan_replicas(counts_WN, shape, COMPUTE_BOUND, 4), range(8))
        )
    assert all(p == ref for p in plans)


def test_mix_same_plan_in_another_process() -> None:
    """Every rank is another process: the plan (and every float of its prediction) must match."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import mixmoe

    code = (
        "import torch, pickle, sys\n"
        "from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts\n"
        "from mixmoe.placement import HardwareProfile, LayerShape\n"
        "from mixmoe.placement.replica_search import plan_replicas\n"
        "COMPUTE_BOUND = HardwareProfile('compute-bound', 1e9, 1e11, 1e-6)\n"
        "torch.set_num_threads(1)\n"
        "c = synthetic_counts(RoutingSpec.parse('hot:0.3'), 32, 256, 2, 128, "
        "torch.Generator().manual_seed(5))\n"
        "p = plan_replicas(c, LayerShape(1024, 4096, 4, 32, 2), COMPUTE_BOUND, 4)\n"
        "sys.stdout.write(repr((p.replicas, p.prediction, p.baseline)))\n"
    )
    counts_WN = synthetic_counts(
        RoutingSpec.parse("hot:0.3"), 32, 256, 2, 128, torch.Generator().manual_seed(5)
    )
    plan = plan_replicas(counts_WN, LayerShape(1024, 4096, 4, 32, 2), COMPUTE_BOUND, 4)
    assert plan.hot
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(mixmoe.__file__).resolve().parent.parent)},
    ).stdout
    assert out == repr((plan.replicas, plan.prediction, plan.baseline))


@settings(max_examples=100, deadline=None)
@given(
    profile=st.sampled_from(PROFILES),
    overlap=st.booleans(),
    any_remote=st.booleans(),
    any_hot=st.booleans(),
    data=st.data(),
)
def test_vector_seconds_equal_scalar_seconds_bit_for_bit(
    profile: HardwareProfile, overlap: bool, any_remote: bool, any_hot: bool, data: st.DataObject
) -> None:
    shape = LayerShape(data.draw(st.integers(1, 8192)), data.draw(st.integers(1, 32768)), 4, 8, 2)
    model = StepModel(shape, profile, overlap)
    loads = data.draw(
        st.lists(st.lists(st.integers(0, 10**8), min_size=4, max_size=4), min_size=1, max_size=9)
    )
    compute_W, comm_W = model.seconds_W(
        torch.tensor(loads, dtype=torch.float64).t(), any_remote, any_hot
    )
    for r, (rows, local, remote, replica) in enumerate(loads):
        compute, comm = model.rank_seconds(rows, local, remote, replica, any_remote, any_hot)
        assert (compute_W[r].item(), comm_W[r].item()) == (compute, comm)
        total = model.rank_total(rows, local, remote, replica, any_remote, any_hot)
        assert total == compute + comm == (compute_W[r] + comm_W[r]).item()


def test_pack_equals_list_pack_and_int64_overflow() -> None:
    """``StepModel.pack`` (tensor products and max) gives ``prediction_lists``' record, also
    where an int64 product would overflow (then Python ints)."""
    model = StepModel(LayerShape(4096, 16384, 4, 8, 4), GPU_PROFILE, True)
    gen = torch.Generator().manual_seed(0)
    cases = [
        (model, torch.randint(0, high, (4, 8), generator=gen, dtype=torch.int64).tolist())
        for high in (10**6, 2**52)
    ]
    # D = F = 1, fp32: 16 token bytes per row and 32 weight bytes per replica (powers of 2), so
    # a product lands on 2**63 exactly: the edge (Python ints), and remote rows whose token
    # bytes alone overflow int64 while no replica is held (the check must see both rows)
    tiny = StepModel(LayerShape(1, 1, 4, 8, 4), GPU_PROFILE, True)
    assert (2 * tiny.token_bytes_per_row, 2 * tiny.params_bytes) == (16, 32)
    cases.append((tiny, [[1] * 8, [1] * 8, [1] * 8, [2**58] * 8]))
    cases.append((tiny, [[1] * 8, [1] * 8, [2**59] * 8, [0] * 8]))
    for model, loads in cases:
        weight = 2 * model.params_bytes
        packed = model.prediction_W(torch.tensor(loads, dtype=torch.float64))
        assert packed == model.prediction_lists(*loads)
        assert packed.token_bytes == tuple(2 * model.token_bytes_per_row * r for r in loads[2])
        assert packed.weight_bytes == tuple(weight * r for r in loads[3])


@settings(max_examples=100, deadline=None)
@given(
    profile=st.sampled_from([*PROFILES, TOKEN_BOUND]),
    overlap=st.booleans(),
    any_remote=st.booleans(),
    data=st.data(),
)
def test_source_bound_premise_and_soundness(
    profile: HardwareProfile, overlap: bool, any_remote: bool, data: st.DataObject
) -> None:
    """``_sources_may_pass`` skips scoring b's row only with proof: along the loads a source
    candidate gives b, (rows + c, local + c, remote - c, replica + 1), compute never decreases
    and comm never increases (its premise, checked here on random loads, remote - c below zero
    included), and a False answer means no c in [1, cmax] brings b's total below ``best``."""
    from mixmoe.placement.replica_search import _sources_may_pass

    shape = LayerShape(data.draw(st.integers(1, 4096)), data.draw(st.integers(1, 8192)), 4, 8, 2)
    model = StepModel(shape, profile, overlap)
    rows, local, remote, replica = (data.draw(st.integers(0, 10**6)) for _ in range(4))
    cmax = data.draw(st.integers(0, 3000))

    def seconds(c: int) -> tuple[float, float]:
        return model.rank_seconds(rows + c, local + c, remote - c, replica + 1, any_remote, True)

    per_c = [seconds(c) for c in range(cmax + 1)]
    for (compute0, comm0), (compute1, comm1) in zip(per_c, per_c[1:], strict=False):
        assert compute0 <= compute1 and comm0 >= comm1
    lowest = min((compute + comm for compute, comm in per_c[1:]), default=float("inf"))
    for best in (lowest, lowest * (1 + 1e-12), lowest * 1.01, lowest * 0.99):
        if not _sources_may_pass(model, (rows, local, remote, replica), cmax, any_remote, best):
            assert not lowest < best


@pytest.mark.parametrize("profile", [*PROFILES, TOKEN_BOUND], ids=lambda p: p.name)
def test_source_bound_is_exact_while_its_interval_budget_lasts(profile: HardwareProfile) -> None:
    """The bound's precision is its purpose (a True scores b's whole row of C): with cmax <= 16
    at most 2 * cmax - 1 <= 31 intervals exist, fewer than ``_BOUND_INTERVALS``, so the answer
    is exact, True iff some c in [1, cmax] brings b's total below ``best``."""
    from mixmoe.placement.replica_search import _BOUND_INTERVALS, _sources_may_pass

    assert 2 * 16 - 1 < _BOUND_INTERVALS
    gen = torch.Generator().manual_seed(7)
    answers = set()
    for overlap in (False, True):
        model = StepModel(LayerShape(1024, 4096, 4, 8, 2), profile, overlap)
        for cmax in range(17):
            rows, local, remote, replica = torch.randint(0, 5000, (4,), generator=gen).tolist()
            for any_remote in (False, True):
                totals = [  # b's total with each c of [1, cmax] replicated (compute + comm)
                    sum(
                        model.rank_seconds(
                            rows + c, local + c, remote - c, replica + 1, any_remote, True
                        )
                    )
                    for c in range(1, cmax + 1)
                ]
                lowest = min(totals, default=float("inf"))
                now = model.rank_total(rows, local, remote, replica, any_remote, True)
                for best in (lowest, lowest * (1 + 1e-12), lowest * 1.01, lowest * 0.99, now):
                    got = _sources_may_pass(
                        model, (rows, local, remote, replica), cmax, any_remote, best
                    )
                    assert got == (lowest < best), (profile.name, cmax, best, lowest)
                    answers.add(got)
    assert answers == {False, True}


@pytest.mark.parametrize("seed", [23, 24])
def test_shadow_breaks_ties_by_expert_id_among_many_experts(seed: int) -> None:
    """torch's CPU sort keeps ties in index order without ``stable=True`` only below 17
    elements: 32 experts, 3 hot, the others at loads 0, 3 or 6 (ties of up to 10 experts). The
    shadowing greedy stops partway through a tie, so its order decides which are shadowed."""
    g = torch.Generator().manual_seed(seed)
    W, E = 2, 16
    counts_WN = torch.randint(0, 2, (W, W * E), generator=g) * 3
    counts_WN[0, :3] = 40
    load_N = counts_WN.sum(0)
    assert max(int((load_N == v).sum()) for v in (3, 6)) >= 5  # ties among the candidates
    for profile, shape in (
        (UNIT, LayerShape(1, 1, E, W, 4)),
        (COMPUTE_BOUND, LayerShape(64, 256, E, W, 2)),
    ):
        want = plan_shadow_lists(counts_WN.tolist(), shape, profile)
        assert 3 < len(want.hot) < W * E - 3, want.hot  # the greedy stops inside a tie
        assert plan_shadow(counts_WN, shape, profile) == want, (seed, profile.name)


def test_mix_bounded_search_and_bad_width() -> None:
    counts_WN = synthetic_counts(RoutingSpec.parse("zipf:1.2"), 8, 512, 2, 32, torch.Generator())
    shape = LayerShape(1024, 4096, 4, 8, 2)
    for width in (1, 2, 8):
        plan = plan_replicas(counts_WN, shape, GPU_PROFILE, 2, search_width=width)
        assert plan.prediction.step_s <= plan.baseline.step_s
        assert all(len(plan.replica_slots(r)) <= 2 for r in range(8))
    with pytest.raises(ValueError, match="search_width must be >= 1, got 0"):
        plan_replicas(counts_WN, shape, GPU_PROFILE, 2, search_width=0)
    with pytest.raises(TypeError, match="search_width"):
        plan_replicas(counts_WN, shape, GPU_PROFILE, 2, search_width=2.0)


# (LIST_LIMIT, HOST_LIMIT, BATCH_LIMIT) forcing each Python search path (the compiled search
# off: MIXMOE_NATIVE=0); "compiled": the compiled search (native_search), on by default
PATHS = {
    "lists": (10**9, 0, 0),
    "host": (-1, 10**9, 0),
    "batched": (-1, -1, 10**9),
    "shortlist": (-1, -1, -1),
    "compiled": None,
}


def test_every_search_path_decides_alike(monkeypatch) -> None:
    """Tiny problems search on Python lists (``_ListMixSearch``), up to ``HOST_LIMIT`` ranks on
    the host with the counts in a tensor (``_HostMixSearch``), larger ones shortlist then
    evaluate on tensors (``_MixSearch``), small ones of those scoring every candidate per round
    after the first acceptance (``_BatchedMixSearch``); the compiled search (``native_search``)
    runs before them where it can. Forced each way, they give equal plans
    (hot set, holders, prediction, baseline), width and replica cap binding included, with and
    without candidates listed as sources of the bottleneck (the link-bound profile)."""
    import mixmoe.placement.replica_search as replica_search

    bound_answers = []  # both answers of the bound must occur (b's row scored or skipped)
    may_pass = replica_search._sources_may_pass
    monkeypatch.setattr(
        replica_search,
        "_sources_may_pass",
        lambda *args: bound_answers.append(may_pass(*args)) or bound_answers[-1],
    )
    sources_listed = []  # candidates the bottleneck b does not own, listed (tensor path)
    shortlist = replica_search._MixSearch.shortlist

    def counted_shortlist(search, b, best):
        listed = shortlist(search, b, best)
        sources_listed.extend(g for g in listed if g // search.E != b)
        return listed

    monkeypatch.setattr(replica_search._MixSearch, "shortlist", counted_shortlist)
    plans, hot = {}, 0
    for seed, (W, E) in enumerate(((2, 4), (3, 1), (4, 8), (8, 2), (16, 1), (5, 3))):
        for routing in ("uniform", "zipf:1.2", "hot:0.3", "zipf:2.0"):
            gen = torch.Generator().manual_seed(seed)
            tokens = 300 + 40 * seed
            counts_WN = synthetic_counts(RoutingSpec.parse(routing), W, tokens, 2, W * E, gen)
            for profile, max_replicas, width, hidden in (
                (GPU_PROFILE, 4, 8, 256),
                (COMPUTE_BOUND, 1, 2, 256),
                (COMPUTE_BOUND, 3, 1, 256),
                (CPU_PROFILE, 2, 8, 256),
                (LINK_BOUND, 2, 3, 256),
                (TOKEN_BOUND, 2, 3, 16),
                (FIXED_COSTS, 4, 8, 256),
            ):
                shape = LayerShape(64, hidden, E, W, 2)
                for path in PATHS:
                    _force_path(monkeypatch, path)
                    plans[path] = plan_replicas(
                        counts_WN, shape, profile, max_replicas, search_width=width
                    )
                case = (seed, routing, profile.name, max_replicas)
                assert all(plan == plans["lists"] for plan in plans.values()), case
                hot += len(plans["shortlist"].hot)
    assert hot > 50  # the cases replicate, several experts at a time
    assert True in bound_answers and False in bound_answers
    assert len(sources_listed) > 50


def _force_path(monkeypatch, path: str) -> None:
    import mixmoe.placement.replica_search as replica_search

    if PATHS[path] is None:  # the compiled search (test_native_search checks it is built here)
        monkeypatch.delenv("MIXMOE_NATIVE", raising=False)
        return
    monkeypatch.setenv("MIXMOE_NATIVE", "0")
    list_limit, host_limit, batch_limit = PATHS[path]
    monkeypatch.setattr(replica_search, "LIST_LIMIT", list_limit)
    monkeypatch.setattr(replica_search, "HOST_LIMIT", host_limit)
    monkeypatch.setattr(replica_search, "BATCH_LIMIT", batch_limit)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_width_of_two_stops_every_form_alike(path: str, monkeypatch) -> None:
    """Cases where a round's first two unblocked candidates fail and a later one would pass:
    at ``search_width=2`` every form stops there (the width binds: the list form replicates
    more at a width of 10**6) and gives the list form's plan."""
    cases = (  # seed, W, E, cap: zipf:1.2 routing, the compute-bound profile
        (0, 4, 4, 2),
        (2, 2, 4, 1),
    )
    for seed, W, E, cap in cases:
        gen = torch.Generator().manual_seed(seed)
        counts_WN = synthetic_counts(
            RoutingSpec.parse("zipf:1.2"), W, 200 + 10 * seed, 2, W * E, gen
        )
        shape = LayerShape(64, 256, E, W, 2)
        _force_path(monkeypatch, "lists")
        want = plan_replicas(counts_WN, shape, COMPUTE_BOUND, cap, search_width=2)
        wide = plan_replicas(counts_WN, shape, COMPUTE_BOUND, cap, search_width=10**6)
        assert len(want.hot) < len(wide.hot), (seed, want.hot, wide.hot)  # the width binds
        _force_path(monkeypatch, path)
        got = plan_replicas(counts_WN, shape, COMPUTE_BOUND, cap, search_width=2)
        assert (got.hot, got.replicas) == (want.hot, want.replicas), (seed, got, want)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_replica_cap_of_zero_replicates_nothing_in_every_form(path: str, monkeypatch) -> None:
    """``max_replicas=0``: every form returns the baseline plan, on skewed counts where both
    profiles would replicate with a cap of 1 (the tensor searches rely on plan_replicas' early return:
    their full-holder flags start clear)."""
    _force_path(monkeypatch, path)
    C_WN = synthetic_counts(RoutingSpec.parse("hot:0.8"), 4, 512, 2, 16, torch.Generator())
    shape = LayerShape(64, 16, 4, 4, 2)
    for profile in (UNIT, LINK_BOUND):
        assert plan_replicas(C_WN, shape, profile, 1, False).hot != ()
        plan = plan_replicas(C_WN, shape, profile, 0, False)
        assert plan.hot == () and plan.prediction == plan.baseline


@pytest.mark.parametrize("seed", range(3))
def test_search_paths_break_ties_by_expert_id_among_many_candidates(seed: int, monkeypatch) -> None:
    """Ties in remote rows are broken by expert id in every form: 4 ranks x 8 experts with 0 or
    3 rows per segment give about 24 open candidates, most of them tied (torch's unstable sort
    reorders ties from 17 elements on, so a form that sorted without ``stable=True`` would
    accept another expert). Every form and width gives the plan of the list form (Python's
    sorts are stable), which the batched form only reaches after a first acceptance."""
    shape = LayerShape(1, 1, 8, 4, 2)
    C_WN = torch.randint(0, 2, (4, 32), generator=torch.Generator().manual_seed(seed)) * 3
    accepted = []
    for max_replicas in (1, 8):
        for width in (1, 8, 10**6):
            plans = {}
            for path in PATHS:
                _force_path(monkeypatch, path)
                plans[path] = plan_replicas(
                    C_WN, shape, UNIT, max_replicas, False, search_width=width
                )
            assert all(plan == plans["lists"] for plan in plans.values()), (width, plans)
            accepted.append(len(plans["lists"].hot))
    assert max(accepted) >= 5  # several rounds after the first acceptance


@pytest.mark.parametrize(
    "profile, scale",
    [(UNIT, 1), (COMPUTE_BOUND, 1), (LINK_BOUND, 10), (TOKEN_BOUND, 10)],
    ids=lambda p: getattr(p, "name", p),
)
def test_search_paths_agree_on_small_toys(
    profile: HardwareProfile, scale: int, monkeypatch
) -> None:
    """Toys of 0-3 rows (x ``scale``) per segment, where the rules at the edges decide: on the
    unit profile (D = F = 1, seconds of a few small integers) a candidate's new totals often
    land exactly on the step (it must be rejected: every acceptance strictly lowers the step),
    and with tiny experts (F = 16) the first replica's weight collectives (2 link latencies on
    every rank) often lift a rank the candidate does not touch to the step or above. Every
    search form, at several widths and caps, gives the plan of the tensor shortlist (which
    scores every rank as one vector), whose prediction is ``predict``'s."""
    dims = (1, 1) if profile is UNIT else (64, 16)
    gen = torch.Generator().manual_seed(11)
    plans, hot = {}, 0
    for case in range(60):
        W, E = 2 + case % 3, 1 + case % 2
        counts_WN = torch.randint(0, 4, (W, W * E), generator=gen) * scale
        counts_WN *= torch.rand(W, W * E, generator=gen) < 0.6
        shape = LayerShape(*dims, E, W, 4)
        for max_replicas, width, overlap in ((2, 1, False), (1, 2, True), (3, 10**6, False)):
            for path in PATHS:
                _force_path(monkeypatch, path)
                plans[path] = plan_replicas(
                    counts_WN, shape, profile, max_replicas, overlap, search_width=width
                )
            want = plans["shortlist"]
            assert all(plan == want for plan in plans.values()), (case, max_replicas, width)
            assert want.prediction == predict(counts_WN, want.replicas, shape, profile, overlap)
            assert (want.prediction.step_s < want.baseline.step_s) == bool(want.hot)
            hot += len(want.hot)
    assert hot >= 30  # the toys replicate


# Narrow searches (width 1) where a candidate listed by mistake would take the round's only
# evaluation: (counts, shape, profile, max_replicas, overlap, the plan's hot set)
NARROW_CASES = [
    # many one-row sources: the bottleneck's own candidates serve a replica to each of them
    (
        [
            [1, 0, 0, 15, 1, 0, 0, 0, 25, 0, 1, 0],
            [0, 1, 0, 0, 26, 1, 28, 0, 26, 0, 0, 0],
            [1, 0, 0, 1, 0, 1, 0, 1, 0, 0, 29, 1],
            [19, 0, 28, 12, 0, 24, 1, 7, 1, 20, 8, 19],
        ],
        LayerShape(64, 16, 3, 4, 4),
        TOKEN_BOUND,
        1,
        False,
        (2, 10),
    ),
    # the bottleneck's own candidates leave remote rows: their scores keep the token phase
    # (and, as every trial does, the weight phase)
    (
        [
            [26, 0, 0, 1, 0, 0, 10, 1, 0, 12, 1, 0, 0, 13, 1],
            [1, 5, 0, 0, 0, 0, 0, 0, 0, 20, 0, 1, 25, 0, 21],
            [0, 1, 1, 0, 0, 0, 0, 10, 0, 0, 0, 0, 23, 0, 0],
            [1, 22, 11, 0, 1, 0, 20, 1, 1, 12, 1, 21, 0, 0, 19],
            [0, 0, 0, 0, 20, 20, 16, 1, 21, 7, 1, 0, 18, 0, 14],
        ],
        LayerShape(64, 16, 3, 5, 4),
        TOKEN_BOUND,
        3,
        True,
        (4, 5, 8, 12),
    ),
    # unit profile, overlap: own candidates whose new total at the bottleneck lands exactly on
    # the step (not below it: not listed)
    (
        [
            [1, 0, 1, 0, 2, 1, 0, 0, 1, 2, 2, 1],
            [2, 1, 0, 2, 1, 0, 0, 0, 0, 0, 1, 1],
            [2, 1, 1, 1, 0, 1, 1, 0, 2, 0, 1, 0],
            [0, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0],
        ],
        LayerShape(1, 1, 3, 4, 4),
        UNIT,
        3,
        True,
        (0, 1, 4),
    ),
    # after expert 1, the last remote row goes to the bottleneck's own expert 0 while overlap
    # hides the bottleneck's token phase: only its own lighter loads make expert 0 pay
    ([[0, 6], [1, 1]], LayerShape(1, 1, 1, 2, 4), UNIT, 1, True, (0, 1)),
    # four rounds; after experts 1, 3 and 4, 415 remote rows are left, fewer than expert 1's
    # 625: whether the token phase ends is asked of the last open candidate only, not of any
    (
        [
            [1, 1, 32, 260, 0, 0],
            [0, 94, 0, 7, 0, 1],
            [1, 273, 285, 0, 241, 20],
            [0, 178, 74, 0, 1, 0],
            [92, 0, 0, 1, 0, 194],
            [0, 173, 1, 293, 1, 0],
        ],
        LayerShape(64, 16, 1, 6, 2),
        TOKEN_BOUND,
        3,
        True,
        (1, 3, 4, 5),
    ),
    # unit profile, overlap: candidates the bottleneck sends rows to whose new total at the
    # bottleneck lands exactly on the step (not below it: not listed)
    (
        [
            [0, 0, 1, 1, 0, 0, 1, 2, 0, 1, 0, 0, 2, 2, 0],
            [2, 3, 3, 0, 1, 0, 2, 1, 2, 1, 1, 2, 0, 1, 1],
            [2, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 2, 0, 0],
            [0, 2, 1, 0, 0, 2, 0, 0, 1, 1, 0, 1, 0, 1, 0],
            [2, 0, 0, 1, 1, 2, 2, 0, 0, 0, 0, 3, 1, 2, 1],
        ],
        LayerShape(1, 1, 3, 5, 4),
        UNIT,
        4,
        True,
        (0, 1, 2, 5),
    ),
    # the plan replicates expert 0 to rank 1, which sends it a single row: a source candidate
    # of one row is listed like any other
    ([[240, 0, 0, 0], [1, 257, 0, 0]], LayerShape(1, 1, 2, 2, 4), COMPUTE_BOUND, 2, False, (0, 1)),
]


@pytest.mark.parametrize("case", range(len(NARROW_CASES)))
def test_the_bottlenecks_candidates_are_scored_exactly_at_width_one(case: int, monkeypatch) -> None:
    """The bottleneck's candidates (its own experts, and those it sends rows to) are scored
    with exactly the loads and flags the evaluation then uses: a candidate listed by mistake fails its evaluation, and at width 1 it
    takes the round's only one (the forms on the host then planned less than the tensor
    shortlist here). Every form gives the shortlist's plan, whose prediction is ``predict``'s."""
    counts_WN, shape, profile, max_replicas, overlap, hot = NARROW_CASES[case]
    plans = {}
    for path in PATHS:
        _force_path(monkeypatch, path)
        plans[path] = plan_replicas(
            counts_WN, shape, profile, max_replicas, overlap, search_width=1
        )
    want = plans["shortlist"]
    assert want.hot == hot
    assert all(plan == want for plan in plans.values())
    assert want.prediction == predict(counts_WN, want.replicas, shape, profile, overlap)


# The last expert with remote rows, off the bottleneck b: replicating it changes none of b's
# loads but ends the token phase (its 4 all-to-all latencies leave every rank), which can be all
# the step needs. (counts, shape, profile, max_replicas, the hot set an exhaustive greedy finds)
LAST_REMOTE_CASES = [
    # test_mix_properties' counterexample. CPU profile, fp16, no overlap: rank 0's 422 own rows
    # (1.6594 ms of compute) + 4 x 200 us of token latency = 2.45937 ms make it the bottleneck;
    # rank 1's one row to expert 2 is the only one that travels. Replicating expert 2 swaps the
    # token latency for the weight collectives' 2 x 200 us on rank 0 (2.0594 ms); rank 1 pays
    # 3.9 us of compute + 400 us + 55.1 us of weights + 2 ms fixed = 2.45908 ms: 0.29 us lower.
    ([[422, 0, 0], [0, 0, 1], [0, 0, 0]], LayerShape(64, 256, 1, 3, 2), CPU_PROFILE, 1, (2,)),
    # a second round: once expert 0 keeps rank 1's 1978 rows at home, rank 0's single row to
    # expert 2 is the last remote one, and the new bottleneck (rank 1) neither owns nor sends it
    ([[119, 0, 1], [1978, 1996, 0], [0, 0, 0]], LayerShape(64, 16, 1, 3, 2), LINK_BOUND, 4, (0, 2)),
    # six acceptances; the last, expert 4 (rank 0's 2 rows to rank 2), is off the bottleneck 3
    (
        [
            [0, 0, 1596, 0, 2, 0, 0, 1],
            [0, 0, 0, 0, 0, 0, 936, 1860],
            [0, 0, 468, 1483, 1, 0, 1, 0],
            [0, 1741, 0, 1222, 0, 0, 142, 0],
        ],
        LayerShape(64, 16, 2, 4, 4),
        LINK_BOUND,
        3,
        (1, 2, 3, 4, 6, 7),
    ),
    # the last remote row goes to the bottleneck's own expert (ranks 0 and 1 tie: b = 0): its
    # score at b must drop the token phase too
    ([[0, 0], [1, 1]], LayerShape(64, 256, 1, 2, 4), GPU_PROFILE, 3, (0,)),
    # the fourteenth mutation run's counterexample, found before the fix: rank 2's 423 own rows
    # make it the bottleneck; rank 0's two rows to expert 1 (rank 1's, which gets no others) are
    # the only ones that travel, and neither rank 0 nor rank 1 is the bottleneck
    ([[0, 2, 0], [0, 0, 0], [0, 0, 423]], LayerShape(64, 256, 1, 3, 2), CPU_PROFILE, 1, (1,)),
]


@pytest.mark.parametrize("case", range(len(LAST_REMOTE_CASES)))
def test_the_expert_that_ends_the_token_phase_is_found_off_the_bottleneck(
    case: int, monkeypatch
) -> None:
    """Every search form, at every width, finds the expert whose replica ends the token phase
    although it does not touch the bottleneck (the last case: the bottleneck's own), as the
    rescan twin (which tries every candidate every pass) and the greedy spelled out with
    ``predict`` do: the same plan, exactly."""
    counts_WN, shape, profile, max_replicas, hot = LAST_REMOTE_CASES[case]
    want = plan_mix_rescan(counts_WN, shape, profile, max_replicas, overlap=False)
    assert want.hot == hot == _reference_mix_hot(counts_WN, shape, profile, max_replicas, False)
    for path in PATHS:
        _force_path(monkeypatch, path)
        for width in (1, 8, 10**6):
            got = plan_replicas(counts_WN, shape, profile, max_replicas, False, search_width=width)
            assert got == want, (path, width)


def test_counts_with_sums_takes_its_row_blocks_at_the_default_sizes() -> None:
    """At the module's own block sizes a 1100 x 1100 count matrix (9.7 MB, above the one-pass
    size, 59 rows per block) is summed in row blocks: the plain sums, and its negative count
    found (the other test forces the block sizes)."""
    import mixmoe.placement.cost_model as cost_model
    import mixmoe.placement.counts as counts_mod

    W = 1100
    shape = LayerShape(8, 8, 1, W, 2)
    C_WN = torch.randint(0, 1000, (W, W), generator=torch.Generator().manual_seed(5))
    assert 8 * C_WN.numel() > counts_mod._ONE_PASS_BYTES
    assert counts_mod._BLOCK_BYTES // (8 * W) < W
    C, colsum_N, rowsum_W = cost_model.counts_with_sums(C_WN, shape)
    assert torch.equal(colsum_N, C_WN.sum(0)) and torch.equal(rowsum_W, C_WN.sum(1))
    C_WN[W - 1, 7] = -1
    with pytest.raises(ValueError, match=rf"counts_WN\[{W - 1}\]\[7\] = -1 is negative"):
        cost_model.counts_with_sums(C_WN, shape)


def test_counts_with_sums_is_one_checked_pass() -> None:
    """Row blocks (forced small) give the plain sums; a negative count in any block is found."""
    import mixmoe.placement.cost_model as cost_model
    import mixmoe.placement.counts as counts_mod

    gen = torch.Generator().manual_seed(3)
    saved = counts_mod._BLOCK_BYTES, counts_mod._ONE_PASS_BYTES
    for W, E in ((1, 5), (7, 3), (40, 2), (33, 8)):
        shape = LayerShape(8, 8, E, W, 2)
        C_WN = torch.randint(0, 1000, (W, W * E), generator=gen)
        for block_bytes in (1, 8 * W * E * 3, 1 << 20):  # one row, three rows, one block
            counts_mod._BLOCK_BYTES, counts_mod._ONE_PASS_BYTES = block_bytes, 0
            try:
                C, colsum_N, rowsum_W = cost_model.counts_with_sums(C_WN, shape)
                assert torch.equal(C, C_WN) and C.dtype == torch.int64
                assert torch.equal(colsum_N, C_WN.sum(0)) and torch.equal(rowsum_W, C_WN.sum(1))
                big = C_WN.clone()  # counts >= 2**31 have a negative int32 word: still valid
                big[0, 0], big[W - 1, W * E - 1] = 2**31 + 5, 2**40 + 2**31
                _, colsum_N, rowsum_W = cost_model.counts_with_sums(big, shape)
                assert torch.equal(colsum_N, big.sum(0)) and torch.equal(rowsum_W, big.sum(1))
                bad = C_WN.clone()
                s, g = W - 1, W * E // 2
                bad[s, g] = -2
                with pytest.raises(ValueError, match=rf"counts_WN\[{s}\]\[{g}\] = -2 is negative"):
                    cost_model.counts_with_sums(bad, shape)
            finally:
                counts_mod._BLOCK_BYTES, counts_mod._ONE_PASS_BYTES = saved


@pytest.mark.parametrize("W, E", [(4, 2), (2, 1024), (32, 64)])  # list, host and W*N > LIST_LIMIT
@pytest.mark.parametrize("remote", [0, 1])
def test_plan_replicas_baseline_prices_the_token_phase_only_when_a_row_leaves(W, E, remote) -> None:
    """The baseline of ``plan_replicas`` is the no-replica prediction of the independent list model:
    with every row at home it has no token phase (no all-to-all latency); a single remote row
    brings the four all-to-alls in on every rank."""
    C_WN = torch.zeros(W, W * E, dtype=torch.int64)
    for s in range(W):
        C_WN[s, s * E] = 100 + s  # each rank's rows go to its own first expert
    C_WN[0, E] += remote  # and, with remote = 1, exactly one row to rank 1's first expert
    shape = LayerShape(64, 256, E, W, 2)
    for profile in (GPU_PROFILE, CPU_PROFILE):
        for overlap in (True, False):
            plan = plan_replicas(C_WN, shape, profile, 4, overlap)
            assert plan.baseline == predict(C_WN.tolist(), {}, shape, profile, overlap)
        # without overlap every rank pays the 4 all-to-all latencies once any row leaves
        comm_s = plan.baseline.comm_s
        assert (min(comm_s) >= 4 * profile.link_latency) == bool(remote) == (max(comm_s) > 0)


PLANNERS = {
    "mix": lambda C, shape: plan_replicas(C, shape, CPU_PROFILE, 4),
    "none": lambda C, shape: plan_none(C, shape, CPU_PROFILE),
    "shadow": lambda C, shape: plan_shadow(C, shape, CPU_PROFILE),
}


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize("E", [1024, 2])  # W * N above LIST_LIMIT (tensor forms), then below
def test_planners_refuse_counts_too_large_for_exact_arithmetic(planner: str, E: int) -> None:
    """Each planner's exactness bound is 2 * (rows routed) < 2**53 (a row is counted at its
    source and where it is computed): one row below the edge plans, at the edge it raises."""
    W = 2
    shape = LayerShape(1, 1, E, W, 2)
    C_WN = torch.zeros(W, W * E, dtype=torch.int64)
    C_WN[0, 0] = 2**52 - 1
    plan = PLANNERS[planner](C_WN, shape)
    assert plan.hot == () and plan.baseline.rows[0] == 2**52 - 1
    C_WN[0, 0] = 2**52
    with pytest.raises(ValueError, match="too large"):
        PLANNERS[planner](C_WN, shape)
    with pytest.raises(ValueError, match="too large"):  # the nested-list input: the same bound
        PLANNERS[planner](C_WN.tolist(), shape)


def test_plan_is_frozen_and_shows_its_public_fields() -> None:
    """A plan is shared by every layer of a step and read by the dispatch on every rank: it is
    immutable, and its repr (logs, errors) shows the public fields, not the lookup caches."""
    shape = LayerShape(4, 8, experts_per_rank=1, world_size=2, bytes_per_element=2)
    plan = plan_none([[3, 1], [0, 2]], shape, CPU_PROFILE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.hot = (0,)  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(plan) if f.init] == [
        "hot",
        "replicas",
        "prediction",
        "baseline",
        "shares",
        "relay",
        "ranges",
        "kept",
    ]
    assert repr(plan).startswith("Plan(hot=(), replicas=(), prediction=Prediction(")
    assert "_holders" not in repr(plan) and "_shares" not in repr(plan)


@pytest.mark.parametrize(("W", "E"), [(4, 2), (64, 8)])
def test_candidates_given_the_counted_counts_plan_the_same(W: int, E: int) -> None:
    """``counted=`` (``plan_mix`` checks and sums the counts once) changes nothing: the same
    plans as from the raw counts, on the list path (small) and the tensor path (W = 64)."""
    from mixmoe.placement.counts import counts_with_sums

    shape = LayerShape(256, 512, E, W, 2)
    C_WN = _random_counts(W, W * E, W + E)
    counted = counts_with_sums(C_WN, shape)
    for profile in (GPU_PROFILE, TOKEN_BOUND):
        assert plan_replicas(C_WN, shape, profile, 8, counted=counted) == plan_replicas(
            C_WN.tolist(), shape, profile, 8
        )
        assert plan_shadow(C_WN, shape, profile, counted=counted) == plan_shadow(
            C_WN.tolist(), shape, profile
        )
