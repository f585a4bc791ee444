"""The compiled baseline, plan pricing and predictions (``mixmoe.placement.native_pricing``,
``native/pricing.cpp``) against their slow twins, the Python: ``counts_with_sums`` +
``baseline_loads``, ``plan_pricing`` (its list and its tensor code: ``LIST_PRICING_W``),
``prediction_lists`` and ``prediction_W``; every value compared exactly (ints as ints, floats
bit for bit by ``float.hex``), on the plans ``plan_mix`` really prices (and ``plan_shadow``'s,
``plan_replicas``', their relay variants) and on random plans with holders, ranges and kept
holders; plus every fallback to the Python.

Legend: W ranks, E experts per rank, N = W*E experts, C[s][g] = rows s routes to g.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixmoe.placement.cost_model as cost_model
import mixmoe.placement.native_lib as lib
import mixmoe.placement.native_pricing as native
import mixmoe.placement.planner as planner_module
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import CPU_PROFILE, GPU_PROFILE, HardwareProfile, LayerShape
from mixmoe.placement.cost_model import Prediction, plan_pricing, step_model
from mixmoe.placement.counts import baseline_loads, counts_with_sums
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import _NO_PREDICTION, plan_mix, plan_replicas, plan_shadow

P = _NO_PREDICTION
FIXED = dataclasses.replace(  # every fixed term set: row, replica and step overheads
    GPU_PROFILE, name="fixed", row_overhead_s=1e-8, replica_fixed_s=2e-5, step_fixed_s=1e-4
)
IB = HardwareProfile("ib-like", 593.4e12, 315e9, 15e-6)  # a fast link: plan_mix keeps rows
PROFILES = {"gpu": GPU_PROFILE, "cpu": CPU_PROFILE, "fixed": FIXED, "ib": IB}
ROUTINGS = ("uniform", "zipf:1.2", "zipf:2.0", "hot:0.3")
_planner_prediction = planner_module._prediction  # the wired one (the recorder replaces it)


def test_compiled_pricing_is_built_here():
    """Every machine with a C++ compiler runs the compiled pricing (a test that skipped here
    would hide a broken build)."""
    assert lib.available(), lib.unavailable_reason()
    assert native.SOURCE.exists()


def _python(monkeypatch: pytest.MonkeyPatch, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the compiled parts off (``MIXMOE_NATIVE=0``): the Python twin."""
    monkeypatch.setenv(lib.ENV_OFF, "0")
    try:
        return fn(*args, **kwargs)
    finally:
        monkeypatch.setenv(lib.ENV_OFF, "1")


def _exact(got: list, want: list) -> None:
    """Equal values of equal types; floats bit for bit (== would let -0.0 pass for 0.0)."""
    assert [type(x) for x in got] == [type(x) for x in want]
    key = [x.hex() if isinstance(x, float) else x for x in got]
    assert key == [x.hex() if isinstance(x, float) else x for x in want]


def _same_prediction(got: Prediction, want: Prediction) -> None:
    for f in dataclasses.fields(Prediction):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "step_s":
            a, b = [a], [b]
        else:
            assert type(a) is tuple and type(b) is tuple, f.name
        _exact(list(a), list(b))


def check_pricing(C_WN, plan, E, base_4W, colsum_N, sums=True) -> tuple[torch.Tensor, int]:
    """The compiled plan_pricing against the list code and the tensor code (with and, when
    ``sums``, without the column sums); returns the compiled (loads_4W, rounds)."""
    got = native.plan_loads(C_WN, plan, E, base_4W, colsum_N)
    assert got is not None
    loads, rounds = got
    assert loads.dtype == torch.float64 and loads.shape == (4, C_WN.shape[0])
    mp = pytest.MonkeyPatch()
    try:
        for width in (10**9, 0):  # the list code, then the tensor code
            mp.setattr(cost_model, "LIST_PRICING_W", width)
            for given in (colsum_N, None) if sums else (colsum_N,):
                want, want_rounds = _python(
                    mp, plan_pricing, C_WN, plan, E, base_4W=base_4W, colsum_N=given
                )
                assert rounds == want_rounds and type(rounds) is int
                _exact(loads.view(-1).tolist(), want.view(-1).tolist())
    finally:
        mp.undo()
    # the null column sums (summed in C++) and the wired plan_pricing give the same
    again, again_rounds = native.plan_loads(C_WN, plan, E, base_4W, None)
    assert again.tolist() == loads.tolist() and again_rounds == rounds
    wired, wired_rounds = plan_pricing(C_WN, plan, E, base_4W=base_4W, colsum_N=colsum_N)
    assert wired.tolist() == loads.tolist() and wired_rounds == rounds
    return loads, rounds


