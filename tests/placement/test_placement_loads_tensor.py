"""The planner's tensor paths and closures against their list twins: ``plan_pricing`` /
``plan_loads`` on tensors (``placement.loads_tensor``, above ``LIST_PRICING_W`` ranks) against
the list code (at or below it): the same float64 aggregates bit for bit and the same rounds, on
random plans with holders, ranges, kept holders, empty holder lists, with and without the relay;
``near_relay`` against ``relay_degrees``; ``cut_ranges_many``'s batched cuts against
``cut_ranges`` (above ``LIST_CUT_W``); ``StepModel.seconds_fn`` against ``rank_seconds``; ``shadow_hot``'s tensor search against
``plan_shadow_lists``; across nodes, ranged plans against their expansion into share entries, and the replica
rule's crossings from block sums against the [W, N] masks.

Legend: W ranks, E experts per rank, N = W*E experts, C[s][g] = rows s routes to g.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixmoe.placement.cost_model as cost_model
import mixmoe.placement.ranges as ranges_module
import mixmoe.placement.shadow as shadow_module
from mixmoe.placement import CPU_PROFILE, GPU_PROFILE
from mixmoe.placement.cost_model import (
    LayerShape,
    Prediction,
    StepModel,
    baseline_loads,
    plan_loads,
    plan_pricing,
)
from mixmoe.placement.loads_tensor import inter_node_loads_tensor
from mixmoe.placement.plan import Plan
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.ranges import cut_ranges, cut_ranges_many
from mixmoe.placement.relay import near_relay, relay_degrees
from mixmoe.placement.shadow import plan_shadow
from mixmoe.reference.planner import plan_shadow_lists

P = Prediction((), (), (), (), (), 0.0)


@st.composite
def _plans(draw):
    """(C_WN, E, plan): random counts (zeros included), random hot experts and holders (some
    hot expert with no holder), kept holders with random local rows below their count, and
    helpers with random amounts (not necessarily whole blocks: the arithmetic takes any)."""
    W = draw(st.integers(2, 12))
    E = draw(st.integers(1, 3))
    N = W * E
    gen = torch.Generator().manual_seed(draw(st.integers(0, 10**6)))
    C = torch.randint(0, 200, (W, N), generator=gen)
    C[torch.rand(W, N, generator=gen) < 0.3] = 0
    hot = sorted(draw(st.sets(st.integers(0, N - 1), min_size=0, max_size=4)))
    replicas, ranges, kept = [], [], []
    for g in hot:
        others = [r for r in range(W) if r != g // E]
        holders = sorted(draw(st.sets(st.sampled_from(others), max_size=len(others))))
        replicas.append((g, tuple(holders)))
        keep = {y: draw(st.integers(0, int(C[y, g]) - 1)) for y in holders
                if C[y, g] and draw(st.booleans())}  # fmt: skip
        if keep:
            kept.append((g, tuple(sorted(keep.items()))))
        helpers = [y for y in draw(st.permutations(holders)) if y not in keep]
        amounts = tuple((y, draw(st.integers(1, 300))) for y in helpers[: draw(st.integers(0, 3))])
        if amounts:
            ranges.append((g, amounts))
    relay = draw(st.booleans())
    plan = Plan(tuple(g for g, h in replicas if h), tuple((g, h) for g, h in replicas if h), P,
                P, relay=relay, ranges=tuple(ranges), kept=tuple(kept))  # fmt: skip
    return C, E, plan, replicas


def _both(monkeypatch, fn):
    """fn() on the list code, then on tensors (the Python: the compiled pricing off, its own
    twin tests in test_native_pricing.py)."""
    monkeypatch.setenv("MIXMOE_NATIVE", "0")
    monkeypatch.setattr(cost_model, "LIST_PRICING_W", 10**9)
    lists = fn()
    monkeypatch.setattr(cost_model, "LIST_PRICING_W", 0)
    return lists, fn()


@settings(max_examples=150, deadline=None)
@given(_plans(), st.booleans())
def test_tensor_pricing_equals_the_list_code_bit_for_bit(case, with_base) -> None:
    C, E, plan, replicas = case
    base = baseline_loads(C, E)[0] if with_base else None
    mp = pytest.MonkeyPatch()
    try:
        (want, want_rounds), (got, got_rounds) = _both(
            mp, lambda: plan_pricing(C, plan, E, base_4W=base)
        )
        want_loads, got_loads = _both(mp, lambda: plan_loads(C, replicas, E, base_4W=base))
    finally:
        mp.undo()
    assert got.dtype == want.dtype == torch.float64
    assert got.tolist() == want.tolist()  # floats compared exactly: == on every entry
    assert got_rounds == want_rounds
    assert got_loads.tolist() == want_loads.tolist()
    # the column sums passed in (what plan_mix has) change nothing
    mp.setenv("MIXMOE_NATIVE", "0")
    mp.setattr(cost_model, "LIST_PRICING_W", 0)
    try:
        summed, summed_rounds = plan_pricing(C, plan, E, base_4W=base, colsum_N=C.sum(0))
    finally:
        mp.undo()
    assert summed.tolist() == want.tolist() and summed_rounds == want_rounds


def test_tensor_pricing_checks_relay_holders_as_the_list_code(monkeypatch) -> None:
    """A relay whose holders include the owner is refused on both paths."""
    C = torch.randint(1, 9, (4, 4))
    bad = Plan((0,), ((0, (1, 2)),), P, P, relay=True)
    object.__setattr__(bad, "replicas", ((0, (0, 2)),))  # past Plan's own check
    for w in (10**9, 0):
        monkeypatch.setattr(cost_model, "LIST_PRICING_W", w)
        with pytest.raises(ValueError, match="exclude owner"):
            plan_pricing(C, bad, 1)


@pytest.mark.parametrize("k", [1, 2, 3, 7, 64, 1023])
def test_near_relay_equals_relay_degrees(k: int) -> None:
    owner = 5
    holders = [h for h in range(k + 1) if h != owner][:k]
    degrees, rounds = relay_degrees(owner, holders)
    copies, got_rounds = near_relay(owner, holders)
    assert got_rounds == rounds
    assert degrees[owner] == 1.0
    assert all(degrees[h] == copies for h in holders)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([1, 4, 16, 64]), st.integers(1, 12))
def test_batched_cuts_equal_cut_ranges_one_at_a_time(seed, blk, helpers) -> None:
    """``cut_ranges_many``'s tensor path (``LIST_CUT_W`` = 0) against ``cut_ranges`` expert by
    expert: amounts of half blocks and odd sizes (cuts tied between two allowed positions, cuts
    rounded back below the previous one), zero and tiny segments, kept holders, empty
    amounts."""
    gen = torch.Generator().manual_seed(seed)
    W, E = (
        int(torch.randint(2, 20, (1,), generator=gen)),
        int(torch.randint(1, 3, (1,), generator=gen)),
    )
    C = torch.randint(0, 3 * blk, (W, W * E), generator=gen)
    C[torch.rand(W, W * E, generator=gen) < 0.3] = 0
    items, kept = [], {}
    for g in torch.randperm(W * E, generator=gen)[
        : int(torch.randint(1, 6, (1,), generator=gen))
    ].tolist():
        others = [r for r in range(W) if r != g // E]
        holders = sorted(
            torch.tensor(others)[torch.rand(len(others), generator=gen) < 0.5].tolist()
        )
        keep = {y: int(torch.randint(0, int(C[y, g]), (1,), generator=gen)) for y in holders
                if C[y, g] and bool(torch.rand(1, generator=gen) < 0.3)}  # fmt: skip
        if keep:
            kept[g] = keep
        sizes = [max(1, blk // 2), blk, 1, 3 * blk // 2 + 1]
        amounts = [(y, sizes[int(torch.randint(0, 4, (1,), generator=gen))])
                   for y in holders[:helpers]]  # fmt: skip
        items.append((g, holders, amounts))
    want = [cut_ranges(C[:, g].tolist(), g // E, h, a, blk, kept.get(g)) for g, h, a in items]
    mp = pytest.MonkeyPatch()
    mp.setattr(ranges_module, "LIST_CUT_W", 0)
    try:
        assert cut_ranges_many(C, items, E, blk, kept) == want
    finally:
        mp.undo()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 10**7), min_size=4, max_size=4),
    st.booleans(),
    st.integers(0, 5),
    st.booleans(),
    st.sampled_from([0.0, 1.3e-7]),
    st.sampled_from([0.0, 2.5e-5]),
)
def test_seconds_fn_equals_rank_seconds_bit_for_bit(
    loads, any_remote, rounds, overlap, row_s, rep_s
) -> None:
    """``prediction_lists``' closure and ``rank_seconds`` give the same pair of floats (fixed
    costs on and off, overlap on and off, no rounds or several)."""
    profile = HardwareProfile(
        "p", 3.7e14, 4.1e10, 2.9e-5, step_fixed_s=row_s * 1e3, row_overhead_s=row_s,
        replica_fixed_s=rep_s,
    )  # fmt: skip
    model = StepModel(LayerShape(1024, 4096, 4, 8, 2, 3), profile, overlap)
    rows, local, remote, replica = loads
    local = min(local, rows)
    want = model.rank_seconds(rows, local, remote, replica, any_remote, rounds)
    assert model.seconds_fn(any_remote, rounds)(rows, local, remote, replica) == want


def test_shadow_tensor_search_equals_the_list_twin(monkeypatch) -> None:
    """``shadow_hot``'s tensor search (``LIST_SHADOW_W`` = 0) against the list twin
    (``plan_shadow_lists``) on skewed random counts that shadow several experts, ties
    included (small counts). The compiled search off (``MIXMOE_NATIVE=0``: shadow_hot would
    run it first; ``test_native_candidates`` compares it with both Python searches)."""
    monkeypatch.setattr(shadow_module, "LIST_SHADOW_W", 0)
    monkeypatch.setenv("MIXMOE_NATIVE", "0")
    shadowed = 0
    for seed in range(24):
        gen = torch.Generator().manual_seed(seed)
        W, E = 2 + seed % 7, 1 + seed % 4
        top = (3, 40, 2000)[seed % 3]
        counts_WN = torch.randint(0, top + 1, (W, W * E), generator=gen)
        counts_WN[:, seed % (W * E)] += 10 * top  # a hot expert
        counts_WN[:, (3 * seed + 1) % (W * E)] += 5 * top  # and a warm one
        shape = LayerShape(64, 256, E, W, 2)
        for profile in (GPU_PROFILE, CPU_PROFILE):
            want = plan_shadow_lists(counts_WN.tolist(), shape, profile)
            assert plan_shadow(counts_WN, shape, profile) == want, (seed, profile.name)
            shadowed += len(want.hot)
    assert shadowed > 24  # the cases really shadow


@settings(max_examples=120, deadline=None)
@given(_plans(), st.sampled_from([1, 2, 3, 5]), st.sampled_from([10**9, 0]))
def test_range_crossings_equal_the_expanded_share_loop(case, per_node, list_w) -> None:
    """Across nodes, a plan with ranges and kept holders prices as its expansion into share
    entries (``Plan.expanded``: the share loop, segment by segment): the closed-form loads and
    the crossings of ``range_crossing_tensor``, on both the list and the tensor loads."""
    C, E, plan, _ = case
    W = C.shape[0]
    # the amounts made valid: each expert's ranges capped at its stream (cut_ranges, 1-row
    # blocks: every cut allowed)
    kept = {g: dict(k) for g, k in plan.kept}
    ranges = tuple(
        (g, cut)
        for g, amounts in plan.ranges
        if (cut := cut_ranges(C[:, g].tolist(), g // E, plan.holders(g), amounts, 1, kept.get(g)))
    )
    plan = Plan(plan.hot, plan.replicas, P, P, relay=plan.relay, ranges=ranges, kept=plan.kept)
    profile = HardwareProfile("nodes", 1e12, 2e9, 1e-5, ranks_per_node=per_node,
                              inter_node_bandwidth=5e8, inter_node_latency=3e-5)  # fmt: skip
    mp = pytest.MonkeyPatch()
    mp.setattr(cost_model, "LIST_PRICING_W", list_w)
    try:
        want, want_rounds = plan_pricing(C, plan.expanded(C, E), E, profile)
        got, got_rounds = plan_pricing(C, plan, E, profile)
    finally:
        mp.undo()
    assert got.shape == (6, W)
    assert got.tolist() == want.tolist() and got_rounds == want_rounds


@settings(max_examples=80, deadline=None)
@given(_plans(), st.integers(1, 6))
def test_inter_node_block_sums_equal_the_masks(case, per_node) -> None:
    """The replica rule's node crossings from block reductions (whole nodes) equal the [W, N]
    masks' (``_inter_node_loads_masks``), remote rows and flat copies."""
    C, E, plan, _ = case
    W = C.shape[0]
    if W % per_node or per_node >= W:
        per_node = 1  # single-rank nodes: every pair crosses
    replicas = [(g, tuple(h)) for g, h in plan.replicas]
    want = cost_model._inter_node_loads_masks(C, plan, E, per_node)
    assert inter_node_loads_tensor(C, replicas, E, per_node) == want
