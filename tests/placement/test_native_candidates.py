"""The compiled shadow and spread starts (``mixmoe.placement.native_candidates``,
``native/candidates.cpp``) against their slow twins, the Python ``shadow_hot`` (its list search
and its tensor search) and ``spread_start``: the same experts, the same holders in the same dict
order, on the inputs ``plan_mix`` really passes and on random adversarial ones; plus the fallback
and the spread start's guard for fewer rows than ranks.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mixmoe.placement.native_candidates as native
import mixmoe.placement.native_lib as lib
import mixmoe.placement.planner as planner_module
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import CPU_PROFILE, GPU_PROFILE, HardwareProfile, LayerShape
from mixmoe.placement import shadow as shadow_module
from mixmoe.placement import spread as spread_module
from mixmoe.placement.counts import baseline_loads, counts_with_sums
from mixmoe.placement.planner import plan_mix

# every fixed term set: rows and replicas cost more than their FLOPs and bytes
FIXED = dataclasses.replace(
    HardwareProfile("ib-like", 593e12, 40e9, 30e-6),
    row_overhead_s=1e-8,
    replica_fixed_s=2e-5,
    step_fixed_s=1e-4,
)
ROUTINGS = ("uniform", "zipf:1.2", "zipf:2.0", "hot:0.3")


def _terms(shape: LayerShape, profile: HardwareProfile) -> tuple[float, float]:
    """shadow_hot's t_row_feat and t_model, its expressions."""
    t_row_feat = (
        shape.flops_per_row / profile.gemm_flops + 4 * shape.row_bytes / profile.link_bandwidth
    )
    return t_row_feat, shape.params_bytes_per_expert / profile.link_bandwidth


def _shadow_equal(C_WN, E, load_N, own_N, t_row_feat, t_model) -> tuple[int, ...]:
    """The compiled search, the list search and the tensor search: the same experts."""
    fast = native.shadow_hot(C_WN, E, load_N, own_N, t_row_feat, t_model)
    assert fast is not None, lib.unavailable_reason()
    lists = shadow_module._shadow_hot_lists(C_WN, E, load_N, own_N, t_row_feat, t_model)
    tensor = shadow_module._shadow_hot_tensor(C_WN, E, load_N, own_N, t_row_feat, t_model)
    assert fast == lists == tensor, (fast, lists, tensor)
    assert all(type(g) is int for g in fast)
    return fast


def _spread_equal(C_WN, colsum_N, E, slots) -> dict[int, tuple[int, ...]]:
    """The compiled spread start and the Python: the same dict, in the same order."""
    fast = native.spread_start(C_WN, colsum_N, E, slots)
    assert fast is not None, lib.unavailable_reason()
    slow = spread_module._spread_start_python(C_WN, colsum_N, E, slots)
    assert list(fast.items()) == list(slow.items())
    assert all(type(r) is int for holders in fast.values() for r in holders)
    return fast


def test_compiled_candidates_are_built_here():
    """Every machine with a C++ compiler runs the compiled starts (a skip would hide a broken
    build) and the callers use them."""
    assert lib.available(), lib.unavailable_reason()
    assert native.SOURCE.exists()


def _synthetic(routing: str, W: int, shape_name: str, seed: int) -> tuple[torch.Tensor, LayerShape]:
    """Synthetic counts of ``routing`` at the seeds' shape (D1024 F4096, E = 4..8, top-2) or the
    DeepSeek-like one (D2048 F1024 SwiGLU, 256 experts, top-8, W dividing 256)."""
    gen = torch.Generator().manual_seed(seed)
    if shape_name == "seeds":
        E, top_k = 4 + seed % 5, 2
        shape = LayerShape(1024, 4096, E, W, 2)
    else:
        E, top_k = 256 // W, 8
        shape = LayerShape(2048, 1024, E, W, 2, 3)
    C = synthetic_counts(RoutingSpec.parse(routing), W, 4096, top_k, W * E, gen,
                         shuffle_experts=True)  # fmt: skip
    return C, shape


