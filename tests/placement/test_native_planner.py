"""``plan_mix`` compiled whole (``mixmoe.placement.native_planner``, ``native/plan_mix.cpp``)
against its slow twin, the Python ``plan_mix`` (``MIXMOE_NATIVE=0``: every compiled part off):
the same ``Plan`` field by field, floats bit for bit (compared as hex), on the workloads the
balance benchmark runs and on random adversarial counts; plus where it must not run (the Python
plans, or raises its error).
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch
from _planner_cases import random_plan_case

import mixmoe.dispatch.step_native as step_native
import mixmoe.placement.native_lib as lib
import mixmoe.placement.native_planner as native_planner
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import CPU_PROFILE, GPU_PROFILE, HardwareProfile, LayerShape, plan_mix
from mixmoe.placement.counts import CountSums
from mixmoe.placement.profile_io import load_profile
from mixmoe.simulate.routing import counts_source
from mixmoe.simulate.workloads import DEFAULT_WORKLOADS

IB = HardwareProfile("ib-like", 593e12, 40e9, 30e-6)
FIXED = dataclasses.replace(IB, row_overhead_s=1e-8, replica_fixed_s=2e-5, step_fixed_s=1e-4)
CHEAP_LINK = HardwareProfile("cheap-link", 1e12, 1e13, 1e-9)  # compute-bound: a row costs ~a
SEEDS = (1024, 4096, 2, 2)  # model_dim, hidden_dim, top_k, bytes per element
DEEPSEEK = (2048, 1024, 8, 2)


def _canon(x: object) -> str:
    """A value as text, floats in hex (so equal text is equal bits), dataclasses by field."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(map(_canon, x)) + ")"
    if dataclasses.is_dataclass(x):  # its value: the fields it compares
        fields = [f for f in dataclasses.fields(x) if f.compare]
        return "{" + ",".join(f"{f.name}={_canon(getattr(x, f.name))}" for f in fields) + "}"
    return f"{type(x).__name__}:{x!r}"


def _both(monkeypatch, counts, shape, profile, *args, **kwargs):
    """(compiled plan, Python plan) of the same call; asserts the compiled planner ran."""
    ran = []
    real = native_planner.planned

    def spy(*a, **k):
        plan = real(*a, **k)
        ran.append(plan is not None)
        return plan

    monkeypatch.setattr("mixmoe.placement.planner.planned", spy)
    fast = plan_mix(counts, shape, profile, *args, **kwargs)
    assert ran == [True], "the compiled planner did not run"
    if isinstance(counts, torch.Tensor) and "sums" not in kwargs:  # C's sums given: no pass
        C = counts.to(torch.int64)
        sums = CountSums(C.sum(0), C.sum(1))
        assert repr(plan_mix(counts, shape, profile, *args, sums=sums, **kwargs)) == repr(fast)
        # C stored by columns (the mixed strategy's count exchange): read as it is, the same
        by_column = C.t().contiguous().t()
        assert repr(plan_mix(by_column, shape, profile, *args, **kwargs)) == repr(fast)
        assert ran == [True, True, True]
    # built without Plan's checks (Plan.unchecked): they pass when the plan is rebuilt
    assert dataclasses.replace(fast) == fast
    with monkeypatch.context() as m:
        m.setenv(lib.ENV_OFF, "0")
        slow = plan_mix(counts, shape, profile, *args, **kwargs)
    # packed for the compiled step bookkeeping as step_native packs the fields
    assert fast.packed is not None and fast.packed == step_native._pack(fast)
    assert dataclasses.replace(fast).packed is None and slow.packed is None
    return fast, slow


def _shape(dims: tuple, E: int, W: int, gemms: int = 2) -> LayerShape:
    D, F, _, nbytes = dims
    return LayerShape(D, F, E, W, nbytes, gemms_per_expert=gemms)


def test_the_compiled_planner_is_built_here():
    """CI and every machine with a C++ compiler plan with the compiled planner."""
    assert lib.available(), lib.unavailable_reason()


