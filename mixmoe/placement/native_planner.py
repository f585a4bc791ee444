"""``plan_mix`` compiled whole: ``native/plan_mix.cpp`` in the planner's library (``native_lib``).

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN.

At W <= 64 the Python ``plan_mix`` is a few milliseconds of small steps (candidates, pricing,
fills, plan building: each ~0.1-1 ms of interpreter work), ~10x its target of 0.25 ms; the C++
runs the same steps with the same arithmetic (``native/common.h``), so it returns the same
``Plan``, floats bit for bit (``tests/placement/test_native_planner.py`` compares them with the
Python path under ``MIXMOE_NATIVE=0``). ``planned`` returns None where the C++ does not run (the
caller then plans in Python): the library unavailable or off (``native_lib``), counts that are
not a tensor, ``fill="moves"``, a topology whose ``distance`` is not ``relay.nodes_of``'s, model
terms not of the types the exact products assume, or counts the Python rejects (negative, too
large for exact arithmetic: its error is raised there). With a topology (``relay.node_distance``
not None) the C++ prices every candidate and fill on the 6 loads rows as ``plan_pricing`` does
(``native/pricing_nodes.cpp``; ``tests/placement/test_native_planner_nodes.py``).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from array import array
from itertools import islice

import torch

from mixmoe.placement import native_lib
from mixmoe.placement.cost_model import LayerShape, Prediction, step_model
from mixmoe.placement.counts import (
    BAD_SUMS,
    CountSums,
    counts_storage,
    raise_bad_sums,
    sums_pointers,
)
from mixmoe.placement.native_lib import P as _P
from mixmoe.placement.native_pricing import count_sums
from mixmoe.placement.plan import Plan
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.relay import node_distance
from mixmoe.placement.shadow import shadow_terms

__all__ = ["HOT_MOVED", "planned", "refitted"]

_ARGTYPES = [_P, _P, _P, _P, ctypes.c_int64, _P, _P, _P, _P, ctypes.c_int64]
_REFIT_ARGTYPES = [_P, _P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int64,
                   _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]  # fmt: skip
HOT_MOVED = "hot experts moved"  # refitted's answer when they did (its ``moved`` test)

_DOUBLE = struct.Struct("d")  # the step after a prediction's reals
_OUTPUT = threading.local()  # this thread's output arrays, reused call after call


def planned(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    slots: int,
    overlap: bool,
    search_width: int,
    block_size: int,
    balance: bool,
    constants: tuple[float, float, float, int, float, float, int],
    sums: CountSums | None = None,
) -> Plan | None:
    """``plan_mix(counts_WN, shape, profile, max_replicas, overlap, search_width=...,
    block_size=..., balance=..., fill="level", sums=...)``, compiled; ``slots``: its
    ``replica_slots``; ``constants``: the planner's (BALANCED, FILL_STOP, SPREAD_WHEN,
    LEVEL_PASSES, THIN_WHEN, THIN_GAIN, THIN_ALWAYS); ``sums``: C's ``CountSums`` (no pass over C) or None.
    None where the compiled planner does not run (module doc)."""
    if not isinstance(counts_WN, torch.Tensor):
        return None
    fn = native_lib.function("mixmoe_plan_mix", ctypes.c_int64, _ARGTYPES)
    if fn is None:
        return None
    args = _settings((shape, profile, slots, overlap, search_width, block_size, balance,
                      constants))  # fmt: skip
    if args is None:
        return None
    ints, reals = args
    C_WN, by_column = counts_storage(counts_WN, shape)  # the checks but the signs (the C++'s)
    W, N = shape.world_size, shape.num_experts
    colsum, rowsum = (None, None) if sums is None else sums_pointers(sums, W, N)
    # each rank holds at most `slots` replicas: holders, ranges and kept entries are bounded
    # by W * slots, their groups by N each; the sections come twice (by columns, then packed)
    out_i, out_d, counts = _output(2 * (6 * N + 5 * W * slots) + 6 * W + 16, 4 * W + 2)
    status = fn(
        C_WN.data_ptr(), ints, reals, ctypes.addressof(out_i), len(out_i),
        ctypes.addressof(out_d), counts, colsum, rowsum, by_column,
    )  # fmt: skip
    return _decoded(status, W, out_i, out_d, counts)


def refitted(
    plan: Plan,
    before_WN: object,
    after_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    overlap: bool,
    block_size: int,
    before_sums: CountSums | None = None,
    after_sums: CountSums | None = None,
    moved: int = 0,
) -> Plan | str | None:
    """``refit.refit_plan(plan, before_WN, after_WN, ...)``, compiled (``plan_mix.cpp``'s
    ``mixmoe_refit_plan``), for a plan the compiled planner made (``Plan.packed``); the same
    Plan (``tests/placement/test_placement_refit.py`` compares them). ``before_sums``: the
    counts before's ``CountSums`` (else their column sums are taken here); ``after_sums``: the
    counts after's (no pass over them). ``moved`` > 0: ``HOT_MOVED`` instead of a plan when
    the hot experts' rows fell below 1/moved of their share (``refit.moved``). None where it
    does not run: no ``packed``, counts not tensors, the library off, a topology or model
    terms the compiled planner does not take, counts the Python rejects (its error is raised
    there)."""
    if plan.packed is None or not isinstance(before_WN, torch.Tensor):
        return None
    if not isinstance(after_WN, torch.Tensor):
        return None
    fn = native_lib.function("mixmoe_refit_plan", ctypes.c_int64, _REFIT_ARGTYPES)
    if fn is None:
        return None
    # the settings' ints and reals as plan_mix's (the refit reads W, E, the block, the model,
    # the nodes; the search's settings are not read)
    args = _settings(
        (shape, profile, 0, overlap, 1, block_size, True, (1.0, 1.0, 1.0, 0, 1.0, 0.0, 0))
    )
    if args is None:
        return None
    ints, reals = args
    before, before_by_column = counts_storage(before_WN, shape)
    after, after_by_column = counts_storage(after_WN, shape)
    W, N = shape.world_size, shape.num_experts
    if before_sums is None:  # one compiled pass (torch's sum(0) took ~2.5x: 4.4 ms at [1024, 4096])
        before_sums = count_sums(before, shape.experts_per_rank)
    if before_sums is None:
        colsum1 = before.sum(0)
    else:
        sums_pointers(before_sums, W, N)  # checked: types and shapes
        colsum1 = before_sums.colsum_N
    colsum, rowsum = (None, None) if after_sums is None else sums_pointers(after_sums, W, N)
    need = 2 * (len(plan.packed) + 2 * N) + 6 * W + 16  # the plan's sections grow by cuts only
    out_i, out_d, counts = _output(need, 4 * W + 2)
    status = fn(
        after.data_ptr(), before.data_ptr(), colsum1.data_ptr(), ints, reals,
        plan.packed.buffer_info()[0], len(plan.packed), int(plan.relay),
        ctypes.addressof(out_i), len(out_i), ctypes.addressof(out_d), counts, colsum, rowsum,
        moved, before_by_column, after_by_column,
    )  # fmt: skip
    if status == -5:  # a plan the C++ does not read: the Python fits it
        return None
    if status == -6:
        return HOT_MOVED
    # the fit keeps the plan's holders (or drops them all): its replicas section is the plan's
    # (read from plan.packed, written from them), so it is not decoded again (W = 1024 under
    # nodes: ~5,000 holders, ~0.1 ms of the fit that a plan_ahead step waits for)
    return _decoded(status, W, out_i, out_d, counts, plan.replicas)


def _decoded(
    status: int, W: int, out_i, out_d, counts, same_replicas: tuple | None = None
) -> Plan | None:
    """The C entries' plan (``mixmoe_plan_mix``'s output), or None / an error for ``status``.
    ``same_replicas``: the replicas the output's are when it has any (checked by their
    experts), not decoded again."""
    if status == BAD_SUMS:
        raise_bad_sums()
    if status in (-1, -2):  # negative or too large counts: the Python raises its error
        return None
    if status != 0:  # cannot happen with the capacity above (the C++ counts before writing)
        raise RuntimeError(f"native plan_mix: status {status}")
    n_rep, n_ranges, n_kept, relay, m_rep, m_ranges, m_kept = counts
    at = n_rep + n_ranges + n_kept
    ints = memoryview(out_i).cast("B").cast("q")
    if m_rep and same_replicas is not None:  # the groups' experts come first: the same ones
        if ints[:m_rep].tolist() != [g for g, _ in same_replicas]:
            raise RuntimeError("native refit: its replicas are not the plan's")
        flat, off = ints[n_rep:at].tolist(), 0
        replicas = same_replicas
    else:
        flat, off = ints[:at].tolist(), n_rep
        replicas = _groups(flat, 0, n_rep, m_rep, 1)
    ranges = _groups(flat, off, n_ranges, m_ranges, 2)
    kept = _groups(flat, off + n_ranges, n_kept, m_kept, 2)
    prediction = _prediction(out_i, 8 * at, out_d, 0, W)
    baseline = _prediction(out_i, 8 * (at + 3 * W), out_d, 8 * (2 * W + 1), W)
    packed = array("q")  # the step's bookkeeping reads it as it is (``Plan.packed``)
    start = 8 * (at + 6 * W)
    packed.frombytes(memoryview(out_i).cast("B")[start : start + 8 * (at + 4)])
    # the twin tests rebuild every compiled plan through Plan's checks (Plan.unchecked's doc)
    return Plan.unchecked(replicas, prediction, baseline, bool(relay), ranges, kept, packed)


def _settings(key: tuple) -> tuple[ctypes.Array, ctypes.Array] | None:
    """``_arguments(key)``, built for this call only where the key does not hash (a profile
    subclass's unhashable field)."""
    try:
        return _arguments(key)
    except TypeError:
        return _arguments.__wrapped__(key)


@functools.lru_cache(maxsize=64)
def _arguments(key: tuple) -> tuple[ctypes.Array, ctypes.Array] | None:
    """The C entry's ints and reals for ``key``, ``planned``'s settings (shape, profile, slots,
    overlap, search_width, block_size, balance, constants): the same every step of a run, so
    built once (~25 us a call at W = 64); None where the compiled planner does not run."""
    shape, profile, slots, overlap, search_width, block_size, balance, constants = key
    model = step_model(shape, profile, overlap)
    terms = native_lib.model_args(model)
    if terms is None:
        return None
    per_node, bw_inter = 0, 0.0  # one link
    distance = node_distance(profile)
    if distance is not None:  # nodes of per_node consecutive ranks (relay.nodes_of's form only)
        per_node = getattr(distance, "ranks_per_node", None)
        bw_inter = model.bw_inter
        if type(per_node) is not int or per_node < 1 or type(bw_inter) is not float:
            return None
    W, E = shape.world_size, shape.experts_per_rank
    balanced, fill_stop, spread_when, passes, thin_when, thin_gain, thin_always = constants
    model_i, model_d = terms
    ints = [W, E, slots, search_width, block_size, passes, int(balance), *model_i, per_node,
            thin_always]  # fmt: skip
    reals = [*model_d, balanced, fill_stop, spread_when, *shadow_terms(shape, profile), bw_inter,
             thin_when, thin_gain]  # fmt: skip
    return (ctypes.c_int64 * len(ints))(*ints), (ctypes.c_double * len(reals))(*reals)


def _output(n_i: int, n_d: int) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
    """This thread's output arrays: at least ``n_i`` int64 and ``n_d`` float64, and the seven
    section counts (the plan is copied out before ``planned`` returns, so one set per thread
    serves every call; the planner's background thread has its own)."""
    have = getattr(_OUTPUT, "arrays", None)
    if have is None or len(have[0]) < n_i or len(have[1]) < n_d:
        have = ((ctypes.c_int64 * n_i)(), (ctypes.c_double * n_d)(), (ctypes.c_int64 * 7)())
        _OUTPUT.arrays = have
    return have


def _groups(flat: list[int], at: int, length: int, m: int, width: int) -> tuple:
    """``(g, entries)`` of each of the ``m`` groups of ``flat[at : at + length]`` (by columns:
    their experts, their entry counts, then the entries), k entries of ``width`` ints each:
    ranks (width 1) or (rank, rows) pairs (width 2), as tuples. One slice per column and one
    ``islice`` per group (the Python side is ~1/5 of a W = 64 plan's time)."""
    experts, sizes = flat[at : at + m], flat[at + m : at + 2 * m]
    values = iter(flat[at + 2 * m : at + length])
    # (rank, rows) pairs off one iterator (an even count: strict would not check more)
    entries = values if width == 1 else zip(values, values, strict=False)
    return tuple(zip(experts, [tuple(islice(entries, k)) for k in sizes], strict=True))


def _prediction(out_i: ctypes.Array, i: int, out_d: ctypes.Array, d: int, W: int) -> Prediction:
    """A Prediction from [token_bytes, weight_bytes, rows] at byte ``i`` of ``out_i`` and
    [compute, comm, step] at byte ``d`` of ``out_d``: its step read here, the per-rank fields
    copied out as bytes (the arrays serve the next call) and decoded when read
    (``Prediction.packed``: a W = 1024 plan carries ~10**4 of these numbers, and the layer
    reads only the plan's rows)."""
    reals = memoryview(out_d).cast("B")
    ints = memoryview(out_i).cast("B")
    step = _DOUBLE.unpack_from(out_d, d + 16 * W)[0]
    return Prediction.packed(step, bytes(reals[d : d + 16 * W]), bytes(ints[i : i + 24 * W]))
