"""The compiled step bookkeeping (``mixmoe.dispatch.step_native``, ``native/step_plan.cpp``)
against its slow twin, ``step_plan.step_plan_python``: the whole ``StepPlan`` compared exactly
(``==`` and ``repr``, so a list for a tuple or 1 for True fails too), on the plans ``plan_mix``
really makes (synthetic counts, both shapes, three profiles, every rank for small W: owners of
ranged experts, holders, kept holders, a rank with no rows), on hand-made plans with explicit
shares, ranges and kept holders, and on unchecked random plans the Python rejects (the compiled
part hands them to the Python: the same error); plus the build and each fallback.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mixmoe.dispatch.step_native as native
import mixmoe.placement.native_lib as lib
from mixmoe.dispatch.replicas import RelayPlan
from mixmoe.dispatch.step_plan import build_step_plan, step_plan_python
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import CPU_PROFILE, GPU_PROFILE, HardwareProfile, LayerShape
from mixmoe.placement.counts import CountSums
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import plan_mix, plan_none, plan_shadow
from mixmoe.placement.ranges import cut_ranges, stream_sources
from mixmoe.simulate.workloads import SHAPES, layer_shape

IB = HardwareProfile("ib-like", 593e12, 40e9, 30e-6)
FIXED = dataclasses.replace(IB, row_overhead_s=1e-8, replica_fixed_s=2e-5, step_fixed_s=1e-4)
PROFILES = {"gpu": GPU_PROFILE, "cpu": CPU_PROFILE, "fixed": FIXED}
ROUTINGS = ("uniform", "zipf:1.2", "zipf:2.0", "hot:0.3")
B = 4  # rows per block of the hand-made plans


def _same(C_WN: torch.Tensor, plan: Plan, r: int, E: int) -> None:
    """The compiled fields ran (no fallback) and give the Python's StepPlan exactly."""
    assert native.step_fields(C_WN, plan, r, E) is not None, (r, plan)
    got, want = build_step_plan(C_WN, plan, r, E), step_plan_python(C_WN, plan, r, E)
    assert got == want, (r, plan)
    assert repr(got) == repr(want), (r, plan)
    # the group's rows of each expert, off the same pass (the layer's StepMeta reads them)
    assert want.expert_rows_N is None
    assert torch.equal(got.expert_rows_N, C_WN.sum(dim=0)), (r, plan)
    # C's sums given (the layer's CountSums): no pass sums C, the same StepPlan
    sums = CountSums(C_WN.sum(0), C_WN.sum(1))
    assert native.step_fields(C_WN, plan, r, E, sums) is not None, (r, plan)
    given = build_step_plan(C_WN, plan, r, E, sums=sums)
    assert given == want and repr(given) == repr(want), (r, plan)
    assert given.expert_rows_N is sums.colsum_N
    # the route built before (plan_ahead builds it with its plan): taken as it is, the same
    route = RelayPlan.build(plan.replicas, r, C_WN.shape[0], E, relay=plan.relay)
    prebuilt = build_step_plan(C_WN, plan, r, E, sums=sums, fetch=route)
    assert prebuilt.fetch is route and prebuilt == want, (r, plan)
    # C stored by columns (the mixed strategy's count exchange): read as it is, the same
    by_column = C_WN.T.contiguous().T
    for with_sums in (None, sums):
        assert native.step_fields(by_column, plan, r, E, with_sums) is not None, (r, plan)
        got = build_step_plan(by_column, plan, r, E, sums=with_sums)
        assert got == want and repr(got) == repr(want), (r, plan)


def _same_or_same_error(C_WN: torch.Tensor, plan: Plan, r: int, E: int) -> str | None:
    """``build_step_plan`` and the Python give the same StepPlan or raise the same error (its
    type's name returned)."""
    try:
        want = step_plan_python(C_WN, plan, r, E)
    except Exception as err:  # noqa: BLE001 (any error the Python raises, the same one)
        with pytest.raises(type(err)) as got:
            build_step_plan(C_WN, plan, r, E)
        assert str(got.value) == str(err)
        return type(err).__name__
    got = build_step_plan(C_WN, plan, r, E)
    assert got == want and repr(got) == repr(want), (r, plan)
    return None


