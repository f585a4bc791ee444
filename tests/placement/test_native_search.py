"""The compiled source-replica search (``mixmoe.placement.native_search``,
``native/replica_search.cpp``) against its slow twins, every Python path of ``plan_replicas``
(``_plan_mix_lists``, ``_HostMixSearch``, ``_MixSearch`` / ``_BatchedMixSearch``, forced with the
compiled search off): the same plans exactly (hot set, holders, loads, and both predictions'
floats bit for bit), on the counts ``plan_mix`` really plans and on adversarial toys.

Legend: W ranks, E experts per rank, N = W*E experts, C_WN[s][g] = rows s routes to g.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mixmoe.placement.native_lib as lib
import mixmoe.placement.native_search as native
import mixmoe.placement.replica_search as replica_search
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import CPU_PROFILE, GPU_PROFILE, HardwareProfile, LayerShape, Plan
from mixmoe.placement.cost_model import step_model
from mixmoe.placement.counts import baseline_loads, counts_with_sums
from mixmoe.placement.planner import plan_mix
from mixmoe.placement.replica_search import plan_replicas

# the row and replica overheads and the step's fixed cost on (every term of the model nonzero)
OVERHEADS = dataclasses.replace(
    GPU_PROFILE, name="overheads", row_overhead_s=2e-9, replica_fixed_s=3e-5, step_fixed_s=1e-4
)
# toy profiles: D = F = 1 (seconds of small integers: new totals land exactly on the step), a
# token-bound one (a bottleneck gains by fetching replicas: source candidates listed), and a
# compute-bound one (replicating pays: long searches, full holders)
UNIT = HardwareProfile("unit", gemm_flops=12.0, link_bandwidth=16.0, link_latency=1e-3)
TOKEN_BOUND = HardwareProfile("token-bound", gemm_flops=1e13, link_bandwidth=1e8, link_latency=1e-6)
COMPUTE_BOUND = HardwareProfile("compute-bound", gemm_flops=1e9, link_bandwidth=1e11, link_latency=1e-6)  # fmt: skip
# (LIST_LIMIT, HOST_LIMIT, BATCH_LIMIT) forcing each Python path of plan_replicas
PYTHON_PATHS = {
    "lists": (10**9, 0, 0),
    "host": (-1, 10**9, 0),
    "batched": (-1, -1, 10**9),
    "shortlist": (-1, -1, -1),
}
CAPS, WIDTHS = (1, 2, 4, 8, 32), (1, 2, 8)


def _python_plan(monkeypatch, path: str, *args, **kwargs) -> Plan:
    """``plan_replicas(*args, **kwargs)`` on one Python path (the compiled search off)."""
    monkeypatch.setenv("MIXMOE_NATIVE", "0")
    for name, limit in zip(
        ("LIST_LIMIT", "HOST_LIMIT", "BATCH_LIMIT"), PYTHON_PATHS[path], strict=True
    ):
        monkeypatch.setattr(replica_search, name, limit)
    try:
        return plan_replicas(*args, **kwargs)
    finally:
        monkeypatch.delenv("MIXMOE_NATIVE")


def _assert_same(got: Plan, want: Plan, case: object) -> None:
    """Equal plans, their floats bit for bit (== would let -0.0 pass for 0.0)."""
    assert got == want, case
    for name in ("prediction", "baseline"):
        a, b = getattr(got, name), getattr(want, name)
        for field in ("compute_s", "comm_s"):
            assert [x.hex() for x in getattr(a, field)] == [x.hex() for x in getattr(b, field)]
        assert a.step_s.hex() == b.step_s.hex(), case


def _compiled_plan(*args, **kwargs) -> Plan:
    """``plan_replicas`` with the compiled search, checked to have run it."""
    calls = []
    searched = native.searched

    def counted(*a, **k):
        calls.append(1)
        return searched(*a, **k)

    native.searched = counted
    try:
        plan = plan_replicas(*args, **kwargs)
    finally:
        native.searched = searched
    assert calls == [1]
    return plan


def test_compiled_search_is_built_here():
    """Every machine with a C++ compiler runs the compiled search (a test that skipped here
    would hide a broken build), and ``plan_replicas`` takes it."""
    assert lib.available(), lib.unavailable_reason()
    model = step_model(LayerShape(1024, 4096, 4, 8, 2), GPU_PROFILE, True)
    assert native.available(model)
    assert native.SOURCE.exists()


def _real_cases():
    """(counts, shape) as plan_mix plans them: both shapes, every routing, 8192 tokens per rank
    (1024 from W = 32 on: drawing zipf counts for 8192 tokens on 160 ranks takes seconds)."""
    deepseek = (2048, 1024, 8, 3)  # D, F, top-k, GEMMs per expert: 256 experts over W ranks
    for i, routing in enumerate(("uniform", "zipf:1.2", "zipf:2.0", "hot:0.3")):
        for j, W in enumerate((2, 3, 5, 8, 16, 64, 160)):
            E = 4 + (i + j) % 5  # E = 4..8
            C = synthetic_counts(RoutingSpec.parse(routing), W, 8192 if W < 32 else 1024, 2, W * E,
                                 torch.Generator().manual_seed(j), shuffle_experts=True)  # fmt: skip
            yield C, LayerShape(1024, 4096, E, W, 2)
        D, F, k, gemms = deepseek
        for j, W in enumerate((2, 8, 32, 128)):
            C = synthetic_counts(RoutingSpec.parse(routing), W, 8192 if W < 32 else 1024, k, 256,
                                 torch.Generator().manual_seed(j), shuffle_experts=True)  # fmt: skip
            yield C, LayerShape(D, F, 256 // W, W, 2, gemms)


def test_compiled_search_equals_every_python_path_on_planner_inputs(monkeypatch):
    """The counts plan_mix plans (uniform, zipf:1.2, zipf:2.0, hot:0.3; W = 2..160; D1024
    F4096 with E = 4..8 and the DeepSeek-like shape), three profiles, every cap and width, as
    plan_mix passes them (its counted sums and baseline loads): the compiled plan equals the
    Python path plan_replicas takes there on every case, and each of the four Python paths on
    a rotating share of them (the list path on small problems: it lists the counts)."""
    rotation, hot, compared = 0, 0, set()
    for C, shape in _real_cases():
        W, E = shape.world_size, shape.experts_per_rank
        counted = counts_with_sums(C, shape)
        base = baseline_loads(counted[0], E, counted[1:])
        small = W * shape.num_experts <= replica_search.LIST_LIMIT
        for profile in (GPU_PROFILE, CPU_PROFILE, OVERHEADS):
            for cap in CAPS:
                for width in WIDTHS:
                    kwargs = dict(search_width=width, counted=counted,
                                  baseline=None if small else base)  # fmt: skip
                    args = (C, shape, profile, cap)
                    got = _compiled_plan(*args, **kwargs)
                    monkeypatch.setenv("MIXMOE_NATIVE", "0")
                    want = plan_replicas(*args, **kwargs)  # the path plan_replicas takes
                    monkeypatch.delenv("MIXMOE_NATIVE")
                    case = (shape, profile.name, cap, width)
                    _assert_same(got, want, case)
                    hot += len(got.hot)
                    rotation += 1
                    path = list(PYTHON_PATHS)[rotation // 3 % 4]
                    if path == "lists" and W * shape.num_experts > 20000:
                        continue  # listing [160, 1280] counts costs more than the test's budget
                    if rotation % 3 == 0:
                        _assert_same(got, _python_plan(monkeypatch, path, *args, **kwargs), case)
                        compared.add(path)
    assert compared == set(PYTHON_PATHS)
    assert hot > 500  # the cases replicate, several experts at a time


def _toy_counts(rng: random.Random, W: int, E: int, kind: str) -> torch.Tensor:
    """Adversarial counts [W, W*E]: small ints with many ties, or one of the edge patterns."""
    N = W * E
    C = [[rng.choice((0, 0, 1, 2, 3)) for _ in range(N)] for _ in range(W)]
    if kind == "zeros":
        C = [[0] * N for _ in range(W)]
    elif kind == "local only":  # every rank routes to its own experts only: nothing remote
        C = [[rng.randint(0, 9) if g // E == s else 0 for g in range(N)] for s in range(W)]
    elif kind == "empty rank":  # a rank that routes nothing, and a rank nobody routes to
        C[rng.randrange(W)] = [0] * N
        quiet = rng.randrange(W)
        for row in C:
            row[quiet * E : (quiet + 1) * E] = [0] * E
    elif kind == "one hot":  # one expert takes most rows from every rank
        g = rng.randrange(N)
        for row in C:
            row[g] = 40 + rng.randint(0, 2)
    elif kind == "ties":  # every segment alike: ties in remote rows, totals and bottlenecks
        c = rng.randint(1, 5)
        C = [[c] * N for _ in range(W)]
    elif kind == "scaled":  # large counts with few distinct values
        C = [[x * 1000 for x in row] for row in C]
    return torch.tensor(C, dtype=torch.int64)


KINDS = ("random", "zeros", "local only", "empty rank", "one hot", "ties", "scaled")


@pytest.mark.parametrize("seed", range(6))
def test_compiled_search_equals_every_python_path_on_toys(monkeypatch, seed: int):
    """Random toys (W = 2..9, E = 1..4, 0-3 rows per segment), zeros, nothing remote, empty
    ranks, one hot expert, all-equal counts: on toy profiles where new totals land exactly on
    the step, the first replica's weight collectives lift untouched ranks, source candidates are
    listed and holders fill up, the compiled plan equals each Python path's, counts given as
    lists or a tensor, with and without overlap."""
    rng = random.Random(seed)
    hot = 0
    for case in range(70):
        W, E = rng.randint(2, 9), rng.randint(1, 4)
        kind = KINDS[case % len(KINDS)]
        C = _toy_counts(rng, W, E, kind)
        profile = (UNIT, TOKEN_BOUND, COMPUTE_BOUND, OVERHEADS)[case % 4]
        dims = (1, 1) if profile is UNIT else (64, 16) if profile is TOKEN_BOUND else (64, 256)
        shape = LayerShape(*dims, E, W, 4)
        cap, width, overlap = rng.choice(CAPS[:4]), rng.choice(WIDTHS), rng.random() < 0.5
        args = (C.tolist() if case % 2 else C, shape, profile, cap, overlap)
        got = _compiled_plan(*args, search_width=width)
        for path in PYTHON_PATHS:
            _assert_same(got, _python_plan(monkeypatch, path, *args, search_width=width),
                         (seed, case, kind, path))  # fmt: skip
        hot += len(got.hot)
        if kind in ("zeros", "local only"):
            assert got.hot == () and got.prediction == got.baseline
    assert hot >= 10


def test_compiled_entry_builds_its_own_sums_and_baseline():
    """``searched`` without the column sums or the baseline loads (the C++ builds them, as the
    tiny problems pass none) gives what it gives with them, and the result is the Python's."""
    for seed, routing in enumerate(("zipf:1.2", "hot:0.3", "uniform")):
        W, E = 16, 4
        C = synthetic_counts(RoutingSpec.parse(routing), W, 4096, 2, W * E,
                             torch.Generator().manual_seed(seed))  # fmt: skip
        shape = LayerShape(1024, 4096, E, W, 2)
        model = step_model(shape, CPU_PROFILE, True)
        C_WN, colsum, rowsum = counts_with_sums(C, shape)
        loads = baseline_loads(C_WN, E, (colsum, rowsum))[0]
        full = native.searched(C_WN, E, model, 8, 8, colsum, loads)
        assert full == native.searched(C_WN, E, model, 8, 8, None, None)
        assert full == native.searched(
            C_WN, E, model, 8, 8, colsum.to(torch.int32), loads.t().contiguous().t()
        )
        replicas, prediction, baseline = full
        assert (replicas != ()) == (routing != "uniform")
        plan = plan_replicas(C, shape, CPU_PROFILE, 8, search_width=8)
        assert (plan.replicas, plan.prediction, plan.baseline) == full


