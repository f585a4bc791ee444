"""The compiled planner with a profile's topology (``ranks_per_node``): ``plan_mix`` compiled whole
(``native/plan_mix.cpp`` with ``native/pricing_nodes.cpp``) against its slow twin, the Python
``plan_mix`` (``MIXMOE_NATIVE=0``), the same ``Plan`` field by field, floats bit for bit; and the
6-row pricing pieces (``native_nodes``) against ``cost_model.plan_pricing`` and
``StepModel.prediction_W`` with the profile's nodes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from _planner_cases import random_plan_case
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_planner import DEEPSEEK, SEEDS, _both, _canon, _shape

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import GPU_PROFILE, LayerShape, plan_mix, plan_none
from mixmoe.placement.cost_model import Prediction, plan_pricing, reprice, step_model
from mixmoe.placement.native_nodes import plan_loads_nodes, prediction_nodes
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import replica_slots
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.refit import refit_plan
from mixmoe.placement.replica_search import plan_replicas
from mixmoe.simulate.routing import counts_source
from mixmoe.simulate.workloads import DEFAULT_WORKLOADS

NVLINK_IB = load_profile("h100-nvlink-ib")  # 8 ranks per node
FOUR = dataclasses.replace(NVLINK_IB, ranks_per_node=4)
THREE_FIXED = dataclasses.replace(  # nodes that do not divide W; the fixed costs on
    NVLINK_IB, ranks_per_node=3, row_overhead_s=1e-8, replica_fixed_s=2e-5, step_fixed_s=1e-4
)
SLOW_IB = dataclasses.replace(GPU_PROFILE, ranks_per_node=2, inter_node_bandwidth=5e9,
                              inter_node_latency=5e-5)  # fmt: skip
_NONE = Prediction((), (), (), (), (), float("inf"))


def _random_plan(rng: random.Random, C: torch.Tensor, E: int) -> Plan:
    """A plan without shares: random holders (relayed or not), helpers' ranges that fit in each
    expert's stream, kept holders keeping part of their own rows."""
    W, N = C.shape
    hot = sorted(rng.sample(range(N), rng.randint(0, min(N, 6))))
    replicas, ranges, kept = [], [], []
    for g in hot:
        o = g // E
        holders = sorted(rng.sample([r for r in range(W) if r != o], rng.randint(1, W - 1)))
        replicas.append((g, tuple(holders)))
        keep = [y for y in holders if C[y, g] > 0 and rng.random() < 0.3]
        if keep:
            kept.append((g, tuple((y, rng.randrange(int(C[y, g]))) for y in keep)))
        rest = {y: int(C[y, g]) - n for y, n in kept[-1][1]} if keep else {}
        stream = sum(int(C[s, g]) for s in range(W) if s != o and s not in holders)
        stream += sum(rest.values()) + int(C[o, g])
        helpers = [y for y in holders if rng.random() < 0.6]
        entries = []
        for y in helpers:
            if stream < 1:
                break
            n = rng.randint(1, stream)  # rows > 0 (Plan's check), within the stream
            stream -= n
            entries.append((y, n))
        if entries and rng.random() < 0.8:
            ranges.append((g, tuple(entries)))
    relay = rng.random() < 0.7
    return Plan(tuple(hot), tuple(replicas), _NONE, _NONE, relay=relay, ranges=tuple(ranges),
                kept=tuple(kept))  # fmt: skip


def _hex(t: torch.Tensor) -> list[str]:
    return [x.hex() for x in t.reshape(-1).tolist()]