def _ranks(plan: Plan, W: int, E: int, idle: int | None) -> list[int]:
    """Every rank for small W; else the first, a third, the last, the owners of ranged
    experts, holders, kept holders and the rank without rows."""
    if W <= 16:
        return list(range(W))
    some = {0, W // 3, W - 1, *(g // E for g, _ in plan.ranges[:2])}
    some |= {h[0] for _, h in plan.replicas[:3]} | {k[0][0] for _, k in plan.kept[:2]}
    return sorted(some | ({idle} if idle is not None else set()))


def test_compiled_step_is_built_here():
    """Every machine with a C++ compiler runs the compiled part (a skip would hide a broken
    build); the header length agrees with the C++."""
    assert lib.available(), lib.unavailable_reason()
    source = (lib.FOLDER / "step_plan.cpp").read_text()
    assert f"constexpr int64_t HEADER = {native.HEADER};" in source


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_plan_mix_plans(profile: str) -> None:
    """``plan_mix``'s plans (ranges, kept holders under CPU_PROFILE) over W = 2..300, both
    shapes, four routings; one rank of each case routes no rows at all (its row of C zero)."""
    seen = {"ranges": 0, "kept": 0, "holder": 0, "idle": 0}
    for i, (W, shape) in enumerate([(2, "seeds"), (3, "seeds"), (5, "seeds"), (8, "deepseek"),
                                    (16, "seeds"), (32, "deepseek"), (64, "seeds"),
                                    (160, "seeds"), (300, "seeds")]):  # fmt: skip
        ls = layer_shape(SHAPES[shape], W)
        E = ls.experts_per_rank
        routing = ROUTINGS[i % len(ROUTINGS)]
        gen = torch.Generator().manual_seed(W)
        k = 2 if shape == "seeds" else 8
        C_WN = synthetic_counts(RoutingSpec.parse(routing), W, 2048, k, W * E, gen,
                                shuffle_experts=True)  # fmt: skip
        idle = W // 2 if W > 2 else None
        if idle is not None:
            C_WN[idle] = 0
        plan = plan_mix(C_WN, ls, PROFILES[profile], B)
        seen["ranges"] += bool(plan.ranges)
        seen["kept"] += bool(plan.kept)
        for r in _ranks(plan, W, E, idle):
            seen["holder"] += bool(plan.replica_slots(r))
            seen["idle"] += r == idle
            _same(C_WN, plan, r, E)
    assert seen["ranges"] and seen["holder"] and seen["idle"], seen
    assert seen["kept"] or profile != "cpu", seen  # CPU_PROFILE's plans keep some rows local


@pytest.mark.parametrize("routing", ROUTINGS)
def test_plan_mix_plans_more_routings(routing: str) -> None:
    """Every routing at W = 12 and 96 (E = 4, GPU_PROFILE), and the other planners' plans
    (no shares: the replica rule's fast path)."""
    for W in (12, 96):
        gen = torch.Generator().manual_seed(7 * W)
        C_WN = synthetic_counts(RoutingSpec.parse(routing), W, 4096, 2, 4 * W, gen,
                                shuffle_experts=True)  # fmt: skip
        shape = LayerShape(1024, 4096, 4, W, 2)
        for plan in (plan_mix(C_WN, shape, GPU_PROFILE, B), plan_shadow(C_WN, shape, GPU_PROFILE),
                     plan_none(C_WN, shape, GPU_PROFILE)):  # fmt: skip
            for r in _ranks(plan, W, 4, None):
                _same(C_WN, plan, r, 4)


def test_plan_mix_at_1024_ranks() -> None:
    """One W = 1024 plan (zipf:1.2): its ranges' full streams and the prefix sums below r."""
    W, E = 1024, 4
    gen = torch.Generator().manual_seed(0)
    C_WN = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, W * E, gen,
                            shuffle_experts=True)  # fmt: skip
    plan = plan_mix(C_WN, LayerShape(1024, 4096, E, W, 2), GPU_PROFILE, B)
    assert plan.ranges
    for r in _ranks(plan, W, E, None)[:6]:
        _same(C_WN, plan, r, E)


