"""The compiled replica fetch bookkeeping (``dispatch/relay_native.py``,
``placement/native/relay_plan.cpp``) against its slow twin, ``replicas.relay_plan_python``:
the same ``RelayPlan`` (pack, every round's sends, splits and receives, the slots) for every
rank, on one link and on nodes, relayed and fanned out flat, from hand-made replicas and the
planner's; the Python's errors where the C++ declines.
"""

from __future__ import annotations

import copy
import gc
import pickle
import random

import pytest
import torch

import mixmoe.dispatch.relay_native as native
import mixmoe.dispatch.replicas as replicas_module
import mixmoe.placement.native_lib as lib
from mixmoe.dispatch.replicas import RelayPlan, relay_plan_python
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import LayerShape, plan_mix
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.relay import node_distance, nodes_of


def _same(replicas, r: int, W: int, E: int, distance, relay: bool) -> RelayPlan:
    """The compiled part ran (no fallback) and built the Python's plan exactly (its rounds and
    slots decoded from the compiled output when first read)."""
    assert native.relay_plan_fields(replicas, r, W, E, distance, relay) is not None
    got = RelayPlan.build(replicas, r, W, E, distance, relay=relay)
    want = relay_plan_python(replicas, r, W, E, distance, relay)
    assert got.decoded is None and want.decoded is not None
    assert (got.pack_local_ids, got.num_rounds, got.recv_experts) == (
        want.pack_local_ids, want.num_rounds, want.recv_experts)  # fmt: skip
    assert got == want, (r, W, E, replicas)
    assert repr(got) == repr(want)
    return got


