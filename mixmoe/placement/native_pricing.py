"""Baseline, plan pricing and predictions compiled: ``native/pricing.cpp`` in the planner's
library (``native_lib``).

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g); loads_4W: float64 [4, W] in ``cost_model.LOADS`` order.

The C++ runs the same integer sums (``counts.baseline_loads``, ``cost_model.plan_pricing``'s
replica rule, ``ranges.range_loads``, ``relay.near_relay``'s grid copies) and the same float
expressions (``StepModel.seconds_fn`` per rank, ``_pack_lists``' bytes) as the Python, so it
returns the same values bit for bit (``tests/placement/test_native_pricing.py`` compares them,
the Python being the slow twin). Each function returns None when it cannot run here or for
these arguments, and the caller runs its Python: the library unavailable or off
(``native_lib``), tensors not in the layout the C++ reads, a plan entry the C++ leaves to the
Python (an index out of range, a relayed expert's holders repeating or naming its owner: the
Python raises), a model whose terms are not Python ints and floats (``native_lib.model_args``),
or byte counts past int64 (Python's ints are unbounded).
"""

from __future__ import annotations

import ctypes
import functools
import struct
from array import array
from itertools import chain

import torch

from mixmoe.placement import native_lib
from mixmoe.placement.cost_model import LayerShape, Prediction, StepModel
from mixmoe.placement.counts import BAD_SUMS, CountSums, raise_bad_sums, sums_pointers
from mixmoe.placement.native_lib import F64, I64
from mixmoe.placement.native_lib import P as _P

__all__ = ["baseline", "count_sums", "counted_baseline", "plan_loads", "prediction"]

SOURCE = native_lib.FOLDER / "pricing.cpp"
_F64, _I64 = torch.float64, torch.int64


def _counts_ok(C_WN: torch.Tensor, E: int) -> bool:
    """Counts as the C++ reads them: int64 [W, W*E], contiguous."""
    return _shape_ok(C_WN, E) and C_WN.is_contiguous()


def _shape_ok(C_WN: torch.Tensor, E: int) -> bool:
    return C_WN.dtype == _I64 and C_WN.dim() == 2 and C_WN.shape[1] == C_WN.shape[0] * E


def _by_column(C_WN: torch.Tensor, E: int) -> bool | None:
    """Whether ``baseline``'s C++ reads these counts by columns (``C_WN.t()`` contiguous: the
    layer's, ``dispatch.layout``), row-major (False), or None: it does not read them."""
    if not _shape_ok(C_WN, E):
        return None
    if C_WN.is_contiguous():
        return False
    return True if C_WN.t().is_contiguous() else None


