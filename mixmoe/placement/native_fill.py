"""The level fill compiled: ``native/level_fill.cpp`` in the planner's library (``native_lib``).

Legend: W ranks, N experts; a ``RangeState``'s fields (``mixmoe.placement.range_state``).

``level_fill`` (``mixmoe.placement.level_fill``) is Python: ~75-85% of ``plan_mix``'s time on
skewed counts (W = 1024 zipf:1.2: ~0.4 s of ~0.5 s). The C++ file runs the same passes with the
same integer and float operations in the same order, so it leaves the state the Python fill
leaves, bit for bit (``tests/placement/test_native_fill.py`` compares every field, the Python fill
being the slow twin). ``filled`` runs it when it can and returns None otherwise (the caller runs
the Python fill): the library unavailable or off (``native_lib``), a ``distance`` other than
``relay.nodes_of``'s, or a model whose terms are not Python ints and floats
(``native_lib.model_args``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

import torch

from mixmoe.placement import level_fill as py_fill
from mixmoe.placement import native_lib
from mixmoe.placement.cost_model import TOKEN_COLLECTIVES, StepModel
from mixmoe.placement.native_lib import P as _P
from mixmoe.placement.range_state import RangeState

__all__ = ["filled"]

SOURCE = native_lib.FOLDER / "level_fill.cpp"
OFFERED = 4  # native/level_fill.cpp's OFFERED (level_fill.OFFERED: a test checks they agree)
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int64, _P, ctypes.c_int64, _P]


def filled(
    model: StepModel,
    C_WN: torch.Tensor,
    E: int,
    start_holders: dict[int, tuple[int, ...]],
    slots: int,
    block_size: int,
    distance: Callable[[int, int], int] | None,
    colsum_N: torch.Tensor,
    any_remote: bool,
    loads_4W: torch.Tensor,
    passes: int,
    stop: float,
    kept: bool = False,
) -> RangeState | None:
    """``RangeState(model, ..., loads_4W)`` after ``level_fill.level_fill(state, passes, stop,
    kept)`` (its ``moves``: the pieces), compiled: the same state bit for bit; None when the
    compiled fill cannot run here or for these arguments (module doc), or when the start is
    level already (``level_fill``'s first test stops it: no pass, no move; the caller's Python
    state costs less than the compiled set-up, ~1 ms at W = 1024). The C++ builds the start
    state itself (``RangeState.__init__``'s arithmetic) from the tensors; of the state, what
    the planner reads after a fill is read back at once, the rest when first read."""
    fn = native_lib.function("mixmoe_level_fill", ctypes.c_int64, _ARGTYPES)
    if fn is None:
        return None
    per_node = 0
    if distance is not None:
        per_node = getattr(distance, "ranks_per_node", None)
        if type(per_node) is not int or per_node < 1:
            return None  # a distance callable of its own: only the Python fill groups it
    terms = native_lib.model_args(model)
    if terms is None:
        return None
    W = C_WN.shape[0]
    N = W * E
    i64, f64 = torch.int64, torch.float64
    C = C_WN if C_WN.dtype == i64 and C_WN.is_contiguous() else C_WN.to(i64).contiguous()
    colsum = colsum_N.to(i64).contiguous()
    loads = loads_4W[:4].to(f64).contiguous()
    start = [x for g in sorted(start_holders) for y in start_holders[g] for x in (g, y)]
    model_i, model_d = terms
    a = model.flops_per_row / model.gemm_flops + model.row_s  # level_fill's rates, its expressions
    t = model.token_bytes_per_row / model.bw if any_remote else 0.0
    hide = a if model.overlap else 0.0
    copy = 2.0 * (model.params_bytes / model.bw + model.replica_s)
    ints = [W, E, slots, block_size, per_node, int(any_remote), passes, py_fill.TENSOR_POINTS,
            int(kept), *model_i, len(start) // 2]  # fmt: skip
    reals = [*model_d, a, t, hide, copy, TOKEN_COLLECTIVES * model.lat, stop, py_fill.MIN_GAIN]
    cap = len(start) // 2 + W * slots  # holders at the end (each rank holds at most ``slots``)
    out_w, out_wf = torch.empty(5 * W, dtype=i64), torch.empty(2 * W, dtype=f64)
    out_n = torch.empty(4 * N, dtype=i64)
    out_i, out_d = torch.empty(16 * cap + 16, dtype=i64), torch.empty(2 * cap + 16, dtype=f64)
    counts = (ctypes.c_int64 * 5)()
    pieces = fn(
        C.data_ptr(), colsum.data_ptr(), loads.data_ptr(), (ctypes.c_int64 * len(start))(*start),
        (ctypes.c_int64 * len(ints))(*ints), (ctypes.c_double * len(reals))(*reals),
        out_w.data_ptr(), out_wf.data_ptr(), out_n.data_ptr(), out_i.data_ptr(),
        out_i.numel(), out_d.data_ptr(), out_d.numel(), counts,
    )  # fmt: skip
    if pieces == -2:  # the start is level: no pass runs, the Python state is the cheaper one
        return None
    if pieces < 0:  # cannot happen with the capacities above (the C++ counts before writing)
        raise RuntimeError("native level fill: output buffers too small")
    state = object.__new__(FilledState)  # RangeState.__init__'s fields, the fill's values
    state.model, state.C_WN, state.E, state.W = model, C_WN, E, W
    state.slots, state.block, state.distance = slots, block_size, distance
    state.any_remote, state._total_fns, state.moves = any_remote, {}, int(pieces)
    state.rounds, nh, na, nk, nd = counts  # the sections' lengths in out_i (C++ doc)
    per_w = out_w.view(5, W)
    state.rows, state.local, state.remote, overshot = per_w[1:].tolist()
    state.replica, state.totals = out_wf.view(2, W).tolist()
    state.overshot = {r for r, x in enumerate(overshot) if x}
    flat = out_i[: nh + na + nk].tolist()
    state.holders = dict(_groups(flat, 0, nh))
    state.amounts = {
        g: dict(zip(v[::2], v[1::2], strict=True)) for g, v in _groups(flat, nh, na, 2)
    }
    state.kept = {
        g: dict(zip(v[::2], v[1::2], strict=True)) for g, v in _groups(flat, nh + na, nk, 2)
    }
    at = nh + na + nk  # the degrees stay raw until read (FilledState)
    state._raw = (per_w[0], out_n.view(4, N), out_i[at : at + nd])
    state._copies = out_d
    return state


def _groups(flat: list[int], at: int, length: int, width: int = 1) -> Iterator[tuple[int, list]]:
    """(g, values) of each group [g, k, values...] of the section ``flat[at : at + length]``:
    k values each ``width`` ints long (1: ranks; 2: (rank, rows) pairs, flat)."""
    end = at + length
    while at < end:
        g, k = flat[at], flat[at + 1]
        yield g, flat[at + 2 : at + 2 + width * k]
        at += 2 + width * k


class FilledState(RangeState):
    """A ``RangeState`` the compiled fill left. The planner reads holders, amounts, kept, the
    loads, totals and overshot after a fill; the other fields (held, owner_rows, own, others,
    taken, helped, degrees) are built from the C++ output on first read (``__getattr__`` runs
    only for a field not set yet), so a fill pays no Python work for them."""

    def __getattr__(self, name: str) -> object:
        if name not in _LAZY or "_raw" not in self.__dict__:
            raise AttributeError(name)
        held, per_n, degree_groups = self._raw
        self.held = held.tolist()
        self.owner_rows, self.own, self.others, self.taken = per_n.tolist()
        self.helped = {}
        for g, amounts in self.amounts.items():
            for y, n in amounts.items():
                self.helped.setdefault(y, {})[g] = n
        flat, copies = degree_groups.tolist(), iter(self._copies.tolist())
        self.degrees = {
            g: {r: next(copies) for r in ranks} for g, ranks in _groups(flat, 0, len(flat))
        }
        del self._copies
        del self._raw
        return self.__dict__[name]


_LAZY = frozenset(("held", "owner_rows", "own", "others", "taken", "helped", "degrees"))