def test_byte_counts_past_int64_fall_back_to_python(monkeypatch):
    """A layer so wide that a prediction's byte counts leave int64 (Python's ints do not):
    the compiled entry declines (``searched`` None) and plan_replicas' Python prices it."""
    shape = LayerShape(2**40, 1, 2, 4, 2)  # 2**42 token bytes per row, factors below 2**53
    gen = torch.Generator().manual_seed(3)
    C = torch.randint(0, 2**21, (4, 8), generator=gen)
    C[:, 0] *= 4  # one hot expert: worth replicating on the compute-bound profile
    model = step_model(shape, COMPUTE_BOUND, True)
    C_WN, colsum, _ = counts_with_sums(C, shape)
    assert native.searched(C_WN, 2, model, 4, 8, colsum, None) is None
    got = plan_replicas(C, shape, COMPUTE_BOUND, 4)
    assert max(got.baseline.token_bytes) >= 2**63
    _assert_same(got, _python_plan(monkeypatch, "lists", C, shape, COMPUTE_BOUND, 4), shape)


def test_native_off_runs_python_and_plan_mix_is_unchanged(monkeypatch):
    """``MIXMOE_NATIVE=0``: no compiled search (``available`` False), the same plan_mix plan."""
    W, E = 8, 4
    C = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, W * E, torch.Generator())
    shape = LayerShape(1024, 4096, E, W, 2)
    on = plan_mix(C, shape, GPU_PROFILE, 4)
    monkeypatch.setenv("MIXMOE_NATIVE", "0")
    assert not native.available(step_model(shape, GPU_PROFILE, True))
    assert native.searched(C, E, step_model(shape, GPU_PROFILE, True), 4, 8) is None
    assert plan_mix(C, shape, GPU_PROFILE, 4) == on


