"""plan_mix's shadow and spread starts compiled: ``native/candidates.cpp`` in the planner's library.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g; expert g is owned by rank g // E).

``shadow_hot`` and ``spread_start`` here run the C++ twins of ``shadow.shadow_hot`` and
``spread.spread_start`` (same decisions, bit for bit: ``tests/placement/test_native_candidates.py``
compares them with the Python, the slow twin). Each returns None when the library is unavailable
or off (``native_lib``): the caller then runs its Python. The callers decide where the compiled
one is worth its call (their thresholds say what was measured).
"""

from __future__ import annotations

import ctypes

import torch

from mixmoe.placement import native_lib
from mixmoe.placement.native_lib import F64, I64
from mixmoe.placement.native_lib import P as _P

__all__ = ["shadow_hot", "spread_start"]

SOURCE = native_lib.FOLDER / "candidates.cpp"
_SHADOW_ARGS = [_P, I64, I64, _P, _P, F64, F64, _P]
_SPREAD_ARGS = [_P, I64, I64, _P, I64, _P]


def _int64(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous int64 tensor (itself when it is one: the planner's always are)."""
    return x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()


def shadow_hot(
    C_WN: torch.Tensor,
    E: int,
    load_N: torch.Tensor,
    own_N: torch.Tensor,
    t_row_feat: float,
    t_model: float,
) -> tuple[int, ...] | None:
    """``shadow.shadow_hot``'s experts (ascending) for W >= 2, from its arguments and its two
    floats (``t_row_feat``, ``t_model`` as it computes them), compiled; None when the library
    cannot run (the caller runs its Python)."""
    fn = native_lib.function("mixmoe_shadow_hot", I64, _SHADOW_ARGS)
    if fn is None:
        return None
    W, N = C_WN.shape
    C, load, own = _int64(C_WN), _int64(load_N), _int64(own_N)
    out = (ctypes.c_int64 * N)()  # at most every expert shadowed
    n = fn(C.data_ptr(), W, E, load.data_ptr(), own.data_ptr(), t_row_feat, t_model, out)
    return tuple(out[:n])


def spread_start(
    C_WN: torch.Tensor, colsum_N: torch.Tensor, experts_per_rank: int, slots: int
) -> dict[int, tuple[int, ...]] | None:
    """``spread.spread_start(C_WN, colsum_N, experts_per_rank, slots)`` compiled: the same dict,
    in the same order (heaviest expert first); None when the library cannot run (the caller
    runs its Python)."""
    fn = native_lib.function("mixmoe_spread_start", I64, _SPREAD_ARGS)
    if fn is None:
        return None
    W, N = C_WN.shape
    colsum = _int64(colsum_N)
    slots = min(slots, N)  # a rank holds at most one copy of each expert: more slots never bind
    out = (ctypes.c_int64 * (2 * N + W * max(slots, 0)))()  # groups [g, k, holders...]
    n = fn(C_WN.data_ptr(), W, experts_per_rank, colsum.data_ptr(), slots, out)
    flat = out[:n]
    holders: dict[int, tuple[int, ...]] = {}
    at = 0
    while at < n:  # group: g, k, then k holder ranks
        g, k = flat[at], flat[at + 1]
        holders[g] = tuple(flat[at + 2 : at + 2 + k])
        at += 2 + k
    return holders
