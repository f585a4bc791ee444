"""The spread start of the water-fill (``placement/spread.py``) and its use by ``plan_mix``.

``spread_start`` is checked against the rules its docstring states, written here again from the
definitions (holders per expert, slot budget, owner excluded, least-loaded first, determinism);
``plan_mix`` keeps the spread fill only when it lowers the predicted step, and on a case where the
one-helper-at-a-time fill stops early (zipf:1.5 at W = 16, the seeds' shape on an IB-like link)
the spread start is what lowers it: a planted no-op start gives the higher step back.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import HardwareProfile, LayerShape
from mixmoe.placement import planner as planner_module
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import BLOCK_SIZE, plan_mix, replica_slots
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.spread import spread_start
from mixmoe.simulate.routing import counts_source

IB = HardwareProfile("ib-like", 593e12, 40e9, 30e-6)  # h100-ib's figures


def _counts(W: int, E: int, seed: int, skew: float) -> torch.Tensor:
    """counts_WN: 512 rows per rank, expert popularity ~ rank**-skew (expert ids shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    N = W * E
    weights = torch.arange(1, N + 1, dtype=torch.float64) ** -skew
    weights = weights[torch.randperm(N, generator=gen)]
    draws = torch.multinomial(weights.expand(W, N), 512, replacement=True, generator=gen)
    return torch.zeros(W, N, dtype=torch.int64).scatter_add_(1, draws, torch.ones_like(draws))


@settings(max_examples=60, deadline=None)
@given(
    W=st.integers(2, 12),
    E=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    skew=st.floats(0.0, 2.5),
    slots=st.integers(0, 6),
)
def test_spread_start_rules(W: int, E: int, seed: int, skew: float, slots: int) -> None:
    C = _counts(W, E, seed, skew)
    colsum = C.sum(0)
    start = spread_start(C, colsum, E, slots)
    assert start == spread_start(C.clone(), colsum.clone(), E, slots)  # a function of the counts
    mean = int(colsum.sum()) / W
    held = [0] * W
    for g, holders in start.items():
        assert int(colsum[g]) > mean, f"expert {g} is not heavier than a rank's mean"
        assert list(holders) == sorted(set(holders)), "holders ascending and distinct"
        assert g // E not in holders, "the owner is never its own holder"
        want = min(W - 1, math.ceil(int(colsum[g]) / int(mean)) - 1)
        assert 1 <= len(holders) <= want
        for r in holders:
            held[r] += 1
    assert max(held) <= max(slots, 0), "the replica budget per rank"
    if slots == 0:
        assert start == {}


def test_spread_start_least_loaded_first() -> None:
    """One heavy expert on rank 0 (W = 6, one expert per rank): 300 of 360 rows, mean 60, so
    ceil(300 / 60) - 1 = 4 holders: the 4 least-loaded ranks by rows received as owner (ranks
    1-5 own 10, 40, 5, 5, 0 rows; ties by rank), never the owner; rank 2 (40 rows) left out."""
    W, E = 6, 1
    C = torch.zeros(W, W, dtype=torch.int64)
    C[:, 0] = 50
    C[0, 1:] = torch.tensor([10, 40, 5, 5, 0])
    assert spread_start(C, C.sum(0), E, slots=8) == {0: (1, 3, 4, 5)}
    assert spread_start(C, C.sum(0), E, slots=1) == {0: (1, 3, 4, 5)}


def test_spread_start_empty_cases() -> None:
    C = torch.full((4, 8), 3, dtype=torch.int64)  # uniform: no expert above the mean
    assert spread_start(C, C.sum(0), 2, 8) == {}
    Z = torch.zeros(4, 8, dtype=torch.int64)
    assert spread_start(Z, Z.sum(0), 2, 8) == {}


def _seeds_shape(W: int) -> LayerShape:
    return LayerShape(
        model_dim=1024, hidden_dim=4096, experts_per_rank=4, world_size=W, bytes_per_element=2
    )


@pytest.mark.parametrize(
    ("fill", "W", "routing"), [("moves", 16, "zipf:1.5"), ("level", 256, "zipf:2.0")]
)
def test_plan_mix_uses_the_spread_start(fill, W, routing, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fills from the candidates stop above 5% over their level (seed 0: the move-by-move
    fill at zipf:1.5, W = 16; the batched one at zipf:2.0, W = 256, ``bench balance``'s counts);
    the spread fill lowers the step. A planted no-op start must give a higher step back. The
    thinned starts are off in both plans: in these cases the fills from them, which run last,
    reach a lower step still (``test_placement_thinned.py``), which would hide the spread's."""
    shape, profile = _seeds_shape(W), IB
    if fill == "moves":
        gen = torch.Generator().manual_seed(0)
        C = synthetic_counts(RoutingSpec.parse(routing), W, 8192, 2, 4 * W, gen)
    else:
        (C,) = counts_source(routing, W, 4 * W, 8192, 2, seed=0)
        profile = load_profile("h100-ib")
    monkeypatch.setattr(
        planner_module, "planned", lambda *a: None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)
    monkeypatch.setattr(planner_module, "thinned_starts", lambda *a: [])
    with_spread = plan_mix(C, shape, profile, 4, fill=fill)
    monkeypatch.setattr(planner_module, "spread_start", lambda *a, **k: {})
    without = plan_mix(C, shape, profile, 4, fill=fill)
    assert with_spread.prediction.step_s < 0.995 * without.prediction.step_s
    for plan in (with_spread, without):
        plan.check_shares(C, shape.experts_per_rank, BLOCK_SIZE)
        held = [0] * W
        for _, holders in plan.replicas:
            for r in holders:
                held[r] += 1
        assert max(held) <= replica_slots(4, shape.experts_per_rank)


@settings(max_examples=25, deadline=None)
@given(W=st.integers(2, 12), seed=st.integers(0, 10_000), skew=st.floats(0.8, 2.5))
def test_plan_mix_never_worse_for_the_spread(W: int, seed: int, skew: float) -> None:
    """The spread fill is kept only when it lowers the prediction: with it the plan is never
    predicted slower than without it (the planner's other guarantees hold either way)."""
    C = _counts(W, 4, seed, skew)
    shape = _seeds_shape(W)
    plan = plan_mix(C, shape, IB, 4)
    saved, compiled = planner_module.spread_start, planner_module.planned
    planner_module.spread_start = lambda *a, **k: {}
    planner_module.planned = lambda *a: (
        None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)
    try:
        base = plan_mix(C, shape, IB, 4)
    finally:
        planner_module.spread_start, planner_module.planned = saved, compiled
    assert plan.prediction.step_s <= base.prediction.step_s
    assert isinstance(plan, Plan)
    plan.check_shares(C, 4, BLOCK_SIZE)


@pytest.mark.parametrize("E", [1, 4])
def test_plan_mix_plans_fewer_rows_than_ranks(E: int) -> None:
    """W = 8 with 1..7 rows in all on one expert: the mean is below one row, ``int(mean)`` (the
    holder count's divisor) would be 0; plan_mix reaches the spread start with such counts and
    must plan them (it raised ZeroDivisionError). The spread start is empty."""
    W = 8
    shape = LayerShape(1024, 4096, E, W, 2)
    reached = []
    saved, compiled = planner_module.spread_start, planner_module.planned
    planner_module.spread_start = lambda *a: reached.append(a) or saved(*a)
    planner_module.planned = lambda *a: (
        None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)
    try:
        for rows in range(1, W):
            C = torch.zeros(W, W * E, dtype=torch.int64)
            C[0, 0] = rows
            assert spread_start(C, C.sum(0), E, 8) == {}
            plan = plan_mix(C, shape, IB, 4)
            plan.check_shares(C, E, BLOCK_SIZE)
    finally:
        planner_module.spread_start, planner_module.planned = saved, compiled
    assert reached


def test_spread_start_compares_rows_with_the_mean_exactly() -> None:
    """An expert one row above a mean of 2**24 + 0.5 rows is heavier than the mean (an int64
    tensor compared with the float mean in float32 would round both to 2**24: not heavier)."""
    C = torch.tensor([[2**24, 2**23], [1, 2**23]], dtype=torch.int64)
    assert spread_start(C, C.sum(0), 1, 8) == {0: (1,)}