def _replicas(W: int, E: int, rng: random.Random, p: float):
    """A random set of hot experts, each with a random holder set (never the owner), by g;
    holders in random order (the plan's are ascending: the route sorts them either way)."""
    out = []
    for g in range(W * E):
        others = [h for h in range(W) if h != g // E]
        if others and rng.random() < p:
            out.append((g, tuple(rng.sample(others, rng.randint(1, len(others))))))
    return tuple(out)


def test_compiled_relay_plan_is_built_here():
    """Every machine with a C++ compiler runs the compiled part (a skip would hide a broken
    build)."""
    assert lib.available(), lib.unavailable_reason()
    assert lib.function("mixmoe_relay_plan", lib.I64, native._ARGTYPES) is not None


@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize(
    "W,E,per_node",
    [(1, 2, 0), (2, 1, 0), (3, 2, 0), (5, 1, 0), (4, 2, 2), (4, 1, 1), (6, 1, 2), (9, 2, 3),
     (12, 1, 4), (16, 1, 4), (17, 2, 4), (24, 1, 8), (33, 1, 3)],
)  # fmt: skip
def test_every_rank_builds_the_python_plan(W, E, per_node, relay):
    """Random replicas (sparse to dense), every rank: near scatters, far nodes of unequal fill
    (blocks of different lengths), single far holders, a far node of one."""
    rng = random.Random(1000 * W + 10 * E + per_node)
    distance = nodes_of(per_node) if per_node else None
    for p in (0.1, 0.5, 1.0):
        replicas = _replicas(W, E, rng, p)
        for r in range(W):
            _same(replicas, r, W, E, distance, relay)


@pytest.mark.parametrize("profile", ["gpu", "h100-nvlink-ib"])
@pytest.mark.parametrize("W", [64, 256])
def test_planner_plans_build_the_python_plan(profile, W):
    """The planner's replicas at zipf:1.2 (hot experts with tens to hundreds of holders): the
    first, a third, the last rank, and every holder of the widest replica."""
    E = 4
    C = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, W * E,
                         torch.Generator().manual_seed(W), shuffle_experts=True)  # fmt: skip
    shape = LayerShape(1024, 4096, E, W, bytes_per_element=2)
    prof = load_profile(profile)
    plan = plan_mix(C, shape, prof, 4)
    assert plan.replicas
    wide = max(plan.replicas, key=lambda gh: len(gh[1]))
    ranks = {0, W // 3, W - 1, wide[0] // E, *wide[1][:: max(1, len(wide[1]) // 8)]}
    for r in sorted(ranks):
        _same(plan.replicas, r, W, E, node_distance(prof), plan.relay)


def test_no_replicas_and_one_rank():
    for relay in (True, False):
        _same((), 0, 4, 2, None, relay)
        _same((), 0, 1, 2, None, relay)
        _same(((1, ()),), 0, 4, 2, nodes_of(2), relay)  # a replica with no holders


@pytest.mark.parametrize(
    "replicas,W",
    [(((0, (0, 1)),), 3), (((0, (1, 1)),), 3), (((0, (1, 5)),), 3), (((9, (1,)),), 3),
     (((0, (-1,)),), 3), (((0, (1.5,)),), 3)],
)  # fmt: skip
@pytest.mark.parametrize("relay", [True, False])
def test_bad_replicas_fall_back_to_the_python(replicas, W, relay):
    """A holder that owns the expert, repeats, lies outside [0, W), an expert outside [0, N), a
    holder that is no int: the compiled part declines, and ``build`` does what the Python does
    (the same error, or the same plan)."""
    assert native.relay_plan_fields(replicas, 1, W, 1, None, relay) is None
    try:
        want = relay_plan_python(replicas, 1, W, 1, None, relay)
    except Exception as err:  # noqa: BLE001 (any error the Python raises, the same one)
        with pytest.raises(type(err)) as got:
            RelayPlan.build(replicas, 1, W, 1, None, relay=relay)
        assert str(got.value) == str(err)
        return
    assert RelayPlan.build(replicas, 1, W, 1, None, relay=relay) == want


def test_other_topologies_run_the_python():
    """A distance that is not ``nodes_of``'s (pairwise, no ranks_per_node): the Python."""

    def pairwise(a: int, b: int) -> int:
        return int(a // 2 != b // 2)

    replicas = ((0, (1, 2, 3, 5)),)
    assert native.relay_plan_fields(replicas, 2, 6, 1, pairwise, True) is None
    got = RelayPlan.build(replicas, 2, 6, 1, pairwise)
    assert got == relay_plan_python(replicas, 2, 6, 1, pairwise, True)


def test_a_short_first_buffer_is_grown(monkeypatch):
    """The C++ reports a short output buffer with the size it needs; the second call fits."""
    monkeypatch.setattr(native, "_capacity", lambda W, size: 1)
    replicas = _replicas(12, 2, random.Random(3), 0.5)
    for r in range(12):
        _same(replicas, r, 12, 2, nodes_of(4), True)


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_state_is_restored(enabled):
    """The collector is paused while the tuples are built, then as it was."""
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        _same(_replicas(9, 1, random.Random(4), 0.5), 4, 9, 1, nodes_of(3), True)
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def _layouts_equal(plan: RelayPlan, Q: int) -> None:
    """The compiled layout ran and equals the Python's, field by field."""
    assert plan.compiled is not None
    got = native.relay_layout(plan.compiled, Q)
    assert got is not None
    decoded = RelayPlan.of(plan.pack_local_ids, plan.rounds, plan.slot_pieces, plan.recv_experts)
    twin = replicas_module._Layout(decoded, Q)
    assert got == (twin.sends, twin.splits, twin.slots, twin.compact, twin.cuts), (Q, plan)
    used = replicas_module._Layout(plan, Q)  # what the fetch builds: the compiled one
    assert (used.sends, used.splits, used.slots, used.compact, used.cuts) == got
    assert used.index == twin.index


@pytest.mark.parametrize("Q", [1, 2, 7, 64, 1001])
@pytest.mark.parametrize("W,E,per_node", [(3, 2, 0), (5, 1, 0), (9, 2, 3), (12, 1, 4), (17, 1, 4)])
def test_compiled_layout_is_the_python_layout(W, E, per_node, Q):
    """Every rank's fetch layout (merged spans, element splits, cuts), relayed and fanned out,
    for rows shorter than their chunk count too (Q = 1, 2: empty chunks)."""
    rng = random.Random(7 * W + per_node + Q)
    distance = nodes_of(per_node) if per_node else None
    for p in (0.3, 1.0):
        reps = _replicas(W, E, rng, p)
        for relay in (True, False):
            for r in range(W):
                _layouts_equal(RelayPlan.build(reps, r, W, E, distance, relay=relay), Q)


def test_compiled_layout_of_planner_plans():
    """The planner's plan at W = 256 under nodes (the merges of a far holder's runs)."""
    W, E = 256, 4
    C = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, W * E,
                         torch.Generator().manual_seed(1), shuffle_experts=True)  # fmt: skip
    prof = load_profile("h100-nvlink-ib")
    plan = plan_mix(C, LayerShape(1024, 4096, E, W, bytes_per_element=2), prof, 4)
    for r in (0, W // 3, W - 1):
        fetch = RelayPlan.build(plan.replicas, r, W, E, node_distance(prof), relay=plan.relay)
        _layouts_equal(fetch, 3 * 1024 * 4096 + 1)


def test_a_short_layout_buffer_is_grown(monkeypatch):
    """The compiled layout's first output buffer too small: the C++ says how much it needs."""
    real = lib.function
    sizes = []

    def small(name, *args):
        fn = real(name, *args)
        if name != "mixmoe_relay_layout":
            return fn

        def call(plan, size, W, Q, out, cap):
            sizes.append(cap)
            return fn(plan, size, W, Q, out, 2 if len(sizes) == 1 else cap)

        return call

    plan = RelayPlan.build(_replicas(12, 1, random.Random(5), 1.0), 3, 12, 1, nodes_of(4))
    want = native.relay_layout(plan.compiled, 50)
    monkeypatch.setattr(lib, "function", small)
    assert native.relay_layout(plan.compiled, 50) == want
    assert len(sizes) == 2


def test_a_compiled_plan_copies_and_pickles():
    """The dispatcher keeps its last fetch's plan and is copied or pickled with it (its
    ``__getstate__``): the compiled output travels as plain ints, and the copy's layout is the
    original's."""
    plan = RelayPlan.build(_replicas(9, 1, random.Random(6), 1.0), 4, 9, 1, nodes_of(3))
    assert plan.compiled is not None
    for copied in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert copied == plan
        assert native.relay_layout(copied.compiled, 33) == native.relay_layout(plan.compiled, 33)