def test_pricing_pieces_equal_the_python_on_random_plans(monkeypatch):
    """``plan_loads_nodes`` == ``plan_pricing``'s Python (6 rows, rounds) and
    ``prediction_nodes`` == ``prediction_W``: random counts (zeros, an empty rank, one hot
    expert), random plans with ranges and kept holders, nodes that divide W and not, one node
    holding every rank."""
    rng = random.Random(3)
    profiles = [NVLINK_IB, FOUR, THREE_FIXED, SLOW_IB]
    seen = {"ranges": 0, "kept": 0, "relay": 0}
    for case in range(150):
        W, E = rng.randint(2, 12), rng.choice([1, 2, 4])
        C = torch.randint(0, 400, (W, W * E), generator=torch.Generator().manual_seed(case))
        if case % 3 == 1:
            C[rng.randrange(W)] = 0
            C[:, rng.randrange(W * E)] = 0
        elif case % 3 == 2:
            C[:, rng.randrange(W * E)] += rng.randrange(1000, 9000)
        profile = rng.choice(profiles)
        plan = _random_plan(rng, C, E)
        seen["ranges"] += bool(plan.ranges)
        seen["kept"] += bool(plan.kept)
        seen["relay"] += plan.relay and bool(plan.replicas)
        with monkeypatch.context() as python:  # plan_pricing's Python (it runs compiled too)
            python.setenv("MIXMOE_NATIVE", "0")
            want, want_rounds = plan_pricing(C, plan, E, profile)
        got = plan_loads_nodes(C, plan, E, profile.ranks_per_node)
        assert got is not None
        assert (_hex(got[0]), got[1]) == (_hex(want), want_rounds), (case, W, E, plan)
        shape = LayerShape(rng.choice([64, 1024]), 512, E, W, 2)
        model = step_model(shape, profile, rng.random() < 0.7)
        for rounds in {0, want_rounds}:
            fast = prediction_nodes(model, want, rounds)
            assert _canon(fast) == _canon(model.prediction_W(want, rounds)), (case, rounds)
    assert min(seen.values()) >= 20, seen


@pytest.mark.parametrize("workload", DEFAULT_WORKLOADS)
def test_equals_the_python_plan_on_the_benchmark_workloads(monkeypatch, workload):
    """``bench balance``'s workloads under ``h100-nvlink-ib`` (8 ranks per node) and 4 ranks per
    node, both shapes, W = 8-128."""
    cases = [
        (SEEDS, 4, 8, NVLINK_IB), (SEEDS, 4, 16, FOUR), (SEEDS, 4, 64, NVLINK_IB),
        (SEEDS, 2, 24, THREE_FIXED), (DEEPSEEK, 32, 8, NVLINK_IB), (DEEPSEEK, 8, 16, FOUR),
        (SEEDS, 1, 128, FOUR),
    ]  # fmt: skip
    for i, (dims, E, W, profile) in enumerate(cases):
        shape = _shape(dims, E, W, 3 if dims is DEEPSEEK else 2)
        steps = counts_source(workload, W, W * E, 4096, dims[2], seed=i)
        for counts in steps[:2]:
            fast, slow = _both(monkeypatch, counts, shape, profile, 4)
            assert _canon(fast) == _canon(slow), (workload, W, E, profile.name)


def test_equals_the_python_plan_on_synthetic_routing(monkeypatch):
    """The planner's usual inputs: 8192 tokens, top-2, uniform / zipf / hot routing, W = 8-256."""
    for W, routing, profile in [
        (8, "zipf:2.0", FOUR), (32, "hot:0.3", NVLINK_IB), (64, "zipf:1.2", FOUR),
        (256, "zipf:1.2", NVLINK_IB), (256, "uniform", NVLINK_IB),
    ]:  # fmt: skip
        gen = torch.Generator().manual_seed(W)
        counts = synthetic_counts(RoutingSpec.parse(routing), W, 8192, 2, 4 * W, gen)
        fast, slow = _both(monkeypatch, counts, _shape(SEEDS, 4, W), profile, 4)
        assert _canon(fast) == _canon(slow), (W, routing, profile.name)


