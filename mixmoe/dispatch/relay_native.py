"""One rank's replica fetch compiled: ``placement/native/relay_plan.cpp`` (``native_lib``).

``relay_plan_fields`` returns ``RelayPlan``'s fields (pack, round count, held experts) and the C
call's output, from which ``relay_layout`` builds the fetch's layout and ``relay_plan_decoded``
the rounds and slots as ``replicas.relay_plan_python`` computes them, when they are read (the
C++ file's doc; ``tests/dispatch/test_relay_native.py`` compares every field with the Python,
the slow twin). The Python walks every piece a rank sends or receives, one tuple at a time:
under nodes at W = 1024 a far holder's ~8000 pieces took ~8.5 ms of the planning thread. None: the Python runs
instead (the library unavailable or off, ``MIXMOE_NATIVE=0``; a topology other than one link or
``relay.nodes_of``'s nodes; holders the Python would reject, which the C++ reports).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from mixmoe.placement import native_lib
from mixmoe.placement.collector import collector_paused
from mixmoe.placement.native_lib import I64
from mixmoe.placement.native_lib import P as _P

__all__ = ["relay_layout", "relay_plan_decoded", "relay_plan_fields"]

SHORT, FALLBACK = -1, -2  # native/relay_plan.cpp's return codes: a larger buffer; the Python
_ARGTYPES = [_P, I64, I64, I64, I64, I64, I64, _P, I64]
_LAYOUT_ARGTYPES = [_P, I64, I64, I64, _P, I64]


def relay_plan_fields(
    replicas,
    rank: int,
    world_size: int,
    experts_per_rank: int,
    distance: Callable[[int, int], int] | None,
    relay: bool,
) -> tuple | None:
    """``(pack_local_ids, num_rounds, recv_experts, compiled)`` of ``RelayPlan.build``'s
    arguments, ``compiled`` the C entry's output as it wrote it (an ``array``: a RelayPlan
    pickles) with W, what ``relay_layout`` reads and ``relay_plan_decoded`` turns into the
    rounds and slots; or None where the compiled part does not run (module doc)."""
    fn = native_lib.function("mixmoe_relay_plan", I64, _ARGTYPES)
    if fn is None:
        return None
    per_node = 0
    if distance is not None:  # nodes of per_node consecutive ranks (relay.nodes_of's form only)
        per_node = getattr(distance, "ranks_per_node", None)
        if type(per_node) is not int or per_node < 1:
            return None
    if not all(type(x) is int for x in (rank, world_size, experts_per_rank)):
        return None
    flat = array("q", [len(replicas)])
    try:
        for g, holders in replicas:
            flat.append(g)
            flat.append(len(holders))
            flat.extend(holders)
    except (TypeError, OverflowError):  # not ints: the Python says what is wrong
        return None
    cap = _capacity(world_size, len(flat))
    while True:
        buf = (I64 * cap)()  # zero pages until written: only what the C writes is touched
        got = fn(flat.buffer_info()[0], len(flat), rank, world_size, experts_per_rank, per_node,
                 int(bool(relay)), buf, cap)  # fmt: skip
        if got != SHORT:
            break
        cap = buf[0]
    if got == FALLBACK:
        return None
    out = array("q")
    out.frombytes(memoryview(buf).cast("B")[: 8 * got])  # what it wrote, one copy
    P, num_rounds, H = out[1], out[2], out[3]  # the header: used, P, rounds, H
    at = 4 + P
    for _ in range(num_rounds):  # past each round: its sizes, splits, sends and receives
        at += 2 + 2 * world_size + 4 * out[at] + 3 * out[at + 1]
    return out[4 : 4 + P].tolist(), num_rounds, tuple(out[at : at + H]), (out, world_size)


def relay_plan_decoded(compiled: tuple) -> tuple:
    """``(rounds, slot_pieces)`` of a compiled plan's output (``relay_plan_fields``' last
    field), rounds as ``(send, in_splits, out_splits, recv)`` tuples: what the Python builds
    (``replicas.relay_plan_python``)."""
    plan, W = compiled
    with collector_paused():  # ~10**4 tuples at W = 1024 (placement/collector.py)
        _, rounds, slots, _ = _unpack(plan.tolist(), W)
    return rounds, slots


def relay_layout(compiled: tuple, Q: int) -> tuple | None:
    """``replicas._Layout``'s fields for packed rows of Q elements, ``(sends, splits, slots,
    compact, cuts)``, from a compiled plan's output (``relay_plan_fields``' last field), or
    None: the Python's layout runs."""
    fn = native_lib.function("mixmoe_relay_layout", I64, _LAYOUT_ARGTYPES)
    if fn is None or type(Q) is not int:
        return None
    plan, W = compiled
    size = len(plan)
    cap = 6 * size + 8 * W + 32
    while True:
        out = (I64 * cap)()
        got = fn(plan.buffer_info()[0], size, W, Q, out, cap)
        if got != SHORT:
            break
        cap = out[0]
    if got == FALLBACK:
        return None
    v = memoryview(out).cast("B").cast("q")[:got].tolist()
    rounds = plan[2]  # mixmoe_relay_plan's header: used, P, rounds, H
    at, sends, splits = 1, [], []

    def spans(n: int) -> list[tuple[int, int, int]]:
        it = iter(v[at : at + 3 * n])
        return list(zip(it, it, it, strict=False))

    for _ in range(rounds):
        splits.append((v[at : at + W], v[at + W : at + 2 * W]))
        at += 2 * W
        n = v[at]
        at += 1
        sends.append(spans(n))
        at += 3 * n
    n = v[at]
    at += 1
    slots = spans(n)
    at += 3 * n
    compact = []
    for _ in range(rounds):
        n = v[at]
        at += 1
        compact.append(None if n < 0 else spans(n))
        at += 3 * max(n, 0)
    cuts = []
    while at < len(v):  # one list per buffer
        n = v[at]
        cuts.append(v[at + 1 : at + 1 + n])
        at += 1 + n
    return sends, splits, slots, compact, cuts


def _capacity(W: int, size: int) -> int:
    """A first output size for ``size`` packed replica ints at W ranks (the C++ says when it is
    short, and how much it needs)."""
    return 4 + 8 * W + 16 * size


def _unpack(v: list[int], W: int) -> tuple:
    """The C entry's output (its doc) as RelayPlan's fields: tuples built off iterators."""
    P, num_rounds, H = v[1], v[2], v[3]
    at = 4
    pack = v[at : at + P]
    at += P
    rounds = []
    for _ in range(num_rounds):
        n_send, n_recv = v[at], v[at + 1]
        at += 2
        in_splits, out_splits = v[at : at + W], v[at + W : at + 2 * W]
        at += 2 * W
        sends = iter(v[at : at + 4 * n_send])
        at += 4 * n_send
        recvs = iter(v[at : at + 3 * n_recv])
        at += 3 * n_recv
        send = tuple(zip(sends, sends, sends, sends, strict=False))
        recv = tuple(zip(recvs, recvs, recvs, strict=False))
        rounds.append((send, in_splits, out_splits, recv))
    held = tuple(v[at : at + H])
    at += H
    slots = []
    for _ in range(H):
        n = v[at]
        at += 1
        takes = iter(v[at : at + 4 * n])
        at += 4 * n
        slots.append(tuple(zip(takes, takes, takes, takes, strict=False)))
    return pack, rounds, tuple(slots), held
