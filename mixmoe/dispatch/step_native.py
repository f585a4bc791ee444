"""One rank's step bookkeeping compiled: ``placement/native/step_plan.cpp`` (``native_lib``).

Legend: W ranks, E experts per rank, N = W*E experts, C the count matrix [W, N], H replicas held
here, M = E + H receive columns, R runs (or sent experts).

``step_fields`` returns what ``step_plan.build_step_plan`` computes from C and the plan but the
replica fetch: the replica rule's splits, ``ranges.range_rows_moved``, the rank's expansion of the
plan's ranges (``Plan.expanded``) and ``step_shares.share_fields``, the same values (the C++
file's doc; ``tests/dispatch/test_step_native.py`` compares them with the Python,
``step_plan.step_plan_python``, the slow twin). One C call: it reads C in one pass over its rows
(the total rows moved needs all of it), where the Python's tensor ops and loops read it several
times and walk the plan's entries one by one. None: the Python runs instead (the library
unavailable or off, ``MIXMOE_NATIVE=0``; C not an int64 CPU tensor [W, W*E] stored row-major or
by columns (``C_WN.t()`` contiguous); a rank
or E not a Python int; a plan the Python would reject or reads out of range, which the C++
reports).
"""

from __future__ import annotations

from array import array
from itertools import chain

import torch

from mixmoe.dispatch.step_shares import SourceRuns
from mixmoe.placement import native_lib
from mixmoe.placement.counts import CountSums, sums_pointers
from mixmoe.placement.native_lib import I64
from mixmoe.placement.native_lib import P as _P
from mixmoe.placement.plan import Plan

__all__ = ["step_fields"]

HEADER = 8  # native/step_plan.cpp's HEADER
SHORT, FALLBACK = -1, -2  # its return codes: a larger buffer; the Python
_ARGTYPES = [_P, I64, I64, I64, _P, I64, _P, I64, _P, I64, I64]


def step_fields(
    C_WN: torch.Tensor,
    plan: Plan,
    rank: int,
    experts_per_rank: int,
    sums: CountSums | None = None,
) -> dict | None:
    """``StepPlan``'s fields but ``own_experts`` and ``fetch`` (``rep_experts`` included, in
    replica-slot order) for ``rank``, as ``build_step_plan`` computes them, and
    ``expert_rows_N``: ``C_WN.sum(dim=0)``, summed on the same pass over C, or ``sums``'
    (C's ``CountSums``: then no pass sums C, its rows are only gathered from); None when the
    compiled part cannot run here or for these arguments (module doc)."""
    fn = native_lib.function("mixmoe_step_plan", I64, _ARGTYPES)
    if fn is None or C_WN.dtype != torch.int64 or C_WN.device.type != "cpu":
        return None
    E = experts_per_rank
    if not isinstance(rank, int) or not isinstance(E, int):  # (ctypes takes Python ints)
        return None
    if C_WN.dim() != 2 or C_WN.shape[1] != C_WN.shape[0] * E:
        return None
    # row-major, or stored by columns (the layer's counts from an accelerator: C_WN.t() is
    # contiguous; the C++ then reads each column it needs as consecutive counts)
    by_column = not C_WN.is_contiguous()
    if by_column and not C_WN.t().is_contiguous():
        return None
    W, N = C_WN.shape
    packed = plan.packed if plan.packed is not None else _pack(plan)  # (the compiled planner's)
    if packed is None:
        return None
    cap = _capacity(W, E, len(packed))
    if sums is None:
        rows_N = torch.empty(N, dtype=torch.int64)
    else:
        sums_pointers(sums, W, N)  # checked: types and shapes
        rows_N = sums.colsum_N
    while True:
        out = (I64 * cap)()
        got = fn(C_WN.data_ptr(), W, E, rank, packed.buffer_info()[0], len(packed), out, cap,
                 rows_N.data_ptr(), int(sums is not None), int(by_column))  # fmt: skip
        if got != SHORT:
            break
        cap = out[0]
    if got == FALLBACK:
        return None
    fields = _unpack(memoryview(out).cast("B").cast("q")[:got], W, E)
    fields["expert_rows_N"] = rows_N
    return fields


def _capacity(W: int, E: int, packed: int) -> int:
    """Ints of the first output buffer: the fields (module doc) with up to 8 replicas a rank
    and a run per expert and plan int; a larger plan's first call reports what it needs
    (SHORT) and runs again."""
    return HEADER + 2 * W + W * (E + 8) + 3 * W * E + 2 * packed + 64


def _pack(plan: Plan) -> array | None:
    """The plan as the C entry reads it: the counts of replicas, shares, ranges and kept
    entries, then each replica (g, k, holders), share (s, g, k, (rank, rows) * k), range and
    kept entry (g, k, (rank, rows) * k); None when an int does not fit int64 (the Python's)."""
    ints = [len(plan.replicas), len(plan.shares), len(plan.ranges), len(plan.kept)]
    add, extend = ints.append, ints.extend  # (W = 1024: ~2000 ints, ~0.1 ms)
    for g, holders in plan.replicas:
        add(g)
        add(len(holders))
        extend(holders)
    for s, g, runs in plan.shares:
        extend((s, g, len(runs)))
        extend(chain.from_iterable(runs))
    for entries in (plan.ranges, plan.kept):
        for g, pairs in entries:
            add(g)
            add(len(pairs))
            extend(chain.from_iterable(pairs))
    try:
        return array("q", ints)
    except (OverflowError, TypeError):
        return None


def _unpack(out: memoryview, W: int, E: int) -> dict:
    """The fields from the C entry's output (its doc: the header, then the arrays in order)."""
    shared, rows_moved, n_send, owned_stay, H, M, R, _ = out[:HEADER].tolist()
    at = HEADER

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return out[at - n : at].tolist()

    fields = {"rep_experts": tuple(take(H)), "in_splits": take(W), "out_splits": take(W)}
    fields["recv_counts"] = take(W * M)  # source-major, then column
    fields["rows_moved"] = rows_moved
    if not shared:  # the replica rule: owned columns only, every slot owned
        fields["recv_slots"] = list(range(E)) * W
        fields["send_experts"] = tuple(take(R))
        return fields
    fields["recv_slots"] = take(M) * W
    fields["recv_replica"] = [bool(x) for x in take(M)] * W
    fields["send_experts"] = ()
    run_len, run_key, own_c, rep_c = take(R), take(R), take(E), take(H)
    fields["runs"] = SourceRuns(run_len, run_key, own_c, rep_c, n_send, bool(owned_stay))
    return fields