def test_equals_the_python_plan_on_random_counts(monkeypatch):
    """Small adversarial counts (zeros, empty ranks, one hot segment, ties) and every knob of
    plan_mix, under nodes of 1-4 ranks."""
    rng = random.Random(11)
    profiles = [NVLINK_IB, FOUR, THREE_FIXED, SLOW_IB, dataclasses.replace(FOUR, ranks_per_node=1)]
    for case in range(100):
        C, shape, budget, kwargs = random_plan_case(rng, case)
        profile = rng.choice(profiles)
        fast, slow = _both(monkeypatch, C, shape, profile, budget, **kwargs)
        assert _canon(fast) == _canon(slow), (case, C.shape, budget, kwargs, profile.ranks_per_node)
        # the guarantee: never predicted slower than a2a (its baseline, priced with the nodes)
        a2a = plan_none(C, shape, profile, overlap=kwargs["overlap"]).prediction
        assert fast.baseline == a2a, case
        assert fast.prediction.step_s <= a2a.step_s, (case, fast.prediction.step_s, a2a.step_s)


def test_never_slower_than_a2a_when_the_repriced_candidate_costs_more(monkeypatch):
    """The source-replica search sees one link; repriced with nodes its replica of expert 4
    (rank 0's 3796 rows) costs more than it saves: 0.46 ms against a2a's 0.36 ms, and the plan
    kept it (found by fuzzing the twins). Both twins now fall back to nothing replicated, and a
    fill from there is kept only when it beats a2a."""
    C = torch.tensor([
        [152, 216, 35, 247, 3796, 160, 140, 30, 38, 286, 35, 159],
        [9, 298, 95, 201, 254, 52, 73, 295, 4, 216, 78, 239],
        [129, 184, 249, 72, 56, 200, 223, 48, 254, 159, 292, 231],
    ])  # fmt: skip
    shape = LayerShape(1024, 512, 4, 3, 2)
    two = dataclasses.replace(NVLINK_IB, ranks_per_node=2)
    a2a = plan_none(C, shape, two, overlap=True).prediction
    source = reprice(C, plan_replicas(C, shape, two, 1, search_width=1),
                     step_model(shape, two, True), two)  # fmt: skip
    assert source.hot and source.prediction.step_s > 1.2 * a2a.step_s  # the trap
    fast, slow = _both(monkeypatch, C, shape, two, 1, search_width=1, block_size=16)
    assert _canon(fast) == _canon(slow)
    assert fast.prediction.step_s <= a2a.step_s


@settings(max_examples=300, deadline=None, derandomize=True)  # the same 300 cases each run
@given(
    W=st.integers(2, 12),
    E=st.integers(1, 4),
    per_node=st.integers(1, 5),
    budget=st.sampled_from([1, 2, 4, 8]),
    overlap=st.booleans(),
    data=st.data(),
)
def test_mix_guarantees_under_nodes(W, E, per_node, budget, overlap, data) -> None:
    """The compiled plan (the twins agree: the tests above) under nodes of 1-5 ranks, counts
    of 0-300 rows and up to two hot cells: never predicted slower than a2a, within the
    replica budget, valid ranges; the same for its fit to other counts (``refit_plan``)."""
    N = W * E
    rows = st.lists(st.lists(st.integers(0, 300), min_size=N, max_size=N), min_size=W, max_size=W)
    C, after = torch.tensor(data.draw(rows)), torch.tensor(data.draw(rows))
    for _ in range(data.draw(st.integers(0, 2))):  # hot cells: one rank's rows of one expert
        s, g = data.draw(st.integers(0, W - 1)), data.draw(st.integers(0, N - 1))
        C[s, g] += data.draw(st.integers(1000, 20000))
    shape = LayerShape(1024, 512, E, W, 2)
    profile = dataclasses.replace(NVLINK_IB, ranks_per_node=per_node)
    plan = plan_mix(C, shape, profile, budget, overlap, block_size=16)
    a2a = plan_none(C, shape, profile, overlap=overlap).prediction
    assert plan.baseline == a2a
    assert plan.prediction.step_s <= a2a.step_s
    slots = replica_slots(budget, E)
    assert all(len(plan.replica_slots(r)) <= slots for r in range(W))
    dataclasses.replace(plan).check_shares(C, E, 16)  # built unchecked: Plan's checks now
    fit = refit_plan(plan, C, after, shape, profile, overlap, 16)
    assert (
        fit.prediction.step_s <= plan_none(after, shape, profile, overlap=overlap).prediction.step_s
    )
    dataclasses.replace(fit).check_shares(after, E, 16)