def test_given_sums_spare_the_ranged_columns_on_the_longer_side_of_the_rank() -> None:
    """Given C's sums (trusted, as the planner trusts them), the compiled bookkeeping of rank r
    reads a ranged expert's column only on the shorter side of r (the rows s < r where
    r <= W - r, else the rows s >= r, its sum less them), and at its owner, holders and kept
    holders: counts planted in the other rows change nothing, while the Python, summing C
    itself, sees them."""
    W, E = 16, 2
    C_WN = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 512, 2, W * E,
                            torch.Generator().manual_seed(3), shuffle_experts=True)  # fmt: skip
    plan = plan_mix(C_WN, LayerShape(1024, 4096, E, W, 2), GPU_PROFILE, B)
    assert plan.ranges
    sums = CountSums(C_WN.sum(0), C_WN.sum(1))
    holders = dict(plan.replicas)
    kept = {g: {y for y, _ in entries} for g, entries in plan.kept}
    checked, seen = 0, 0
    for r in range(W):
        want = build_step_plan(C_WN, plan, r, E, sums=sums)
        planted = C_WN.clone()
        for g, _ in plan.ranges:
            if g // E == r or r in holders.get(g, ()):
                continue  # r's own or held expert: its stream is read whole (every segment)
            unread = range(r + 1, W) if r <= W - r else range(r)  # the longer side of r
            spared = [s for s in unread
                      if s != g // E and s not in holders.get(g, ()) and s not in kept.get(g, ())]  # fmt: skip
            planted[spared, g] += 1000
            checked += len(spared)
        got = build_step_plan(planted, plan, r, E, sums=sums)
        assert got == want and repr(got) == repr(want), r
        seen += step_plan_python(planted, plan, r, E) != want  # summing C: the plants count
    assert checked > 0 and seen > 0


def _counts(rng: random.Random, W: int, E: int, zeros: float = 0.3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(10**6))
    C_WN = torch.randint(0, 12 * B, (W, W * E), generator=gen)
    C_WN[torch.rand(W, W * E, generator=gen) < zeros] = 0
    if W > 1 and rng.random() < 0.3:
        C_WN[rng.randrange(W)] = 0  # a rank without rows
    if rng.random() < 0.2:
        C_WN[:, rng.randrange(W * E)] = 4 * B  # ties: one expert as heavy on every rank
    return C_WN


def _holders(rng: random.Random, W: int, E: int, experts: list[int]) -> dict[int, tuple]:
    out = {}
    for g in experts:
        others = [y for y in range(W) if y != g // E]
        if others:
            out[g] = tuple(sorted(rng.sample(others, rng.randint(1, len(others)))))
    return out


def _hand_made(rng: random.Random, W: int, E: int, C_WN: torch.Tensor) -> Plan:
    """Random holders; some experts with ranges and kept holders (``cut_ranges``), the others'
    segments cut into explicit share entries (whole blocks, owner and holders only)."""
    N = W * E
    C = C_WN.tolist()
    holders = _holders(rng, W, E, sorted(rng.sample(range(N), rng.randint(0, N))))
    ranges, kept, shares = [], [], []
    ranged = {g for g in holders if rng.random() < 0.5}
    for g in sorted(ranged):
        o, col = g // E, [C[s][g] for s in range(W)]
        keep = {y: rng.randint(0, (col[y] - 1) // B) * B
                for y in holders[g] if col[y] and rng.random() < 0.4}  # fmt: skip
        if keep:
            kept.append((g, tuple(sorted(keep.items()))))
        total = sum(col[s] - keep.get(s, 0) for s in stream_sources(col, o, holders[g], keep))
        free = [y for y in holders[g] if y not in keep]  # a kept holder takes no range
        helpers = rng.sample(free, rng.randint(0, len(free)))
        cut = cut_ranges(col, o, holders[g], [(y, rng.randint(1, total + 1)) for y in helpers],
                         B, keep)  # fmt: skip
        if cut:
            ranges.append((g, cut))
    ranged = {g for g, _ in ranges} | {g for g, _ in kept}
    for s in range(W):
        for g in range(N):
            if g in ranged or not C[s][g] or rng.random() < 0.5:
                continue
            allowed = [g // E, *holders.get(g, ())]
            runs, left = [], C[s][g]
            for c in rng.sample(allowed, rng.randint(1, len(allowed)))[:-1]:
                m = B * rng.randint(0, (left - 1) // B)
                if m:
                    runs.append((c, m))
                    left -= m
            ranks = {c for c, _ in runs}
            last = next(c for c in [*allowed] if c not in ranks)
            shares.append((s, g, (*runs, (last, left))))
    base = plan_none(C_WN, LayerShape(8, 16, E, W, 2), FIXED)
    hot = tuple(sorted(holders))
    return Plan(hot, tuple((g, holders[g]) for g in hot), base.prediction, base.baseline,
                tuple(shares), rng.random() < 0.5, tuple(ranges), tuple(kept))  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_hand_made_plans(seed: int) -> None:
    """Explicit shares, ranges and kept holders together (checked plans), every rank."""
    rng = random.Random(seed)
    for _ in range(25):
        W, E = rng.randint(1, 7), rng.randint(1, 3)
        C_WN = _counts(rng, W, E)
        plan = _hand_made(rng, W, E, C_WN)
        plan.check_shares(C_WN, E, B)
        for r in range(W):
            _same(C_WN, plan, r, E)


def test_adversarial_counts() -> None:
    """All-zero counts, one hot expert holding every row, all counts tied, E = 1, W = 1."""
    rng = random.Random(5)
    for W, E in [(1, 1), (1, 3), (2, 1), (4, 2), (6, 1)]:
        N = W * E
        for C_WN in (torch.zeros(W, N, dtype=torch.int64),
                     torch.full((W, N), 2 * B, dtype=torch.int64),
                     torch.zeros(W, N, dtype=torch.int64).index_fill_(1, torch.tensor([N - 1]),
                                                                     9 * B)):  # fmt: skip
            for _ in range(4):
                plan = _hand_made(rng, W, E, C_WN)
                for r in range(W):
                    _same(C_WN, plan, r, E)


def _unchecked(rng: random.Random, W: int, E: int) -> Plan:
    """A random plan that passes ``Plan``'s own checks but not necessarily ``check_shares``:
    ranges of any amounts (a holder or not, the owner too), kept holders of any local rows,
    shares whose runs need not add up to the counts nor name holders."""
    N = W * E
    holders = _holders(rng, W, E, sorted(rng.sample(range(N), rng.randint(0, N))))
    ranged = sorted(rng.sample(range(N), rng.randint(0, min(3, N))))
    ranges, kept = [], []
    for g in ranged:
        pool = [*holders.get(g, ()), *(rng.sample(range(W), 1) if rng.random() < 0.2 else [])]
        pool = sorted(set(pool))
        ys = rng.sample(pool, rng.randint(0, len(pool)))
        if ys and rng.random() < 0.7:
            ranges.append((g, tuple((y, rng.randint(1, 6 * B)) for y in ys)))
        ks = rng.sample(pool, rng.randint(0, len(pool)))
        if ks and rng.random() < 0.5:
            kept.append((g, tuple(sorted((y, rng.randint(0, 3) * B) for y in ks))))
    shares = []
    for s in range(W):
        for g in range(N):
            if g not in ranged and rng.random() < 0.2:
                ranks = rng.sample(range(W), rng.randint(1, min(W, 3)))
                shares.append((s, g, tuple((c, rng.randint(1, 3 * B)) for c in ranks)))
    base = plan_none(torch.zeros(W, N, dtype=torch.int64), LayerShape(8, 16, E, W, 2), FIXED)
    hot = tuple(sorted(holders))
    return Plan(hot, tuple((g, holders[g]) for g in hot), base.prediction, base.baseline,
                tuple(shares), False, tuple(ranges), tuple(kept))  # fmt: skip


def test_unchecked_plans_same_result_or_same_error() -> None:
    """Plans ``check_shares`` would reject: the compiled part runs what the Python accepts and
    hands the rest to it (the same error). Both kinds occur."""
    rng = random.Random(11)
    seen: dict[str | None, int] = {}
    for _ in range(250):
        W, E = rng.randint(1, 5), rng.randint(1, 3)
        C_WN = _counts(rng, W, E)
        plan = _unchecked(rng, W, E)
        for r in range(W):
            kind = _same_or_same_error(C_WN, plan, r, E)
            seen[kind] = seen.get(kind, 0) + 1
    # ran; a run at r without a replica (KeyError); range entries Plan rejects (ValueError)
    assert seen.get(None, 0) > 100 and seen.get("KeyError") and seen.get("ValueError"), seen


def test_out_of_range_plans_fall_back() -> None:
    """Ranks or experts out of range, a holder that owns its expert, negative counts: the
    compiled part returns None and the Python does what it does."""
    C_WN = torch.tensor([[5, 0, 3, 1], [2, 9, 0, 4]])
    P = plan_none(C_WN, LayerShape(8, 16, 2, 2, 2), FIXED)
    bad = [
        Plan((1,), ((1, (5,)),), P.prediction, P.baseline),  # holder 5 of 2 ranks
        Plan((1,), ((1, (0,)),), P.prediction, P.baseline),  # expert 1's owner holds it
        Plan((), (), P.prediction, P.baseline, ((0, 7, ((1, 5),)),)),  # expert 7 of 4
        Plan((2,), ((2, (0,)),), P.prediction, P.baseline, ranges=((2, ((-1, 3),)),)),
    ]
    for plan in bad:
        assert native.step_fields(C_WN, plan, 0, 2) is None
        _same_or_same_error(C_WN, plan, 0, 2)
    negative = C_WN.clone()
    negative[0, 3] = -1
    assert native.step_fields(negative, P, 0, 2) is None
    assert native.step_fields(negative, P, 1, 2) is not None  # only r's row is read for signs


def test_fallbacks_give_the_same_plan(monkeypatch) -> None:
    """``MIXMOE_NATIVE=0``, an int32 C or one neither row-major nor by columns, a shape that is
    not [W, W*E] and an output buffer too small at first (the C entry asks for more: one more
    call). C stored by columns is read as it is: the same fields."""
    rng = random.Random(3)
    W, E = 4, 2
    C_WN = _counts(rng, W, E, zeros=0.1)
    plan = _hand_made(rng, W, E, C_WN)
    want = [step_plan_python(C_WN, plan, r, E) for r in range(W)]
    assert native.step_fields(C_WN.to(torch.int32), plan, 0, E) is None
    every_other = torch.zeros(W, 2 * W * E, dtype=torch.int64)[:, ::2]
    every_other.copy_(C_WN)
    assert native.step_fields(every_other, plan, 0, E) is None
    by_column = C_WN.T.contiguous().T  # read as it is (_same compares it with the Python)
    assert native.step_fields(by_column, plan, 0, E) is not None
    assert native.step_fields(C_WN, plan, 0, 3) is None
    calls = []
    real = lib.function("mixmoe_step_plan", native.I64, native._ARGTYPES)

    def counted(*args):
        calls.append(args[7])  # cap: the buffer's ints
        return real(*args)

    function = lib.function  # the other compiled parts (the relay plan) as they are
    monkeypatch.setattr(native, "_capacity", lambda *args: 3)
    monkeypatch.setattr(
        lib,
        "function",
        lambda name, *a: counted if name == "mixmoe_step_plan" else function(name, *a),
    )
    assert [build_step_plan(C_WN, plan, r, E) for r in range(W)] == want
    assert calls[0] == 3 and len(calls) == 2 * W
    monkeypatch.undo()
    monkeypatch.setenv("MIXMOE_NATIVE", "0")
    assert native.step_fields(C_WN, plan, 0, E) is None
    assert [build_step_plan(C_WN, plan, r, E) for r in range(W)] == want
