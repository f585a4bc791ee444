"""The source-replica search compiled: ``native/replica_search.cpp`` in the planner's library.

Legend: W ranks, E experts per rank, N = W*E experts, C_WN = the counts (int64 [W, N]).

``plan_replicas`` (``mixmoe.placement.replica_search``) searches in Python on lists, on the host
with the counts in a tensor, or on tensors, by size; each costs 0.1-1.5 ms per plan, mostly
interpreter and per-op overhead. The C++ file runs ``_ListMixSearch``'s rounds with the same
integer loads and float expressions, so it accepts the same experts with the same holders and
leaves the same loads (``tests/placement/test_native_search.py`` compares it with every Python
path, the slow twins). ``searched`` runs it and prices the baseline and the result as
``StepModel.prediction_lists`` does (the seconds computed in the same call); ``available`` says
whether it can run (the library built and on, the model's terms exact: ``native_lib``); the
caller runs its Python otherwise.
"""

from __future__ import annotations

import array
import ctypes
import functools

import torch

from mixmoe.placement import native_lib
from mixmoe.placement.cost_model import Prediction, StepModel
from mixmoe.placement.native_lib import I64 as _I64
from mixmoe.placement.native_lib import P as _P

__all__ = ["available", "searched"]

SOURCE = native_lib.FOLDER / "replica_search.cpp"
ENTRY = "mixmoe_replica_search"
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P]


def _entry() -> ctypes._CFuncPtr | None:
    return native_lib.function(ENTRY, _I64, _ARGTYPES)


def _terms(model: StepModel) -> tuple[list[int], ctypes.Array] | None:
    """``native_lib.model_args(model)``: the ints, and the reals as a C array (None: the model's
    terms are not exact ints and floats)."""
    terms = native_lib.model_args(model)
    return None if terms is None else (terms[0], _c_reals(tuple(terms[1])))


@functools.lru_cache(maxsize=64)
def _c_reals(reals: tuple[float, ...]) -> ctypes.Array:
    """The model's reals as a C array, built once per set of values (read-only in the C++)."""
    return (ctypes.c_double * len(reals))(*reals)


def available(model: StepModel) -> bool:
    """Whether ``searched`` runs for ``model`` (the library built and on, the model's terms
    exact)."""
    return _entry() is not None and _terms(model) is not None


def searched(
    C_WN: torch.Tensor,
    E: int,
    model: StepModel,
    max_replicas: int,
    width: int,
    colsum_N: torch.Tensor | None = None,
    loads_4W: torch.Tensor | None = None,
) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], Prediction, Prediction] | None:
    """``plan_replicas``' search over validated counts, compiled: (replicas, prediction,
    baseline), or None when it cannot run here (``available``) or a Prediction's byte counts
    would leave int64 (then the caller's Python prices them as Python ints).

    ``C_WN``: int64 [W, N] (contiguous; others are copied); ``colsum_N``: its column sums (int64
    [N]; None: summed in the C++); ``loads_4W``: ``baseline_loads``' aggregates (float64 [4, W]
    holding ints; None: built in the C++, one pass over C: cheap for the tiny problems that
    come without them). replicas: ``Plan.replicas`` of the accepted experts, ascending g, each
    with its holders ascending (empty: nothing accepted, prediction is baseline); prediction:
    ``model.prediction_lists`` of the accepted plan's loads (rounds None), baseline: that of
    the baseline loads, the same values bit for bit (the C++ prices them as it does). The
    caller has run ``model.check_exact``.
    """
    fn = _entry()
    terms = _terms(model)
    if fn is None or terms is None:
        return None
    model_i, model_d = terms
    W, N = C_WN.shape
    i64, f64 = torch.int64, torch.float64
    C = C_WN if C_WN.dtype == i64 and C_WN.is_contiguous() else C_WN.to(i64).contiguous()
    colsum = colsum_N
    if colsum is not None and not (colsum.dtype == i64 and colsum.is_contiguous()):
        colsum = colsum.to(i64).contiguous()
    base = loads_4W
    if base is not None and not (base.dtype == f64 and base.is_contiguous()):
        base = base.to(f64).contiguous()
    # a cap or a width above N binds nothing (a rank holds at most N replicas, a round reaches
    # at most N candidates): clamped so that any Python int fits an int64
    ints = (ctypes.c_int64 * 9)(W, E, min(max_replicas, N + 1), min(width, N + 1), *model_i)
    cap = 2 * N + W * min(max_replicas, N)  # [g, k, holders]: the k sum to the replicas held
    # host buffers read back without a tensor op (arrays: a memoryview slice lists them):
    # out_i = the Predictions' ints [2, 3, W], the groups' length, the final loads [4, W], the
    # holder groups [cap]; out_d = the Predictions' floats [2, 2W + 1]
    out_i, out_d = _ZERO_I * (10 * W + 1 + cap), _ZERO_D * (4 * W + 2)
    at, pred_d = out_i.buffer_info()[0], out_d.buffer_info()[0]
    n = fn(
        C.data_ptr(), None if colsum is None else colsum.data_ptr(),
        None if base is None else base.data_ptr(), ints, model_d, at + 8 * (6 * W + 1),
        at + 8 * (10 * W + 1), cap, at, pred_d, at + 8 * 6 * W,
    )  # fmt: skip
    if n == -2:  # byte counts beyond int64 (gigantic layers): Python's ints price them
        return None
    if n < 0:  # cannot happen with the capacity above (the C++ counts before writing)
        raise RuntimeError("native replica search: holder buffer too small")
    view_i, view_d = memoryview(out_i), memoryview(out_d)
    # the second prediction is written only when an expert is accepted
    flat_i = view_i[: 6 * W + 1 if n else 3 * W].tolist()
    flat_d = view_d[: 4 * W + 2 if n else 2 * W + 1].tolist()
    baseline = _prediction(flat_i, flat_d, 0, W)
    if n == 0:
        return (), baseline, baseline
    flat = view_i[10 * W + 1 : 10 * W + 1 + flat_i[6 * W]].tolist()
    replicas, i = [], 0
    for _ in range(n):  # groups [g, k, h_1..h_k]
        g, k = flat[i], flat[i + 1]
        replicas.append((g, tuple(flat[i + 2 : i + 2 + k])))
        i += 2 + k
    return tuple(replicas), _prediction(flat_i, flat_d, 1, W), baseline


_ZERO_I, _ZERO_D = array.array("q", [0]), array.array("d", [0.0])  # repeated into buffers


def _prediction(flat_i: list[int], flat_d: list[float], k: int, W: int) -> Prediction:
    """The k-th Prediction (0: the baseline, 1: the accepted plan) of the C++ output: ints
    [token bytes, weight bytes, rows] x W, floats [compute, comm] x W and the step."""
    i, d = 3 * W * k, (2 * W + 1) * k
    return Prediction(
        compute_s=tuple(flat_d[d : d + W]),
        comm_s=tuple(flat_d[d + W : d + 2 * W]),
        token_bytes=tuple(flat_i[i : i + W]),
        weight_bytes=tuple(flat_i[i + W : i + 2 * W]),
        rows=tuple(flat_i[i + 2 * W : i + 3 * W]),
        step_s=flat_d[d + 2 * W],
    )