def test_column_prefixes_shared_by_fills_at_uneven_worlds(monkeypatch):
    """With a topology the plan keeps the prefixes of the columns its plan fields read (each
    fill's plan fields and crossings read them back; ``ColumnPrefix``). W one past a multiple
    of the plan fields' 64-row blocks, or past several: the last block of a column is partial,
    and a later fill copies the rows a prefix holds and reads the rest."""
    for W, routing, profile in [(65, "zipf:1.2", FOUR), (65, "zipf:2.0", THREE_FIXED),
                                (129, "zipf:1.2", NVLINK_IB), (200, "zipf:2.0", FOUR)]:  # fmt: skip
        for seed in range(2):
            gen = torch.Generator().manual_seed(seed)
            counts = synthetic_counts(RoutingSpec.parse(routing), W, 8192, 2, 2 * W, gen,
                                      shuffle_experts=True)  # fmt: skip
            fast, slow = _both(monkeypatch, counts, _shape(SEEDS, 2, W), profile, 4)
            assert _canon(fast) == _canon(slow), (W, routing, profile.name, seed)
            assert fast.ranges, (W, routing)  # the plan fields ran


def test_ranged_fills_win_under_nodes(monkeypatch):
    """The topology's fills are reached: plans with ranges and relayed holders on other nodes
    (4 ranks per node), and the kept fill's plans (one node of 8: its kept holders; kept
    holders across nodes: the pricing test's random plans). A test that cannot reach them
    could not fail on them."""
    seen = {"ranges": 0, "far": 0, "kept": 0}
    cases = [(16, "zipf:2.0", FOUR), (32, "zipf:1.2", FOUR), (16, "hot:0.3", FOUR),
             (64, "zipf:2.0", FOUR), (8, "zipf:2.0", NVLINK_IB), (8, "zipf:1.2", NVLINK_IB)]  # fmt: skip
    for W, routing, profile in cases:
        for seed in range(3):
            gen = torch.Generator().manual_seed(seed)
            counts = synthetic_counts(RoutingSpec.parse(routing), W, 8192, 2, 4 * W, gen)
            fast, slow = _both(monkeypatch, counts, _shape(SEEDS, 4, W), profile, 4)
            assert _canon(fast) == _canon(slow)
            P = profile.ranks_per_node
            seen["ranges"] += bool(fast.ranges)
            seen["kept"] += bool(fast.kept)
            seen["far"] += any(h // P != g // 4 // P for g, hs in fast.replicas for h in hs)
    assert seen["ranges"] >= 3 and seen["far"] >= 3 and seen["kept"] >= 2, seen


@pytest.mark.parametrize("W, profile", [(32, FOUR), (8, NVLINK_IB), (16, None)])
def test_fills_search_on_the_blended_link(monkeypatch, W, profile):
    """The Python planner (``MIXMOE_NATIVE=0``; the compiled one is its twin, above) runs every
    fill on ``StepModel.fill_link``'s one link: the blend of both links when W spans nodes, the
    model's own link on one node or without a topology; each fill's step is priced with the
    model itself (``_fill_step``)."""
    import mixmoe.placement.planner as planner_module

    profile = profile or GPU_PROFILE
    shape = _shape(SEEDS, 4, W)
    model = step_model(shape, profile, True)
    want = model.fill_link(W, profile.ranks_per_node).bw
    assert (want < model.bw) == (profile is FOUR)
    searched, priced = [], []
    fill, step = planner_module._water_fill, planner_module._fill_step

    def water_fill(C, colsum, shape, search, *a, **k):
        searched.append(search.bw)
        return fill(C, colsum, shape, search, *a, **k)

    def fill_step(state, model, *a, **k):
        priced.append(model.bw)
        return step(state, model, *a, **k)

    monkeypatch.setattr(planner_module, "_water_fill", water_fill)
    monkeypatch.setattr(planner_module, "_fill_step", fill_step)
    monkeypatch.setenv("MIXMOE_NATIVE", "0")
    gen = torch.Generator().manual_seed(1)
    plan_mix(synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, 4 * W, gen), shape,
             profile, 4)  # fmt: skip
    assert searched and set(searched) == {want}, (searched, want)
    assert priced and set(priced) == {model.bw}