def check_prediction(model, loads_4W: torch.Tensor, rounds: int | None) -> Prediction:
    """The compiled prediction against prediction_W, prediction_lists (the copies as the
    planner reads them: whole ones as ints) and the planner's _prediction with the compiled
    part off; returns it."""
    got = native.prediction(model, loads_4W, rounds)
    assert got is not None
    _same_prediction(got, model.prediction_W(loads_4W, rounds))
    rows, local, remote = loads_4W[:3].to(torch.int64).tolist()
    replica = [int(x) if x.is_integer() else x for x in loads_4W[3].tolist()]
    _same_prediction(got, model.prediction_lists(rows, local, remote, replica, rounds))
    if rounds is not None:
        mp = pytest.MonkeyPatch()
        try:
            python = _python(mp, _planner_prediction, model, loads_4W, rounds)
        finally:
            mp.undo()
        _same_prediction(got, python)
        _same_prediction(got, _planner_prediction(model, loads_4W, rounds))
    return got


def check_baseline(C_WN: torch.Tensor, E: int) -> None:
    got = native.baseline(C_WN, E)
    assert got is not None
    W, N = C_WN.shape
    shape = LayerShape(8, 8, E, W, 2)
    _, colsum, rowsum = counts_with_sums(C_WN, shape)
    want = (*baseline_loads(C_WN, E, (colsum, rowsum)), rowsum)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    (C, colsum2, rowsum2), base = native.counted_baseline(C_WN, shape)
    assert C is C_WN and colsum2.tolist() == colsum.tolist() and rowsum2.tolist() == rowsum.tolist()
    assert [x.tolist() for x in base] == [x.tolist() for x in want[:3]]


def _recording(mp, seen: list) -> None:
    """plan_mix's pricings and predictions each checked against the Python (``seen``: the
    plans' (replicas, ranges, kept, relay) sizes)."""
    python_pricing, python_prediction = planner_module.plan_pricing, planner_module._prediction

    def pricing(C_WN, plan, E, profile=None, **kw):
        out = python_pricing(C_WN, plan, E, profile, **kw)
        if profile is None or getattr(profile, "ranks_per_node", None) is None:
            base = kw.get("base_4W")
            base = baseline_loads(C_WN, E)[0] if base is None else base
            loads, rounds = check_pricing(C_WN, plan, E, base, kw.get("colsum_N"), False)
            assert loads.tolist() == out[0].tolist() and rounds == out[1]
            seen.append((len(plan.replicas), len(plan.ranges), len(plan.kept), plan.relay))
        return out

    def prediction(model, loads_4W, rounds):
        out = python_prediction(model, loads_4W, rounds)
        _same_prediction(check_prediction(model, loads_4W, rounds), out)
        return out

    mp.setattr(planner_module, "plan_pricing", pricing)
    mp.setattr(planner_module, "_prediction", prediction)
    mp.setattr(
        planner_module, "planned", lambda *a: None
    )  # plan_mix's Python steps (the compiled whole, native_planner, runs none of them)