def test_compiled_search_at_the_edges(monkeypatch):
    """One rank, a cap of 0, and a cap and a width of 2**62 (clamped: they bind nothing; the
    Python's tensor forms take them up to int64): the Python paths' plans."""
    C = synthetic_counts(RoutingSpec.parse("hot:0.5"), 4, 512, 2, 8, torch.Generator())
    shape = LayerShape(64, 256, 2, 4, 4)
    for args, width in (
        ((C[:1, :2], LayerShape(64, 256, 2, 1, 4), COMPUTE_BOUND, 4), 8),
        ((C, shape, COMPUTE_BOUND, 0), 8),
        ((C, shape, COMPUTE_BOUND, 2**62), 2**62),
    ):
        got = _compiled_plan(*args, search_width=width)
        for path in PYTHON_PATHS:
            _assert_same(got, _python_plan(monkeypatch, path, *args, search_width=width), path)
    assert got.hot != ()  # the last case replicates
    # past int64 (the host forms take any Python int)
    got = _compiled_plan(C, shape, COMPUTE_BOUND, 10**30, search_width=10**30)
    for path in ("lists", "host"):
        want = _python_plan(monkeypatch, path, C, shape, COMPUTE_BOUND, 10**30, search_width=10**30)
        _assert_same(got, want, path)