@pytest.mark.parametrize("workload", DEFAULT_WORKLOADS)
def test_equals_the_python_plan_on_the_benchmark_workloads(monkeypatch, workload):
    """``bench balance``'s workloads (every step of the rotating one), both shapes, W = 2-160,
    the one-link presets a user picks and profiles with fixed costs or a cheap link."""
    cases = [
        (SEEDS, 5, 2, GPU_PROFILE), (SEEDS, 4, 8, load_profile("h100-nvlink")),
        (SEEDS, 4, 64, load_profile("h100-ib")), (SEEDS, 2, 16, CPU_PROFILE),
        (SEEDS, 8, 24, FIXED), (SEEDS, 1, 160, IB), (DEEPSEEK, 32, 8, load_profile("h100-nvlink")),
        (DEEPSEEK, 4, 64, GPU_PROFILE), (SEEDS, 3, 5, CHEAP_LINK),
    ]  # fmt: skip
    for i, (dims, E, W, profile) in enumerate(cases):
        shape = _shape(dims, E, W, 3 if dims is DEEPSEEK else 2)
        steps = counts_source(workload, W, W * E, 4096, dims[2], seed=i)
        for counts in steps[:3]:
            fast, slow = _both(monkeypatch, counts, shape, profile, 4)
            assert _canon(fast) == _canon(slow), (workload, W, E, profile.name)