CASES = [("seeds", W) for W in (2, 3, 5, 8, 16, 40, 64, 65, 100, 160)] + [
    ("deepseek", W) for W in (2, 8, 32, 64, 128)
]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_planner_inputs_equal(routing):
    """The counts, sums and terms plan_mix passes (synthetic routing, both shapes, W = 2..160,
    three profiles; every slot budget 1..8 for the spread start)."""
    shadowed = spread = 0
    for i, (shape_name, W) in enumerate(CASES):
        C, shape = _synthetic(routing, W, shape_name, i)
        C_WN, *sums = counts_with_sums(C, shape)
        _, colsum_N, own_N = baseline_loads(C_WN, shape.experts_per_rank, sums)
        for profile in (GPU_PROFILE, CPU_PROFILE, FIXED):
            hot = _shadow_equal(C_WN, shape.experts_per_rank, colsum_N, own_N,
                                *_terms(shape, profile))  # fmt: skip
            assert shadow_module.shadow_hot(C_WN, shape, profile, colsum_N, own_N) == hot
            shadowed += len(hot)
        for slots in range(1, 9):
            spread += len(_spread_equal(C_WN, colsum_N, shape.experts_per_rank, slots))
    if routing != "uniform":
        assert shadowed and spread  # the cases really shadow and spread


def test_plan_mix_calls_equal(monkeypatch):
    """plan_mix's own calls (its C, sums, shape, profile, slots), both ways, compared: the spread
    start is reached on the unbalanced cases."""
    calls = {"shadow": 0, "spread": 0}

    def shadow_both(C_WN, shape, profile, load_N, own_N):
        calls["shadow"] += 1
        E = shape.experts_per_rank
        return _shadow_equal(C_WN, E, load_N, own_N, *_terms(shape, profile))

    def spread_both(C_WN, colsum_N, E, slots):
        calls["spread"] += 1
        return _spread_equal(C_WN, colsum_N, E, slots)

    monkeypatch.setattr(planner_module, "shadow_hot", shadow_both)
    monkeypatch.setattr(planner_module, "spread_start", spread_both)
    monkeypatch.setattr(
        planner_module, "planned", lambda *a: None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)
    for i, (W, routing, profile) in enumerate(
        [(8, "zipf:2.0", GPU_PROFILE), (16, "zipf:1.2", FIXED), (32, "hot:0.3", CPU_PROFILE),
         (64, "zipf:2.0", FIXED), (128, "zipf:1.2", GPU_PROFILE)]
    ):  # fmt: skip
        C, shape = _synthetic(routing, W, "seeds", i)
        plan_mix(C, shape, profile, 4)
    assert calls["shadow"] == 5 and calls["spread"] >= 1


def _adversarial(rng: random.Random, W: int, E: int) -> torch.Tensor:
    """Random counts with zeros, ties (small counts), a rank routing nothing, a rank whose
    experts receive nothing, one hot expert."""
    N = W * E
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    top = rng.choice([1, 3, 50, 3000])
    C = torch.randint(0, top + 1, (W, N), generator=gen)
    C[torch.rand(W, N, generator=gen) < rng.choice([0.0, 0.3, 0.9])] = 0
    if rng.random() < 0.4:
        C[rng.randrange(W)] = 0  # a rank routes nothing
    if rng.random() < 0.4:
        r = rng.randrange(W)
        C[:, r * E : r * E + E] = 0  # a rank receives nothing
    if rng.random() < 0.6:
        C[:, rng.randrange(N)] += rng.randrange(1, 20 * top + 2)  # one hot expert
    if rng.random() < 0.2:
        C.zero_()
    return C


@pytest.mark.parametrize("seed", range(4))
def test_random_inputs_equal(seed):
    """Random adversarial counts, W = 2..300, E = 1..4, random float terms (t_model 0 included:
    a tried expert that leaves the max as it was ties with the best and ends the search), slots
    1..8 (0 and below: empty)."""
    rng = random.Random(seed)
    shadowed = spread = 0
    for _ in range(40):
        W = rng.choice([2, 3, 4, 7, 8, 13, 64, 65, 150, 300])
        E = rng.choice([1, 2, 4]) if W <= 150 else 1
        C_WN = _adversarial(rng, W, E)
        _, colsum_N, own_N = baseline_loads(C_WN, E)
        t_row_feat = rng.choice([1e-9, 3.7e-7, rng.random() * 1e-6])
        t_model = rng.choice([0.0, 1e-9, rng.random() * 1e-4, t_row_feat])
        shadowed += len(_shadow_equal(C_WN, E, colsum_N, own_N, t_row_feat, t_model))
        slots = rng.choice([-1, 0, 1, 2, 3, 5, 8])
        out = _spread_equal(C_WN, colsum_N, E, slots)
        spread += len(out)
        if slots <= 0:
            assert out == {}
    assert shadowed >= 10 and spread >= 10


