"""The 6-row pricing of a profile with a topology, compiled: ``native/pricing_nodes.cpp`` in the
planner's library (``native_lib``).

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN; loads_6W: float64 [6, W],
``cost_model.LOADS`` then the remote rows and the relay (or flat fan-out) copies that cross
nodes, as ``cost_model.plan_pricing`` returns them when the profile has ``ranks_per_node``.

The compiled planner (``native/plan_mix.cpp``) prices every candidate and fill with these
functions when the profile has nodes; ``cost_model.plan_pricing`` prices the other planners'
plans (``plan_none``, ``plan_shadow``, ``reprice``, the simulator's) with ``plan_loads_nodes``.
The twin tests (``tests/placement/test_native_planner_nodes.py``) check the same loads and the
same Prediction as ``plan_pricing``'s Python and ``StepModel.prediction_W``, floats bit for bit.
Each returns None where the compiled part cannot run (the library unavailable or off, counts
not int64 [W, W*E] contiguous, a plan that is not a ``Plan`` or names its owner as a holder, a
model whose terms are not Python ints and floats): the caller's Python runs.
"""

from __future__ import annotations

import ctypes

import torch

from mixmoe.placement import native_lib
from mixmoe.placement.cost_model import Prediction, StepModel
from mixmoe.placement.native_lib import F64, I64
from mixmoe.placement.native_lib import P as _P
from mixmoe.placement.plan import Plan

__all__ = ["plan_loads_nodes", "prediction_nodes"]


def plan_loads_nodes(
    C_WN: torch.Tensor, plan: object, E: int, per_node: int
) -> tuple[torch.Tensor, int] | None:
    """``plan_pricing(C_WN, plan, E, profile)`` for a profile of ``per_node`` ranks per node and
    a ``Plan`` without share entries: (loads_6W, rounds). None: see the module doc, or a
    negative count, or experts or ranks out of range (the Python raises its error)."""
    fn = native_lib.function("mixmoe_plan_pricing_nodes", I64, [_P, I64, I64, I64, _P, I64, _P])
    if fn is None or not isinstance(C_WN, torch.Tensor) or C_WN.dim() != 2:
        return None
    W = C_WN.shape[0]
    if C_WN.dtype != torch.int64 or not C_WN.is_contiguous() or C_WN.device.type != "cpu":
        return None
    if C_WN.shape[1] != W * E or not isinstance(plan, Plan) or plan.shares:
        return None
    # Plan's checks: experts and holders strictly ascending; the C++ checks the ranges
    # (plan_in_range); an owner among its expert's holders is left to the Python
    if any(g // E in holders for g, holders in plan.replicas):
        return None
    flat = [len(plan.replicas)]
    for g, holders in plan.replicas:  # [g, k, holders...]
        flat += [g, len(holders), *holders]
    for entries in (plan.ranges, plan.kept):  # [g, k, (rank, rows) pairs...]
        flat.append(len(entries))
        for g, pairs in entries:
            flat += [g, len(pairs)]
            for y, n in pairs:
                flat += [y, n]
    out_6W = torch.empty(6, W, dtype=torch.float64)
    plan_i = (ctypes.c_int64 * len(flat))(*flat)
    rounds = fn(C_WN.data_ptr(), W, E, per_node, plan_i, int(plan.relay), out_6W.data_ptr())
    return None if rounds < 0 else (out_6W, rounds)


def prediction_nodes(model: StepModel, loads_6W: torch.Tensor, rounds: int) -> Prediction | None:
    """``model.prediction_W(loads_6W, rounds)`` (rounds >= 0) for a model with
    ``bw_inter``. None: see the module doc."""
    fn = native_lib.function("mixmoe_predict_nodes", F64, [_P, _P, F64, _P, I64, I64, _P, _P])
    terms = native_lib.model_args(model)
    if fn is None or terms is None or type(model.bw_inter) is not float:
        return None
    model_i, model_d = terms
    W = loads_6W.shape[1]
    loads = loads_6W.to(torch.float64).contiguous()
    out_d = torch.empty(2, W, dtype=torch.float64)
    out_i = torch.empty(3, W, dtype=torch.int64)
    step = fn(
        (ctypes.c_int64 * len(model_i))(*model_i), (ctypes.c_double * len(model_d))(*model_d),
        model.bw_inter, loads.data_ptr(), W, rounds, out_d.data_ptr(), out_i.data_ptr(),
    )  # fmt: skip
    compute, comm = out_d.tolist()
    token, weight, rows = out_i.tolist()
    return Prediction(tuple(compute), tuple(comm), tuple(token), tuple(weight), tuple(rows), step)