def test_a_hot_rank_of_many_experts_sheds_them_all(monkeypatch):
    """One rank's 32 experts take half of all rows, about equally (hotrank:0.5): the rank offers
    more than ``OFFERED`` of them a pass while the rows offered fall short of its excess (it
    offered 4 a pass: 24 of the 32 left it over the 6 passes, 0.686 of the baseline's step at
    W = 32 and 0.468 at W = 64, against 0.580 and 0.288 now); both twins alike."""
    for W, most in ((32, 0.60), (64, 0.30)):
        E = 32
        shape = LayerShape(1024, 4096, E, W, 2)
        (C,) = counts_source("hotrank:0.5", W, W * E, 4096, 2, seed=0)
        hot_rank = int(C.sum(0).view(W, E).sum(1).argmax())
        fast, slow = _both(monkeypatch, C, shape, IB, 4)
        assert _canon(fast) == _canon(slow), W
        shed = [g for g, _ in fast.replicas if g // E == hot_rank]
        assert len(shed) == E, (W, len(shed))
        assert fast.prediction.step_s < most * fast.baseline.step_s, W


def test_equals_the_python_plan_on_random_counts(monkeypatch):
    """Small adversarial counts: zeros, empty ranks, one hot segment, ties; every knob of
    plan_mix (budget, search width, block size, overlap, balance)."""
    rng = random.Random(7)
    profiles = [GPU_PROFILE, CPU_PROFILE, FIXED, CHEAP_LINK, IB]
    for case in range(120):
        C, shape, budget, kwargs = random_plan_case(rng, case)
        fast, slow = _both(monkeypatch, C, shape, rng.choice(profiles), budget, **kwargs)
        assert _canon(fast) == _canon(slow), (case, C.shape, budget, kwargs)


def test_where_it_does_not_run_the_python_plans(monkeypatch):
    """Counts as nested lists, ``fill="moves"``: the Python plans (``planned`` not called, or
    None); the plans equal the compiled ones where both apply (a profile with a topology:
    test_native_planner_nodes.py)."""
    gen = torch.Generator().manual_seed(1)
    counts = synthetic_counts(RoutingSpec.parse("zipf:1.2"), 8, 4096, 2, 32, gen)
    shape = _shape(SEEDS, 4, 8)
    assert native_planner.planned(counts.tolist(), shape, GPU_PROFILE, 8, True, 8, 64, True,
                                  (1.02, 1.02, 1.05, 6)) is None  # fmt: skip
    assert plan_mix(counts.tolist(), shape, GPU_PROFILE, 4) == plan_mix(
        counts, shape, GPU_PROFILE, 4
    )
    calls = []
    monkeypatch.setattr("mixmoe.placement.planner.planned", lambda *a, **k: calls.append(1) or None)
    plan_mix(counts, shape, GPU_PROFILE, 4, fill="moves")
    assert calls == []


def test_bad_counts_get_the_python_errors():
    """A negative count, a float tensor, a wrong shape, counts too large for exact arithmetic:
    the same errors as the Python planner's."""
    shape = _shape(SEEDS, 2, 4)
    C = torch.ones(4, 8, dtype=torch.int64)
    C[2, 5] = -3
    with pytest.raises(ValueError, match=r"counts_WN\[2\]\[5\] = -3 is negative"):
        plan_mix(C, shape, GPU_PROFILE, 4)
    with pytest.raises(TypeError, match="must hold integers"):
        plan_mix(torch.ones(4, 8), shape, GPU_PROFILE, 4)
    with pytest.raises(ValueError, match="expected"):
        plan_mix(torch.ones(4, 9, dtype=torch.int64), shape, GPU_PROFILE, 4)
    with pytest.raises(ValueError, match="too large for exact"):
        plan_mix(torch.full((4, 8), 2**50, dtype=torch.int64), shape, GPU_PROFILE, 4)


def test_int32_counts_plan_as_int64(monkeypatch):
    """Counts of another integer type are converted once: the same plan."""
    gen = torch.Generator().manual_seed(2)
    counts = synthetic_counts(RoutingSpec.parse("hot:0.3"), 8, 4096, 2, 32, gen)
    shape = _shape(SEEDS, 4, 8)
    fast, slow = _both(monkeypatch, counts.to(torch.int32), shape, GPU_PROFILE, 4)
    assert _canon(fast) == _canon(slow) == _canon(plan_mix(counts, shape, GPU_PROFILE, 4))


def test_equals_the_python_plan_when_no_row_is_remote_at_the_start(monkeypatch):
    """Every rank routes only to its own experts, one much more: the fills start without the
    token collectives and their moves turn rows remote (``_fill_step`` prices the fill under
    the flag its loads then have)."""
    rng = random.Random(1)
    filled = 0
    for _ in range(40):
        W, E = rng.randint(2, 8), rng.choice([1, 2])
        C = torch.zeros(W, W * E, dtype=torch.int64)
        for r in range(W):
            C[r, r * E : (r + 1) * E] = torch.tensor([rng.randrange(0, 3000) for _ in range(E)])
        C[0, 0] += rng.randrange(5000, 50000)
        shape = LayerShape(rng.choice([256, 1024]), 1024, E, W, 2)
        profile = rng.choice([GPU_PROFILE, CPU_PROFILE, IB])
        fast, slow = _both(monkeypatch, C, shape, profile, 4)
        assert _canon(fast) == _canon(slow), (W, E, profile.name)
        filled += bool(fast.ranges)
    assert filled >= 5


def test_equals_the_python_plan_when_shadow_fills_the_budget(monkeypatch):
    """FasterMoE's rule shadows exactly ``replica_slots`` experts (8): its plan is a candidate
    (the budget allows it) and wins without balancing (its replicas differ from the source
    replicas': a rank without rows of the expert holds one too)."""
    rng = random.Random(1)
    found = 0
    for _ in range(400):
        W = rng.choice([9, 12, 16])
        C = torch.randint(
            0, 50, (W, W), generator=torch.Generator().manual_seed(rng.randrange(10**6))
        )
        for g in rng.sample(range(W), 8):
            C[:, g] += rng.randrange(200, 2000)
            C[rng.randrange(W), g] = 0  # a source without rows: no source replica there
        shape = LayerShape(rng.choice([64, 128, 256]), 256, 1, W, 2)
        profile = rng.choice([GPU_PROFILE, IB, CPU_PROFILE])
        fast, slow = _both(monkeypatch, C, shape, profile, 4, balance=False)
        assert _canon(fast) == _canon(slow)
        found += len(fast.hot) == 8 and len(fast.replicas[0][1]) == W - 1
        if found == 3:
            break
    assert found == 3


def test_threads_planning_at_once_get_the_sequential_plans():
    """The compiled fill reuses one state per thread, and the Python side one set of output
    arrays per thread (``native_planner._output``): plans made on several threads at once, of
    different sizes (a reused state of another size), equal the plans made one after another."""
    cases = []
    for i, (routing, W) in enumerate([("zipf:1.2", 64), ("hot:0.3", 16), ("zipf:2.0", 40)]):
        gen = torch.Generator().manual_seed(10 + i)
        counts = synthetic_counts(RoutingSpec.parse(routing), W, 4096, 2, 4 * W, gen)
        cases.append((counts, _shape(SEEDS, 4, W)))
    alone = [_canon(plan_mix(C, shape, GPU_PROFILE, 4)) for C, shape in cases]
    results: dict[tuple[int, int], tuple[int, str]] = {}

    def plan_all(thread: int) -> None:
        for round_ in range(12):  # each thread goes through the cases in its own order
            k = (thread + round_) % len(cases)
            C, shape = cases[k]
            results[thread, round_] = (k, _canon(plan_mix(C, shape, GPU_PROFILE, 4)))

    threads = [threading.Thread(target=plan_all, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 36
    for k, text in results.values():
        assert text == alone[k]