def test_plan_mix_runs_compiled_with_nodes(monkeypatch):
    """With ``h100-nvlink-ib`` the planner calls the compiled whole, and it plans."""
    calls = []
    real = plan_mix.__globals__["planned"]
    monkeypatch.setattr(
        "mixmoe.placement.planner.planned", lambda *a, **k: calls.append(real(*a, **k))
    )
    gen = torch.Generator().manual_seed(1)
    counts = synthetic_counts(RoutingSpec.parse("zipf:1.2"), 16, 4096, 2, 64, gen)
    plan_mix(counts, _shape(SEEDS, 4, 16), NVLINK_IB, 4)
    assert len(calls) == 1 and calls[0] is not None


def test_the_other_planners_price_compiled_as_in_python(monkeypatch):
    """``plan_none``, ``plan_shadow`` and ``plan_pricing`` (its compiled 6-row path, and its
    Python where the compiled part declines: an owner among its holders, experts past N) equal
    their Python (``MIXMOE_NATIVE=0``) under nodes and on one link, floats bit for bit."""
    from mixmoe.placement import plan_none, plan_shadow

    rng = random.Random(5)
    for case in range(30):
        W, E = rng.choice([2, 5, 9, 16, 40]), rng.choice([1, 2, 4])
        C = torch.randint(0, 300, (W, W * E), generator=torch.Generator().manual_seed(case))
        C[:, rng.randrange(W * E)] += rng.randrange(2000, 9000)  # a hot expert: shadowed
        # nodes, and one link (the compiled 4-row prediction, ``cost_model.prediction_of``)
        profile = rng.choice([NVLINK_IB, FOUR, THREE_FIXED, SLOW_IB, GPU_PROFILE])
        shape = LayerShape(1024, 4096, E, W, 2)
        owner_held = Plan((0,), ((0, (0, W - 1)),), _NONE, _NONE)  # the Python's path
        out_of_range = Plan((W * E,), ((W * E, (0,)),), _NONE, _NONE)  # the Python's error
        fast = [plan_none(C, shape, profile), plan_shadow(C, shape, profile),
                plan_pricing(C, owner_held, E, profile)]  # fmt: skip
        with pytest.raises(IndexError):
            plan_pricing(C, out_of_range, E, profile)
        monkeypatch.setenv("MIXMOE_NATIVE", "0")
        slow = [plan_none(C, shape, profile), plan_shadow(C, shape, profile),
                plan_pricing(C, owner_held, E, profile)]  # fmt: skip
        with pytest.raises(IndexError):
            plan_pricing(C, out_of_range, E, profile)
        monkeypatch.delenv("MIXMOE_NATIVE")
        for a, b in zip(fast[:2], slow[:2], strict=True):
            assert _canon(a.prediction) == _canon(b.prediction), case
            assert _canon(a.baseline) == _canon(b.baseline), case
            assert (a.hot, a.replicas) == (b.hot, b.replicas), case
        assert (_hex(fast[2][0]), fast[2][1]) == (_hex(slow[2][0]), slow[2][1]), case