def baseline(
    C_WN: torch.Tensor, experts_per_rank: int, sums: CountSums | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``counts.baseline_loads(C_WN, E)`` (loads_4W, colsum_N, own_N) and ``counts_with_sums``'
    row sums (rowsum_W, int64) in one pass over C, its sign check included. ``sums``: C's
    ``CountSums``, used instead of the pass (returned as they are; ValueError when a sum is
    negative or the totals differ). None: the compiled part cannot run (module doc), or a
    count is negative (the caller's Python raises its error)."""
    fn = native_lib.function("mixmoe_baseline", I64, [_P, I64, I64, _P, _P, _P, _P, I64, I64])
    by_column = None if fn is None else _by_column(C_WN, experts_per_rank)
    if by_column is None:
        return None
    W, N = C_WN.shape
    loads_4W = torch.empty(4, W, dtype=_F64)
    own_N = torch.empty(N, dtype=_I64)
    if sums is None:
        colsum_N, rowsum_W = torch.empty(N, dtype=_I64), torch.empty(W, dtype=_I64)
    else:
        sums_pointers(sums, W, N)  # checked: types and shapes
        colsum_N, rowsum_W = sums.colsum_N, sums.rowsum_W
    args = (C_WN.data_ptr(), W, experts_per_rank, loads_4W.data_ptr(), colsum_N.data_ptr())
    status = fn(*args, own_N.data_ptr(), rowsum_W.data_ptr(), int(sums is not None), int(by_column))
    if status == BAD_SUMS:
        raise_bad_sums()
    if status < 0:
        return None
    return loads_4W, colsum_N, own_N, rowsum_W


def count_sums(C_WN: torch.Tensor, experts_per_rank: int) -> CountSums | None:
    """C's ``CountSums`` from one compiled pass over it (the sign check included): computed
    once, they serve the plan and the step's bookkeeping. None where ``baseline`` is."""
    out = baseline(C_WN, experts_per_rank)
    return None if out is None else CountSums(out[1], out[3])


def counted_baseline(
    counts_WN: object, shape: LayerShape, sums: CountSums | None = None
) -> tuple[tuple, tuple] | None:
    """(``counts_with_sums(counts_WN, shape)``, ``baseline_loads(C_WN, E, sums)``) from one
    compiled pass over C (none with ``sums``, C's ``CountSums``): ((C_WN, colsum_N, rowsum_W),
    (loads_4W, colsum_N, own_N)), the same tensors' values. Only for counts already in the
    validated form (an int64 CPU tensor [W, N], row-major or by columns: ``C_WN.t()``
    contiguous, the layer's ``dispatch.layout``) as it is; None otherwise, or when a count is
    negative or the compiled part cannot run: the caller's Python validates (and raises)."""
    W, N = shape.world_size, shape.num_experts
    if (
        not isinstance(counts_WN, torch.Tensor)
        or counts_WN.dtype != _I64
        or counts_WN.device.type != "cpu"
        or tuple(counts_WN.shape) != (W, N)
    ):
        return None
    out = baseline(counts_WN, shape.experts_per_rank, sums)
    if out is None:
        return None
    loads_4W, colsum_N, own_N, rowsum_W = out
    return (counts_WN, colsum_N, rowsum_W), (loads_4W, colsum_N, own_N)


def plan_loads(
    C_WN: torch.Tensor,
    plan: object,
    experts_per_rank: int,
    base_4W: torch.Tensor,
    colsum_N: torch.Tensor | None,
) -> tuple[torch.Tensor, int] | None:
    """``cost_model.plan_pricing(C_WN, plan, E, None, base_4W=base_4W, colsum_N=colsum_N)`` of a
    plan without share entries: (loads_4W, rounds), the same values. ``base_4W``: the loads
    with nothing replicated (``baseline_loads``); ``colsum_N``: C's column sums or None (the
    ranged experts' columns summed here). None: the compiled part cannot run (module doc)."""
    fn = native_lib.function("mixmoe_plan_pricing", I64, [_P, I64, I64, _P, _P, _P, I64, _P])
    if fn is None or not _counts_ok(C_WN, experts_per_rank):
        return None
    W, N = C_WN.shape
    if base_4W.dtype != _F64 or base_4W.shape != (4, W) or not base_4W.is_contiguous():
        return None
    colsum = 0  # a null pointer
    if colsum_N is not None:
        if colsum_N.dtype != _I64 or colsum_N.shape != (N,) or not colsum_N.is_contiguous():
            return None
        colsum = colsum_N.data_ptr()
    try:
        flat = _flat_plan(plan)
    except (TypeError, OverflowError):  # entries that are no ints, or past int64: Python
        return None
    out_4W = torch.empty(4, W, dtype=_F64)
    relay = bool(getattr(plan, "relay", False))
    args = (C_WN.data_ptr(), W, experts_per_rank, base_4W.data_ptr(), colsum)
    rounds = fn(*args, flat.buffer_info()[0], relay, out_4W.data_ptr())
    return None if rounds < 0 else (out_4W, rounds)


def _flat_plan(plan: object) -> array:
    """The plan as ``mixmoe_plan_pricing`` reads it: n_replicas, [g, k, k holders] each; n_ranges,
    [g, k, k (helper, rows) pairs] each; n_kept, [g, k, k (holder, local rows) pairs] each.
    One list, then one array (the fastest packing measured: ~0.1 ms for the ~3300 ints of a
    W = 1024 plan)."""
    replicas = plan.replicas
    out = [len(replicas)]
    for g, holders in replicas:
        out += (g, len(holders))
        out += holders
    for entries in (getattr(plan, "ranges", ()), getattr(plan, "kept", ())):
        out.append(len(entries))
        for g, pairs in entries:
            out += (g, len(pairs))
            out += chain.from_iterable(pairs)
    return array("q", out)


@functools.lru_cache(maxsize=16)
def unpackers(W: int) -> tuple[struct.Struct, struct.Struct]:
    """W doubles and W int64s as tuples, straight from a buffer (no list in between)."""
    return struct.Struct(f"{W}d"), struct.Struct(f"{W}q")


# the last model packed and its terms as C arrays (one tuple: threads swap it whole)
_model: tuple[StepModel, ctypes.Array, ctypes.Array] | None = None


def prediction(model: StepModel, loads_4W: torch.Tensor, rounds: int | None) -> Prediction | None:
    """``model.prediction_W(loads_4W, rounds)`` (= ``prediction_lists`` of the same loads): the
    same Prediction, field for field (ints as ints, floats bit for bit). ``loads_4W``: float64
    [4, W], one link. None: the compiled part cannot run (module doc)."""
    global _model
    fn = native_lib.function("mixmoe_predict", F64, [_P, _P, _P, I64, I64, _P, _P])
    if fn is None or loads_4W.dtype != _F64 or loads_4W.dim() != 2 or loads_4W.shape[0] != 4:
        return None
    packed = _model
    if packed is None or packed[0] is not model:  # StepModel is immutable: packed once
        terms = native_lib.model_args(model)
        if terms is None:
            return None
        ints, reals = terms
        packed = _model = (model, (I64 * 5)(*ints), (F64 * 7)(*reals))
    W = loads_4W.shape[1]
    loads = loads_4W if loads_4W.is_contiguous() else loads_4W.contiguous()
    out_d, out_i = array("d", bytes(16 * W)), array("q", bytes(24 * W))
    _, model_i, model_d = packed
    step = fn(model_i, model_d, loads.data_ptr(), W, -1 if rounds is None else int(rounds),
              out_d.buffer_info()[0], out_i.buffer_info()[0])  # fmt: skip
    if step != step:  # NaN: byte counts past int64
        return None
    doubles, int64s = unpackers(W)
    return Prediction(
        compute_s=doubles.unpack_from(out_d, 0),
        comm_s=doubles.unpack_from(out_d, 8 * W),
        token_bytes=int64s.unpack_from(out_i, 0),
        weight_bytes=int64s.unpack_from(out_i, 8 * W),
        rows=int64s.unpack_from(out_i, 16 * W),
        step_s=step,
    )