def test_ties_are_broken_the_same_way():
    """Equal loads everywhere: the shadow search tries the lowest id first, the spread start
    picks the lowest ranks among equal estimates (and heavier-than-mean experts of equal rows in
    id order)."""
    W, E = 6, 2
    C = torch.ones(W, W * E, dtype=torch.int64)
    C[:, [3, 8]] = 40  # two experts of equal rows, on ranks 1 and 4
    _, colsum_N, own_N = baseline_loads(C, E)
    for t_model in (0.0, 1e-12, 1e-6):
        _shadow_equal(C, E, colsum_N, own_N, 1e-9, t_model)
    for slots in (1, 2, 8):
        out = _spread_equal(C, colsum_N, E, slots)
        assert list(out) == [3, 8]


def test_spread_compares_rows_with_the_mean_exactly():
    """An expert one row above a mean of 2**24 + 0.5 rows: heavier (float32 would round both to
    2**24 and say no), one holder, both ways."""
    C = torch.tensor([[2**24, 2**23], [1, 2**23]], dtype=torch.int64)  # colsum 2**24 + 1, 2**24
    colsum_N = C.sum(0)
    assert int(colsum_N.sum()) / 2 == 2**24 + 0.5
    assert _spread_equal(C, colsum_N, 1, 8) == {0: (1,)}


@pytest.mark.parametrize("E", [1, 4])
def test_fewer_rows_than_ranks_plan(monkeypatch, E):
    """W = 8 with 1..7 rows in all, on one hot expert: the mean is below one row (int(mean) was a
    zero divisor, a crash in plan_mix); no spread start either way, and plan_mix plans them,
    compiled or not, the same plan."""
    W = 8
    shape = LayerShape(1024, 4096, E, W, 2)
    reached = []
    saved = planner_module.spread_start
    monkeypatch.setattr(planner_module, "spread_start", lambda *a: reached.append(a) or saved(*a))
    monkeypatch.setattr(
        planner_module, "planned", lambda *a: None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)
    for rows in range(1, W):
        C = torch.zeros(W, W * E, dtype=torch.int64)
        C[rows % W, E * (rows % W) + E - 1] = rows  # routed by its owner's rank
        C[(rows + 3) % W, 0] += 1 if rows < W - 1 else 0
        assert _spread_equal(C, C.sum(0), E, 8) == {}
        for profile in (GPU_PROFILE, CPU_PROFILE):
            compiled = plan_mix(C, shape, profile, 4)
            with monkeypatch.context() as m:
                m.setenv(lib.ENV_OFF, "0")
                assert plan_mix(C, shape, profile, 4) == compiled
            compiled.check_shares(C, E, planner_module.BLOCK_SIZE)
    assert reached  # plan_mix does reach the spread start with such counts


def test_falls_back_to_python(monkeypatch):
    """``MIXMOE_NATIVE=0``: the compiled starts return None and the callers run their Python,
    the same experts and holders."""
    C, shape = _synthetic("zipf:1.2", 16, "seeds", 3)
    C_WN, *sums = counts_with_sums(C, shape)
    _, colsum_N, own_N = baseline_loads(C_WN, shape.experts_per_rank, sums)
    hot = shadow_module.shadow_hot(C_WN, shape, GPU_PROFILE, colsum_N, own_N)
    spread = spread_module.spread_start(C_WN, colsum_N, shape.experts_per_rank, 4)
    assert hot and spread
    monkeypatch.setenv(lib.ENV_OFF, "0")
    terms = _terms(shape, GPU_PROFILE)
    assert native.shadow_hot(C_WN, shape.experts_per_rank, colsum_N, own_N, *terms) is None
    assert native.spread_start(C_WN, colsum_N, shape.experts_per_rank, 4) is None
    assert shadow_module.shadow_hot(C_WN, shape, GPU_PROFILE, colsum_N, own_N) == hot
    python = spread_module.spread_start(C_WN, colsum_N, shape.experts_per_rank, 4)
    assert list(python.items()) == list(spread.items())