def _shapes(profile: str) -> list[tuple[int, LayerShape, int]]:
    """(W, shape, top-k): D1024 F4096 with E = 4..8, and DeepSeek-like (D2048 F1024 SwiGLU,
    256 experts, top-8), W = 2..160 (every size under GPU_PROFILE, a few under the others:
    test time)."""
    sizes = ((2, 8), (3, 5), (8, 4), (16, 8), (64, 6), (160, 4))
    out = [(W, LayerShape(1024, 4096, E, W, 2), 2) for W, E in sizes]
    out += [(W, LayerShape(2048, 1024, 256 // W, W, 2, gemms_per_expert=3), 8) for W in (8, 64)]
    return out if profile == "gpu" else [*out[:4:2], out[4], out[-2]]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_plan_mix_pricings_equal(monkeypatch, profile):
    """Every plan_pricing and _prediction call of plan_mix (the shadow candidate, the relayed
    best, the fills' starts, the winner with ranges and kept holders), and the pricing of
    plan_shadow's and plan_replicas' plans with and without relay, on synthetic counts."""
    prof = PROFILES[profile]
    seen: list = []
    _recording(monkeypatch, seen)
    for i, (W, shape, k) in enumerate(_shapes(profile)):
        N = shape.num_experts
        for routing in ROUTINGS:
            gen = torch.Generator().manual_seed(10 * i + len(routing))
            C = synthetic_counts(RoutingSpec.parse(routing), W, 8192, k, N, gen,
                                 shuffle_experts=True)  # fmt: skip
            plan_mix(C, shape, prof, 4)
            C_WN, *sums = counts_with_sums(C, shape)
            base_4W, colsum_N, _ = baseline_loads(C_WN, shape.experts_per_rank, sums)
            check_baseline(C_WN, shape.experts_per_rank)
            model = step_model(shape, prof, True)
            for plan in (plan_shadow(C, shape, prof), plan_replicas(C, shape, prof, 8, True)):
                for relay in (False, True):
                    relayed = dataclasses.replace(plan, relay=relay)
                    loads, rounds = check_pricing(
                        C_WN, relayed, shape.experts_per_rank, base_4W, colsum_N
                    )
                    check_prediction(model, loads, rounds)
                    check_prediction(model, loads, None)
    ranged = [s for s in seen if s[1] or s[2]]
    assert len(seen) >= 10 and len(ranged) >= 3, (len(seen), len(ranged))
    assert any(s[2] for s in seen) or profile != "ib"  # a kept fill's plan priced


@st.composite
def _plans(draw):
    """(C_WN, E, plan): random counts (zeros, an empty rank, one hot expert, ties), random
    hot experts and holders (some with none), kept holders with local rows below their count,
    helpers with random amounts (any: the arithmetic takes any), with or without relay."""
    W = draw(st.integers(1, 12))
    E = draw(st.integers(1, 3))
    N = W * E
    gen = torch.Generator().manual_seed(draw(st.integers(0, 10**6)))
    kind = draw(st.sampled_from(["random", "zeros", "empty-rank", "one-hot", "ties"]))
    C = torch.randint(0, 200, (W, N), generator=gen)
    C[torch.rand(W, N, generator=gen) < 0.3] = 0
    if kind == "zeros":
        C.zero_()
    elif kind == "empty-rank":
        C[draw(st.integers(0, W - 1))] = 0
    elif kind == "one-hot":
        C.zero_()
        C[:, draw(st.integers(0, N - 1))] = torch.randint(0, 5000, (W,), generator=gen)
    elif kind == "ties":
        C.fill_(64)
    hot = sorted(draw(st.sets(st.integers(0, N - 1), max_size=4)))
    replicas, ranges, kept = [], [], []
    for g in hot:
        others = [r for r in range(W) if r != g // E]
        holders = sorted(draw(st.sets(st.sampled_from(others)))) if others else []
        replicas.append((g, tuple(holders)))  # empty holders allowed: Plan takes them
        keep = {y: draw(st.integers(0, int(C[y, g]) - 1)) for y in holders
                if C[y, g] and draw(st.booleans())}  # fmt: skip
        if keep:
            kept.append((g, tuple(sorted(keep.items()))))
        helpers = [y for y in draw(st.permutations(holders)) if y not in keep]
        amounts = tuple((y, draw(st.integers(1, 400))) for y in helpers[: draw(st.integers(0, 3))])
        if amounts:
            ranges.append((g, amounts))
    plan = Plan(tuple(hot), tuple(replicas), P, P, relay=draw(st.booleans()),
                ranges=tuple(ranges), kept=tuple(kept))  # fmt: skip
    return C.contiguous(), E, plan


@settings(max_examples=250, deadline=None)
@given(_plans(), st.booleans(), st.sampled_from(list(PROFILES)), st.booleans())
def test_random_plans_equal(case, with_sums, profile, overlap) -> None:
    C_WN, E, plan = case
    check_baseline(C_WN, E)
    base_4W, colsum_N, _ = baseline_loads(C_WN, E)
    loads, rounds = check_pricing(C_WN, plan, E, base_4W, colsum_N if with_sums else None)
    model = step_model(LayerShape(256, 512, E, C_WN.shape[0], 2), PROFILES[profile], overlap)
    check_prediction(model, loads, rounds)
    check_prediction(model, loads, None)
    check_prediction(model, base_4W, 0)


def test_predictions_of_random_loads_equal():
    """Random loads (remote rows anywhere or nowhere, whole and fractional copies, rounds
    0-3 and None) under models with random terms, and copies whose bytes fall exactly half
    way between two ints (Python's round: to even)."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    ties = 0
    for i in range(120):
        W = rng.choice([1, 2, 7, 64, 300])
        shape = LayerShape(rng.choice([64, 1024]), rng.choice([256, 4096]), 2, W, 2)
        prof = HardwareProfile("r", rng.choice([1e12, 3e14]), rng.choice([1e9, 5e10]),
                               rng.choice([1e-9, 2e-5]), row_overhead_s=rng.choice([0.0, 3e-9]),
                               replica_fixed_s=rng.choice([0.0, 1e-5]),
                               step_fixed_s=rng.choice([0.0, 1e-4]))  # fmt: skip
        model = step_model(shape, prof, rng.random() < 0.5)
        if i % 4 == 0:  # params of 2**22 bytes: an odd multiple of 2**-24 copies -> x.5 bytes
            model = copy.copy(model)
            model.params_bytes = 2**22
            model._factor_41 = model._factor_41.clone()  # seconds_W's copy of the term
            model._factor_41[3] = 2**22
        loads = torch.randint(0, 10**6, (4, W), generator=gen).to(torch.float64)
        if rng.random() < 0.3:
            loads[2] = 0  # no remote row anywhere: no token collectives
        grid = torch.randint(0, 2**26, (W,), generator=gen).to(torch.float64) / 2**24
        loads[3] = torch.where(torch.rand(W, generator=gen) < 0.5, grid, loads[3] % 9)
        if rng.random() < 0.2:
            loads[3] = 0
        rounds = rng.choice([None, 0, 1, 2, 3])
        got = check_prediction(model, loads, rounds)
        fractions = [x * 2 * model.params_bytes for x in loads[3].tolist() if not x.is_integer()]
        ties += sum(1 for b in fractions if b % 1 == 0.5)
        assert got.step_s == max(map(float.__add__, got.compute_s, got.comm_s))
    assert ties >= 20  # the half-way bytes were met


def test_negative_counts_and_odd_layouts_fall_back():
    """``baseline`` gives None for a negative count (the caller's Python raises its error) and
    for counts not int64, row-major or by columns; the other entries for counts not int64 and
    row-major."""
    C = torch.randint(0, 9, (4, 8))
    C[2, 5] = -1
    assert native.baseline(C, 2) is None
    with pytest.raises(ValueError, match=r"counts_WN\[2\]\[5\] = -1 is negative"):
        counts_with_sums(C, LayerShape(8, 8, 2, 4, 2))
    assert native.counted_baseline(C, LayerShape(8, 8, 2, 4, 2)) is None
    C[2, 5] = 2**40  # above int32: the sign of every int64, not of its words
    check_baseline(C, 2)
    C5 = torch.randint(0, 9, (5, 10))
    C5[4, 7] = -(2**40)  # in a row past the blocks of eight rows (W % 8)
    assert native.baseline(C5, 2) is None
    assert native.baseline(C5[:, :8].contiguous(), 2) is None  # N != W * E: not read
    shape = LayerShape(8, 8, 2, 4, 2)  # counts not in the validated form: the Python checks
    every_other = torch.zeros(4, 16, dtype=torch.int64)[:, ::2]  # neither layout
    every_other.copy_(C)
    for odd in (C.tolist(), C.to(torch.int32), every_other, C[:3]):
        assert native.counted_baseline(odd, shape) is None
    C = torch.randint(0, 9, (4, 8))
    base_4W, colsum_N, _ = baseline_loads(C, 2)
    plan = Plan((3,), ((3, (0, 2)),), P, P, relay=True)
    assert native.baseline(every_other, 2) is None  # strided counts
    assert native.baseline(C.to(torch.int32), 2) is None
    assert native.plan_loads(C.to(torch.int32), plan, 2, base_4W, colsum_N) is None
    assert native.plan_loads(C, plan, 2, base_4W.to(torch.float32), colsum_N) is None
    assert native.plan_loads(C, plan, 2, base_4W, colsum_N.to(torch.int32)) is None
    assert native.plan_loads(C, plan, 2, base_4W, colsum_N) is not None


def test_baseline_pass_blocks_tails_and_every_negative_count():
    """``native/pricing.cpp``'s pass over C reads eight rows at a time in steps of eight columns
    (four two-lane vectors per row), then the last W % 8 rows one by one and the last N % 8
    columns count by count. Every part of that split is compared with the Python: W below,
    at and past multiples of 8 and N = W*E with and without a column tail, on counts above
    int32; and a negative count at every position of such matrices (each row of a block and
    of the tail, each lane of each vector, the column tail) must give None, as the Python
    raises."""
    gen = torch.Generator().manual_seed(26)
    for W, E in ((7, 1), (8, 1), (9, 3), (16, 2), (17, 5), (24, 3), (31, 4), (40, 8)):
        C = torch.randint(0, 2**40, (W, W * E), generator=gen)  # past int32: int64 lanes
        C[torch.rand(W, W * E, generator=gen) < 0.2] = 0
        check_baseline(C, E)
    for W, E in ((11, 3), (17, 1), (16, 1)):  # N % 8 = 1, 1, 0; W % 8 = 3, 1, 0
        C = torch.randint(0, 9, (W, W * E), generator=gen)
        shape = LayerShape(8, 8, E, W, 2)
        for s in range(W):
            for g in range(W * E):
                C[s, g] = -1 if (s + g) % 2 else -(2**40)  # every bit set; the low 32 bits clear
                assert native.baseline(C, E) is None, (W, E, s, g)
                C[s, g] = 3
        check_baseline(C, E)
        C[W - 1, W * E - 1] = -1
        with pytest.raises(ValueError, match="is negative"):
            counts_with_sums(C, shape)


def test_plans_the_python_must_price_fall_back():
    """A relayed expert whose holders include its owner (the Python raises, compiled or not),
    an index out of range, or an entry that is no int: ``plan_loads`` gives None and
    ``plan_pricing`` runs the Python."""
    C = torch.randint(1, 9, (4, 4))
    base_4W, colsum_N, _ = baseline_loads(C, 1)
    bad = Plan((0,), ((0, (1, 2)),), P, P, relay=True)
    object.__setattr__(bad, "replicas", ((0, (0, 2)),))  # past Plan's own check
    assert native.plan_loads(C, bad, 1, base_4W, colsum_N) is None
    with pytest.raises(ValueError, match="exclude owner"):
        plan_pricing(C, bad, 1)
    unrelayed = dataclasses.replace(bad, relay=False)  # the replica rule prices it as is
    object.__setattr__(unrelayed, "replicas", ((0, (0, 2)),))
    check_pricing(C, unrelayed, 1, base_4W, colsum_N)
    far = Plan((0,), ((0, (1, 9)),), P, P)  # rank 9 of 4
    assert native.plan_loads(C, far, 1, base_4W, colsum_N) is None
    with pytest.raises(IndexError):
        plan_pricing(C, far, 1)
    helper = Plan((0,), ((0, (1,)),), P, P, ranges=((0, ((7, 4),)),))
    assert native.plan_loads(C, helper, 1, base_4W, colsum_N) is None
    odd = Plan((0,), ((0, (1,)),), P, P, ranges=((0, ((1, 2.5),)),))
    assert native.plan_loads(C, odd, 1, base_4W, colsum_N) is None
    assert plan_pricing(C, odd, 1)[0][0, 1] % 1 == 0.5  # the Python's arithmetic


def test_predictions_the_python_must_make_fall_back(monkeypatch):
    """Byte counts past int64 (Python's ints are unbounded), a model term of another type, and
    ``MIXMOE_NATIVE=0``: ``prediction`` gives None; the planner's _prediction is the Python's."""
    shape = LayerShape(1024, 4096, 2, 4, 2)
    model = step_model(shape, GPU_PROFILE, True)
    loads = torch.tensor([[5.0, 6, 7, 8], [1, 2, 3, 4], [2**50, 0, 9, 1], [0, 1, 2, 0.5]])
    loads = loads.to(torch.float64)
    assert native.prediction(model, loads, 1) is None
    want = model.prediction_W(loads, 1)
    _same_prediction(planner_module._prediction(model, loads, 1), want)
    assert want.token_bytes[0] >= 2**63  # a Python int past int64
    loads[2, 0] = 10
    assert native.prediction(model, loads, 1) is not None
    odd = copy.copy(model)
    odd.gemm_flops = int(model.gemm_flops)  # an int: Python's int / int is another division
    assert native.prediction(odd, loads, 1) is None
    monkeypatch.setenv(lib.ENV_OFF, "0")
    assert native.prediction(model, loads, 1) is None
    C = torch.randint(0, 9, (4, 8))
    assert native.baseline(C, 2) is None
    assert native.plan_loads(C, Plan((), (), P, P), 2, baseline_loads(C, 2)[0], None) is None


def test_plan_mix_unchanged_without_the_compiled_parts(monkeypatch):
    """plan_mix's plan is the same with the compiled parts on and off."""
    for routing in ("zipf:1.2", "hot:0.3"):
        C = synthetic_counts(RoutingSpec.parse(routing), 16, 4096, 2, 64,
                             torch.Generator().manual_seed(7))  # fmt: skip
        shape = LayerShape(1024, 4096, 4, 16, 2)
        compiled = plan_mix(C, shape, GPU_PROFILE, 4)
        python = _python(monkeypatch, plan_mix, C, shape, GPU_PROFILE, 4)
        assert compiled == python
        _same_prediction(compiled.prediction, python.prediction)
