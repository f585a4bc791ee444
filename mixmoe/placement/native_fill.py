"""The level fill compiled: ``native/level_fill.cpp`` in the planner's library (``native_lib``).

Legend: W ranks, N experts; a ``RangeState``'s fields (``mixmoe.placement.range_state``).

``level_fill`` (``mixmoe.placement.level_fill``) is Python: ~75-85% of ``plan_mix``'s time on
skewed counts. The C++ file runs the same passes with the same integer and float operations in
the same order, so it leaves the state the Python fill leaves, bit for bit, and builds that
state's ``plan_fields`` (hot, replicas, the ranges cut at whole blocks, the kept entries) the
way ``RangeState.plan_fields`` does (``tests/placement/test_native_fill.py`` compares every
field and the plan fields, the Python being the slow twin). ``filled`` runs it when it can and
returns None otherwise (the caller runs the Python fill): the library unavailable or off
(``native_lib``), a ``distance`` other than ``relay.nodes_of``'s, or a model whose terms are not
Python ints and floats (``native_lib.model_args``).

The wrapper is thin: its inputs pass as the tensors' own buffers and two small ctypes arrays, its
outputs come back in one int64 and one float64 ctypes buffer (allocated per call: a state keeps
them while its fields are unread), and of the state only what ``plan_mix`` reads after every
fill (``moves``, ``totals``, ``remote``, ``overshot``) is decoded at once; the other fields and
``plan_fields`` (read for the winning fill only) when first read.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable, Iterator
from itertools import islice, repeat

import torch

from mixmoe.placement import native_lib
from mixmoe.placement.cost_model import StepModel
from mixmoe.placement.native_lib import F64, I64
from mixmoe.placement.native_lib import P as _P
from mixmoe.placement.range_state import RangeState, start_inter

__all__ = ["BEATEN", "FilledState", "filled"]

SOURCE = native_lib.FOLDER / "level_fill.cpp"
OFFERED, OFFERED_MAX = 4, 16  # native/level_fill.cpp's (level_fill's: a test checks they agree;
# its TENSOR_POINTS and MIN_GAIN too, which only the C++ reads)
BEATEN = "beaten"  # filled's answer for a fill stopped at its beat (level_fill)
HEADER = 10  # out_i's header: rounds, overshot ranks, each section's (experts, length)
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, I64, _P, I64]
_PLAN_ARGTYPES = [_P, _P, _P, _P, I64]
_I64, _F64 = torch.int64, torch.float64


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
    beat: float = float("inf"),
) -> FilledState | str | None:
    """``RangeState(model, ..., loads_4W)`` after ``level_fill.level_fill(state, passes, stop,
    kept)`` (its ``moves``: the pieces), compiled: the same state bit for bit, and the same
    ``plan_fields()``; None when the compiled fill cannot run here or for these arguments
    (module doc), or when the start is level already (``level_fill``'s first test stops it: no
    pass, no move; the caller's Python state costs less than the compiled set-up, ~1 ms at
    W = 1024). The C++ builds the start state itself (``RangeState.__init__``'s arithmetic) from
    the tensors. ``beat``: level_fill's; ``BEATEN`` instead of a state when the fill stopped
    at it (the planner drops such a fill, so none of it is read back)."""
    fn = native_lib.function("mixmoe_level_fill", I64, _ARGTYPES)
    if fn is None:
        return None
    per_node = 0
    if distance is not None:
        per_node = getattr(distance, "ranks_per_node", None)
        if type(per_node) is not int or per_node < 1:
            return None  # a distance callable of its own: only the Python fill groups it
    inputs = _inputs(model, C_WN, E, start_holders, slots, block_size, per_node, colsum_N,
                     any_remote, loads_4W, passes, stop, kept, beat)  # fmt: skip
    if inputs is None:
        return None
    W = C_WN.shape[0]
    N = W * E
    cap_i, cap_d = _capacity(W, N, len(inputs[3]) - 2 * len(start_holders) + W * slots)
    while True:
        out_i, out_d = (I64 * cap_i)(), (F64 * cap_d)()
        pieces = fn(*_addresses(inputs), out_i, cap_i, out_d, cap_d)
        if pieces != -1:
            break
        cap_i, cap_d = out_i[0], out_i[1]  # the sizes it needs (the bound above holds: never)
    if pieces == -2:  # the start is level: no pass runs, the Python state is the cheaper one
        return None
    if pieces == -4:
        return BEATEN
    state = object.__new__(FilledState)  # RangeState.__init__'s fields, the fill's values
    state.model, state.C_WN, state.E, state.W = model, C_WN, E, W
    state.slots, state.block, state.distance = slots, block_size, distance
    state.any_remote, state._total_fns, state.moves = any_remote, {}, pieces
    state.split = distance is not None and model.bw_far is not None  # RangeState's
    state.beaten = False  # (a beaten fill returned BEATEN above)
    mi, md = memoryview(out_i).cast("B").cast("q"), memoryview(out_d).cast("B").cast("d")
    head = mi[:HEADER].tolist()
    # out_i: the header, held, rows, local, remote [W each], the overshot ranks, 4 x [N], the
    # sections (the C++ doc)
    at = HEADER + 3 * W
    state.remote = mi[at : at + W].tolist()
    state.overshot = set(mi[at + W : at + W + head[1]].tolist())
    state.totals = md[W : 2 * W].tolist()
    state._raw = (head, mi, md, at + W + head[1] + 4 * N, out_i, inputs[0])
    return state


def _capacity(W: int, N: int, holders: int) -> tuple[int, int]:
    """Ints and floats the C entry's output takes at most, ``holders`` the holder entries at
    most (the start's and ``slots`` new per rank): the sections hold at most 15 ints per holder
    (its rank in the holders and degrees, a pair in the amounts and kept; per expert, with one
    holder at least, 2 ints in each section and the owner's rank in the degrees), the degrees
    a copy per holder and owner."""
    return HEADER + 5 * W + 4 * N + 15 * holders, 2 * W + 2 * holders


def _inputs(
    model: StepModel, C_WN: torch.Tensor, E: int, start_holders: dict[int, tuple[int, ...]],
    slots: int, block_size: int, per_node: int, colsum_N: torch.Tensor, any_remote: bool,
    loads_4W: torch.Tensor, passes: int, stop: float, kept: bool, beat: float = float("inf"),
) -> tuple | None:  # fmt: skip
    """The C entry's inputs (C, colsum, loads, start, ints, reals: the C++ doc), the tensors as
    their own buffers when they are int64 / float64 and contiguous already (plan_mix's); None
    when the model's terms are not of the types the C++ assumes (``native_lib.model_args``)."""
    terms = native_lib.model_args(model)
    if terms is None:
        return None
    C = C_WN if C_WN.dtype == _I64 and C_WN.is_contiguous() else C_WN.to(_I64).contiguous()
    colsum = colsum_N
    if colsum.dtype != _I64 or not colsum.is_contiguous():
        colsum = colsum.to(_I64).contiguous()
    loads = loads_4W  # its first 4 rows: contiguous at the start of a contiguous tensor
    if loads.dtype != _F64 or not loads.is_contiguous():
        loads = loads[:4].to(_F64).contiguous()
    start = array("q", start_holders)  # by columns: the experts, their counts, the holders
    start.extend(map(len, start_holders.values()))
    for h in start_holders.values():  # fromlist: ~4x faster than extend from an iterator
        start.fromlist(list(h))
    model_i, model_d = terms
    ints = (I64 * 14)(C_WN.shape[0], E, slots, block_size, per_node, any_remote, passes, kept,
                      *model_i, len(start_holders))  # fmt: skip
    # the copies' two links of a fill across nodes (RangeState.split), else 0.0: one link
    split = per_node > 0 and model.bw_far is not None and model.bw_near is not None
    near_far = (model.bw_near, model.bw_far) if split else (0.0, 0.0)
    reals = (F64 * 11)(*model_d, stop, *near_far, beat)
    return C, colsum, loads, start, ints, reals


def _addresses(inputs: tuple) -> tuple:
    """``_inputs`` as the C entry's first six arguments."""
    C, colsum, loads, start, ints, reals = inputs
    return C.data_ptr(), colsum.data_ptr(), loads.data_ptr(), start.buffer_info()[0], ints, reals


def _sections(
    sizes: list[int], mi: memoryview, at: int, which: tuple[int, ...]
) -> list[tuple[list, list, Iterator]]:
    """Sections ``which`` of the C++'s output at ``mi[at:]``, one after the other, ``sizes``
    their (experts, length) pairs, flat: each (experts, counts, an iterator over the entries'
    ints, in order)."""
    out = []
    for i in range(max(which) + 1):
        m, length = sizes[2 * i], sizes[2 * i + 1]
        if i in which:
            ints = mi[at : at + length].tolist()
            out.append((ints[:m], ints[m : 2 * m], iter(ints[2 * m :])))
        at += length
    return out


def _grouped(section: tuple[list, list, Iterator], width: int, kind: type) -> Iterator:
    """(g, kind of its entries) of each expert of ``section``: its ranks (width 1) or its
    (rank, n) pairs (width 2), each group taken off the shared iterator in turn (C loops)."""
    gs, ks, ints = section
    # zip(ints, ints): consecutive pairs of the one iterator; each group takes its k entries
    # off the shared iterator (strict=False: the groups end where the entries do)
    entries = ints if width == 1 else zip(ints, ints, strict=False)
    return zip(gs, map(kind, map(islice, repeat(entries), ks)), strict=True)


class FilledState(RangeState):
    """A ``RangeState`` the compiled fill left. The planner reads moves, totals, remote and
    overshot after every fill (set at once); the other fields are built from the C++ output on
    first read (``__getattr__`` runs only for a field not set yet), and ``plan_fields`` returns
    the C++'s until the state changes (a move, a new holder, a relay: the Python's then)."""

    def __getattr__(self, name: str) -> object:
        if name not in _LAZY or "_raw" not in self.__dict__:
            raise AttributeError(name)
        head, mi, md, at, out_i, C = self._raw
        W, N = self.W, self.W * self.E
        self.rounds = head[0]
        per_w = mi[HEADER : HEADER + 3 * W].tolist()
        self.held, self.rows, self.local = per_w[:W], per_w[W : 2 * W], per_w[2 * W :]
        self.replica = md[:W].tolist()
        per_n = mi[at - 4 * N : at].tolist()
        self.owner_rows, self.own = per_n[:N], per_n[N : 2 * N]
        self.others, self.taken = per_n[2 * N : 3 * N], per_n[3 * N :]
        holders, amounts, kept, degrees = _sections(head[2:], mi, at, (0, 1, 2, 3))
        self.holders = dict(_grouped(holders, 1, list))
        self.amounts = dict(_grouped(amounts, 2, dict))
        self.kept = dict(_grouped(kept, 2, dict))
        self.helped = {}
        for g, rows in self.amounts.items():
            for y, n in rows.items():
                self.helped.setdefault(y, {})[g] = n
        copies = md[2 * W : 2 * W + sum(degrees[1])].tolist()
        copies_it = iter(copies)  # each group's copies off the one iterator, in order
        self.degrees = {
            g: dict(zip(ranks, islice(copies_it, len(ranks)), strict=True))
            for g, ranks in _grouped(degrees, 1, list)
        }
        if self.split:  # RangeState.__init__'s, from the holders (the C++ keeps its own)
            self.inter, self.replica_inter = start_inter(self.holders, self.E, W, self.distance)
        self._plan = (head, mi, at, out_i, C)  # for plan_fields, until the state changes
        del self._raw
        return self.__dict__[name]

    def plan_fields(self) -> tuple[tuple, tuple, tuple, tuple]:
        """``RangeState.plan_fields()``: the C++'s fields while the state is as the fill left
        it (the same tuples: ``tests/placement/test_native_fill.py``; computed on first call,
        ``mixmoe_level_fill_plan``: plan_mix reads them of one fill only), else the Python's."""
        fields = self.__dict__.get("_fields")
        if fields is not None:
            return fields
        raw = self.__dict__.get("_raw") or self.__dict__.get("_plan")
        fn = native_lib.function("mixmoe_level_fill_plan", I64, _PLAN_ARGTYPES) if raw else None
        if fn is None:  # changed since the fill (or the library turned off since): Python's
            return super().plan_fields()
        head, mi, at, out_i, C = raw[0], raw[1], raw[-3], raw[-2], raw[-1]
        ints = (I64 * 9)(self.W, self.E, self.block, *head[2:8])
        cap = head[5] + head[7] + 4  # ranges: at most the amounts' groups and entries
        out = (I64 * cap)()
        # the holders, amounts and kept sections where the fill wrote them (int64: 8 bytes)
        if fn(C.data_ptr(), ints, ctypes.addressof(out_i) + 8 * at, out, cap) != 0:
            raise RuntimeError("native plan fields: output buffer too small")  # cannot happen
        mo = memoryview(out).cast("B").cast("q")
        ranges, kept = _sections(mo[:4].tolist(), mo, 4, (0, 1))
        (holders,) = _sections(head[2:], mi, at, (0,))
        replicas = tuple(_grouped(holders, 1, tuple))
        hot = tuple(g for g, _ in replicas)
        fields = hot, replicas, tuple(_grouped(ranges, 2, tuple)), tuple(_grouped(kept, 2, tuple))
        self._fields = fields
        return fields

    def __getstate__(self) -> dict:
        """Every field built (pickle and copy take no memoryview): plan_fields the Python's."""
        if "_raw" in self.__dict__:
            self.holders  # noqa: B018 (builds every lazy field)
        return {k: v for k, v in self.__dict__.items() if k not in ("_plan", "_fields")}

    # the state changes: plan_fields is the Python's from then on (its fields built first)
    def _keep(self, g: int, y: int, k: int) -> None:
        self._changed()
        super()._keep(g, y, k)

    def move(self, g: int, b: int, y: int, n: int) -> None:
        self._changed()
        super().move(g, b, y, n)

    def relay(self, g: int) -> None:
        self._changed()
        super().relay(g)

    def _changed(self) -> None:
        if "_raw" in self.__dict__:
            self.holders  # noqa: B018 (builds every lazy field)
        self.__dict__.pop("_plan", None)
        self.__dict__.pop("_fields", None)


_LAZY = frozenset(("held", "owner_rows", "own", "others", "taken", "helped", "degrees",
                   "holders", "amounts", "kept", "rows", "local", "replica", "rounds", "inter",
                   "replica_inter"))  # fmt: skip
