"""Replica weights: pack an expert's parameters into one row, relay rows owner -> holders.

Legend: E owned experts, H replicas held here, Q packed parameters per expert.

The fetch executes each hot expert's route of ``placement/relay.py`` (``relay_messages``): on
the owner's node (or with one link) a **scatter + all-gather** of chunks (round 0 the owner sends
chunk i, ``tensor_split`` order, to holder i; round 1 every holder sends its chunk to every
other holder); to holders on other nodes a scatter of chunks across, an **exchange** of each
chunk once to every other far node, and an all-gather inside each far node (3 rounds at most).
The owner sends one copy per link class, every holder receives one. A sender always holds the
very chunk it sends (or, the owner, the whole row it cuts it from). One ``all_to_all`` of a flat
buffer of pieces (whole rows or chunks) per round, the rounds of every expert together; every
rank joins every round, with nothing to send too. Where each piece lies (``_Layout``) is one
pass, compiled with the route (``relay_native``); pieces a later round passes on are first
re-laid in (expert, chunk) order, so a far holder's chunks are read as a few spans, and every
read goes through ``_Gather`` (a piece read k times: one reduction in backward).

Backward is autograd's reverse of the same ops, one ``all_to_all`` of gradients per round in
reverse order: a holder's replica gradient splits into its chunks; chunk j goes back to the rank
it came from, which adds it to its own chunk j's gradient (an all-gather's reverse is a
reduce-scatter: inside each far node, then back across the exchange); the owner's chunks of the
packed row add up to the row's gradient, and the pack (``index_select``, each owned expert
packed once) adds it to the owned parameters' ``.grad`` exactly once. Replicas never drift and
optimizers only ever see owned parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from mixmoe.comm.autograd import cached_all_to_all
from mixmoe.dispatch.relay_native import relay_layout, relay_plan_decoded, relay_plan_fields
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.placement.relay import MAX_ROUNDS, piece_range, relay_messages_at, relay_rounds
from mixmoe.tracing import trace_span

# (expert g, chunk j, chunks n): chunk j of g's packed row cut into n near-equal parts in
# ``torch.tensor_split`` order; (g, 0, 1) is the whole row
Piece = tuple[int, int, int]
# (buffer, entry, chunk j, chunks n): piece (j, n) read from entry ``entry`` of buffer ``buffer``
# (buffer 0 = this rank's packed owned rows, k + 1 = round k's received pieces); the entry is
# either that very piece or the whole row it is cut from
Take = tuple[int, int, int, int]


@dataclass(frozen=True)
class RelayRound:
    """One round of the replica fetch on this rank: one all_to_all of a flat buffer of pieces.

    send:       the pieces sent, in send order (receiver ascending, then expert id, chunk), each
                read from a buffer this rank holds before the round.
    in_splits / out_splits: pieces sent to / received from each rank (the element splits follow
                from Q: ``_Layout``).
    recv:       each received piece, in receive order (sender ascending, then expert id, chunk).
    """

    send: tuple[Take, ...]
    in_splits: list[int]
    out_splits: list[int]
    recv: tuple[Piece, ...]

    @property
    def recv_experts(self) -> tuple[int, ...]:
        """Global expert id of each received piece, in receive order."""
        return tuple(g for g, _, _ in self.recv)


@dataclass(frozen=True, eq=False, repr=False)
class RelayPlan:
    """Host-side description of the replica fetch on this rank: every hot expert's weights travel
    by its route (``placement.relay.relay_messages``: scatter + all-gather of chunks, split by
    node across nodes), the rounds of all experts run together, one all_to_all per round; every
    rank joins every round.

    pack_local_ids: owned experts (0..E-1, ascending) this rank sends in any round: packed once,
                    so the pack's backward adds each one's returning gradient to ``.grad`` once.
    num_rounds:     the rounds (the same on every rank).
    recv_experts:   global ids of the replicas held here, ascending (the replica slot order).
    rounds:         the rounds, in order (``RelayRound``).
    slot_pieces:    for each replica slot (``recv_experts`` order), where its chunks arrive, in
                    chunk order (one ``Take`` for a whole row).

    Built compiled (``build``), ``rounds`` and ``slot_pieces`` are read off the compiled output
    the first time they are read: the fetch itself reads only the compiled layout
    (``_Layout``), and a far holder's ~10**4 piece tuples (W = 1024 under nodes) cost the
    planning thread ~1.5 ms a step to build and free. Equality and repr are the decoded
    fields'.
    """

    pack_local_ids: list[int]
    num_rounds: int
    recv_experts: tuple[int, ...]
    # the compiled build's output, which the compiled layout reads (``relay_native``), or None
    compiled: tuple | None = None
    # (rounds, slot_pieces): the Python's, or decoded from ``compiled`` when first read
    decoded: tuple | None = None

    @staticmethod
    def of(pack_local_ids, rounds, slot_pieces, recv_experts) -> RelayPlan:
        """The plan of these fields (no compiled output)."""
        rounds = tuple(rounds)
        return RelayPlan(pack_local_ids, len(rounds), recv_experts, None, (rounds, slot_pieces))

    @property
    def rounds(self) -> tuple[RelayRound, ...]:
        return self._decoded()[0]

    @property
    def slot_pieces(self) -> tuple[tuple[Take, ...], ...]:
        return self._decoded()[1]

    def _decoded(self) -> tuple:
        if self.decoded is None:  # the same tuples from any thread: a race only decodes twice
            rounds, slots = relay_plan_decoded(self.compiled)
            got = (tuple(RelayRound(*rd) for rd in rounds), slots)
            object.__setattr__(self, "decoded", got)
        return self.decoded

    def _key(self) -> tuple:
        return self.pack_local_ids, self.rounds, self.slot_pieces, self.recv_experts

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RelayPlan) and self._key() == other._key()

    __hash__ = None  # lists inside: unhashable, as the dataclass was

    def __repr__(self) -> str:
        pack, rounds, slots, held = self._key()
        return (
            f"RelayPlan(pack_local_ids={pack!r}, rounds={rounds!r}, slot_pieces={slots!r}, "
            f"recv_experts={held!r})"
        )

    @staticmethod
    def build(
        replicas,
        rank: int,
        world_size: int,
        experts_per_rank: int,
        distance: Callable[[int, int], int] | None = None,
        *,
        relay: bool = True,
    ) -> RelayPlan:
        """``replicas``: ((g, holder ranks), ...) for every replicated expert, ascending g (a
        plan's ``replicas``); ``distance``: the topology that splits the route by node (None:
        one link); ``relay`` False: the owner sends every whole copy, in one
        round (a flat fan-out). Identical round structure on every rank: the most rounds of any
        expert's route (``relay_rounds``, closed form); each rank builds only its own messages
        (``relay_messages_at``: O(H) per expert it owns or holds, where the whole route has
        O(H**2)). Compiled (``relay_native``) where it runs, else ``relay_plan_python``: the
        same plan (``tests/dispatch/test_relay_native.py``)."""
        built = relay_plan_fields(replicas, rank, world_size, experts_per_rank, distance, relay)
        if built is None:
            return relay_plan_python(replicas, rank, world_size, experts_per_rank, distance, relay)
        pack, num_rounds, held, compiled = built
        return RelayPlan(pack, num_rounds, held, compiled)


def relay_plan_python(
    replicas,
    rank: int,
    world_size: int,
    experts_per_rank: int,
    distance: Callable[[int, int], int] | None = None,
    relay: bool = True,
) -> RelayPlan:
    """``RelayPlan.build`` in Python (the fallback, and the slow twin of ``relay_native``)."""
    E, r, W = experts_per_rank, rank, world_size
    mine = [(g, holders) for g, holders in replicas if g // E == r or r in holders]
    if relay:
        routes = [(g, relay_messages_at(r, g // E, holders, distance)) for g, holders in mine]
        rounds_g = (relay_rounds(g // E, holders, distance) for g, holders in replicas)
    else:  # the owner's flat fan-out: one round
        routes = [(g, (tuple((g // E, h, 0, 1) for h in holders if r in (g // E, h)),))
                  for g, holders in mine]  # fmt: skip
        rounds_g = (1 for _, holders in replicas if holders)
    num_rounds = 0
    for k in rounds_g:  # the most of any expert's route (no route has more than 3)
        num_rounds = max(num_rounds, k)
        if num_rounds == MAX_ROUNDS:
            break
    pack = sorted(  # owned experts this rank sends (it relays others from its buffers)
        {g - r * E for g, m in routes if g // E == r for msgs in m for s, *_ in msgs if s == r}
    )
    # piece -> (buffer, entry) of every piece this rank holds: its packed rows first
    where: dict[Piece, tuple[int, int]] = {(r * E + i, 0, 1): (0, j) for j, i in enumerate(pack)}
    rounds = []
    for k in range(num_rounds):
        sends, recvs = [], []  # this rank's messages of round k (it sends, it receives)
        for g, m in routes:
            for s, q, j, n in m[k] if k < len(m) else ():
                if s == r:
                    sends.append((q, g, j, n))
                if q == r:
                    recvs.append((s, g, j, n))
        sends.sort()
        recvs.sort()  # all_to_all order
        in_splits, out_splits = [0] * W, [0] * W
        send = []
        for q, g, j, n in sends:
            in_splits[q] += 1
            # a sender holds what it sends: that very piece, or the whole row to cut it from
            at = where.get((g, j, n))
            send.append((*(at if at is not None else where[(g, 0, 1)]), j, n))
        for i, (s, g, j, n) in enumerate(recvs):
            out_splits[s] += 1
            where[(g, j, n)] = (k + 1, i)
        recv = tuple((g, j, n) for _, g, j, n in recvs)
        rounds.append(RelayRound(tuple(send), in_splits, out_splits, recv))
    held = tuple(g for g, holders in replicas if r in holders)
    chunks = {g: n for (g, _, n) in where}  # a held expert arrives whole or in n chunks
    slots = tuple(
        tuple((*where[(g, j, chunks[g])], j, chunks[g]) for j in range(chunks[g])) for g in held
    )
    return RelayPlan.of(pack, rounds, slots, held)


def _present(weights: ExpertWeights) -> list[tuple[str, torch.Tensor]]:
    return [
        (f.name, getattr(weights, f.name))
        for f in fields(weights)
        if getattr(weights, f.name) is not None
    ]


def pack_experts(weights: ExpertWeights, local_ids: list[int]) -> torch.Tensor:
    """[len(local_ids), Q]: each selected expert's parameters flattened and concatenated."""
    parts = _present(weights)
    idx = torch.tensor(local_ids, dtype=torch.int64, device=weights.w1_SDF.device)
    n = len(local_ids)
    return torch.cat(
        [t.index_select(0, idx).reshape(n, math.prod(t.shape[1:])) for _, t in parts], dim=1
    )


def unpack_experts(packed_HQ: torch.Tensor, like: ExpertWeights) -> ExpertWeights:
    """Inverse of ``pack_experts`` (views, differentiable), shaped like ``like``'s tensors."""
    H = packed_HQ.shape[0]
    out, col = {}, 0
    for name, t in _present(like):
        width = math.prod(t.shape[1:])
        out[name] = packed_HQ[:, col : col + width].reshape((H,) + tuple(t.shape[1:]))
        col += width
    return ExpertWeights(**out)


def _piece_size(j: int, n: int, Q: int) -> int:
    """Elements in chunk j of a packed row of Q cut into n (``piece_range``'s stop - start)."""
    return Q // n + (j < Q % n)


class _Layout:
    """Where every piece of a fetch lies in its flat buffers, for packed rows of Q elements;
    built once per fetch, compiled from the compiled plan's output where it has one
    (``relay_native``), else in one pass over the pieces here.

    Buffers, in the order the fetch makes them: 0 the packed owned rows; then per round k the
    pieces it received, back to back in receive order (sender-major), and, for every round but
    the last that did not arrive in that order already, the same pieces re-laid in (expert,
    chunk) order (``compact[k]``: one copy of what the round received). A far holder's chunks of an expert arrive from many senders,
    interleaved with other experts'; the next round passes them on to each holder of its node.
    Read from the received buffer that was one view per chunk and per receiver, and one
    gradient accumulation per repeated read in backward (W = 1024 under nodes: 3556 views, 4066
    accumulations, ~30 ms of the backward on an H200); re-laid, they are 2-3 runs per expert.

    sends[k] / slots / compact[k]: the reads that make round k's send buffer / the replicas /
      the re-laid buffer (None: not re-laid), as (buffer, start, stop) spans in order,
      consecutive pieces that lie back to back in one buffer merged into one span.
    splits[k]: round k's (elements sent to, elements received from) each rank.
    cuts[b]: the boundaries of every span read from buffer b (and its ends): each buffer is
      split ONCE into consecutive views there (``torch.split``: one backward node per buffer that
      concatenates its parts' gradients; a ``narrow`` per read would allocate a zero gradient of
      the whole buffer per read, quadratic in the reads).
    """

    def __init__(self, plan: RelayPlan, Q: int) -> None:
        self.Q = Q
        got = None if plan.compiled is None else relay_layout(plan.compiled, Q)
        if got is None:
            self._build(plan, Q)
        else:  # compiled (``relay_native``): the same fields (tests/dispatch/test_relay_native.py)
            self.sends, self.splits, self.slots, self.compact, self.cuts = got
        self.index = [{x: i for i, x in enumerate(c)} for c in self.cuts]

    def _build(self, plan: RelayPlan, Q: int) -> None:
        """The fields in Python (the fallback, and the compiled layout's slow twin)."""
        # each buffer's entry starts (and its end), and whether each entry is a whole row
        P = len(plan.pack_local_ids)
        starts = [list(range(0, (P + 1) * Q, Q))]
        whole = [[True] * P]
        # round k's buffer as takes read it: (buffer, its entry of each received piece)
        reads: dict[int, tuple[int, list[int]]] = {}
        raws = []  # round k's received buffer
        self.compact: list[list[tuple[int, int, int]] | None] = []
        for k, rd in enumerate(plan.rounds):
            sizes = [_piece_size(j, n, Q) for _, j, n in rd.recv]
            raw = len(starts)
            raws.append(raw)
            starts.append(_ends(sizes))
            whole.append([n == 1 for _, _, n in rd.recv])
            entries = list(range(len(sizes)))
            order = sorted(entries, key=rd.recv.__getitem__)  # (expert, chunk) order
            # the last round is read by the slots alone; a round received in that order already
            # (round 0: from the owners, ascending with their experts) needs no copy
            if k + 1 == len(plan.rounds) or order == entries:
                self.compact.append(None)
                reads[k + 1] = (raw, entries)
                continue
            for at, i in enumerate(order):
                entries[i] = at
            ends = starts[raw]
            self.compact.append(self._merged((raw, ends[i], ends[i + 1]) for i in order))
            reads[k + 1] = (len(starts), entries)
            starts.append(_ends([sizes[i] for i in order]))
            whole.append([rd.recv[i][2] == 1 for i in order])
        self.starts, self.whole, self.reads = starts, whole, reads
        self.sends: list[list[tuple[int, int, int]]] = []
        self.splits: list[tuple[list[int], list[int]]] = []
        for k, rd in enumerate(plan.rounds):
            spans, sent = self._spans(rd.send)
            in_splits, pos = [], 0  # elements to each receiver: its pieces' sizes, summed
            for n in rd.in_splits:
                in_splits.append(sent[pos + n] - sent[pos])
                pos += n
            ends, out_splits, pos = starts[raws[k]], [], 0
            for n in rd.out_splits:  # elements from each sender, as received
                out_splits.append(ends[pos + n] - ends[pos])
                pos += n
            self.sends.append(spans)
            self.splits.append((in_splits, out_splits))
        self.slots = self._spans(t for takes in plan.slot_pieces for t in takes)[0]
        cuts = [{0, s[-1]} for s in starts]
        for spans in [*self.sends, self.slots, *(c for c in self.compact if c is not None)]:
            for b, lo, hi in spans:
                cuts[b].add(lo)
                cuts[b].add(hi)
        self.cuts = [sorted(c) for c in cuts]

    def _spans(self, takes) -> tuple[list[tuple[int, int, int]], list[int]]:
        """The takes' spans (a take names round k's piece by its receive entry: read where the
        buffer of round k lies, ``reads``), merged, and the running total of elements read (one
        entry per take, from 0)."""
        spans: list[tuple[int, int, int]] = []
        read = [0]
        for b, i, j, n in takes:
            if b:
                b, entries = self.reads[b]
                i = entries[i]
            lo, hi = self.starts[b][i], self.starts[b][i + 1]
            if self.whole[b][i] and n > 1:  # a chunk cut from a whole row (an owner scattering)
                lo, hi = piece_range(j, n, self.Q)
                lo, hi = lo + self.starts[b][i], hi + self.starts[b][i]
            read.append(read[-1] + hi - lo)
            spans.append((b, lo, hi))
        return self._merged(spans), read

    @staticmethod
    def _merged(spans) -> list[tuple[int, int, int]]:
        """``spans`` merged where one starts where the last stopped in the same buffer."""
        out: list[tuple[int, int, int]] = []
        for b, lo, hi in spans:
            if out and out[-1][0] == b and out[-1][2] == lo:
                out[-1] = (b, out[-1][1], hi)
            else:
                out.append((b, lo, hi))
        return out


def _ends(sizes: list[int]) -> list[int]:
    """0, then the running sum of ``sizes``: where each entry starts, and the end."""
    ends = [0]
    for x in sizes:
        ends.append(ends[-1] + x)
    return ends


class _Buffers:
    """The fetch's flat buffers, each split at its ``_Layout`` cuts, plus an empty last part:
    what a round's send or the replicas depend on to keep the chain."""

    def __init__(self, layout: _Layout) -> None:
        self.layout = layout
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def add(self, buffer: torch.Tensor) -> None:
        """Buffer ``len(self.parts)``, split at its cuts (and an empty part at its end)."""
        cuts = self.layout.cuts[len(self.parts)]
        sizes = [hi - lo for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)] + [0]
        self.parts.append(torch.split(buffer, sizes))

    def gather(self, spans) -> torch.Tensor:
        """The views of ``spans`` (a span covering several parts as those parts), then the
        empty last part of the latest buffer (a dependency, no data: the chain), concatenated
        (``_Gather``: a part read k times costs one reduction in backward, not k - 1)."""
        index, keys = self.layout.index, []
        for b, lo, hi in spans:
            keys += [(b, i) for i in range(index[b][lo], index[b][hi])]
        keys.append((len(self.parts) - 1, len(self.parts[-1]) - 1))  # the chain
        first: dict[tuple[int, int], int] = {}  # each distinct part, in order of first read
        order = [first.setdefault(k, len(first)) for k in keys]
        cuts = self.layout.cuts  # part i of buffer b: [cuts[b][i], cuts[b][i + 1]); the chain: 0
        sizes = [cuts[b][i + 1] - cuts[b][i] if i + 1 < len(cuts[b]) else 0 for b, i in first]
        return _Gather.apply(order, sizes, *(self.parts[b][i] for b, i in first))


class _Gather(torch.autograd.Function):
    """``cat(parts[i] for i in order)``. Backward: each part's gradient is the sum of its
    reads' slices, one ``stack(...).sum(0)`` for a part read more than once (a piece passed on
    to every holder of a node, a chunk sent to every far node), where autograd would launch one
    accumulation per repeated read (W = 1024 under nodes: ~4000 of them before the re-laying,
    ~550 after, each a kernel launch on a GPU). The sum's order is fixed: deterministic."""

    @staticmethod
    def forward(ctx, order: list[int], sizes: list[int], *parts: torch.Tensor) -> torch.Tensor:
        ctx.order, ctx.sizes = order, sizes  # each part's elements (the layout's cuts)
        return torch.cat([parts[i] for i in order])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        reads: list[list[torch.Tensor]] = [[] for _ in ctx.sizes]
        slices = torch.split(grad, [ctx.sizes[i] for i in ctx.order])
        for i, piece in zip(ctx.order, slices, strict=True):
            reads[i].append(piece)
        grads = []
        for i, got in enumerate(reads):
            if not ctx.needs_input_grad[2 + i]:
                grads.append(None)
            elif len(got) == 1:
                grads.append(got[0])
            else:  # one reduction over the reads, in read order
                grads.append(torch.stack(got).sum(0))
        return (None, None, *grads)


def fetch_replicas(
    comm, owned: ExpertWeights, plan: RelayPlan, cached: list[torch.Tensor] | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Packed replica rows [H, Q] on this rank, in slot order, and each round's received flat
    buffer (what the cache keeps). ``cached``: every round's received buffer from an earlier
    fetch, when every rank agreed the cache is valid: nothing moves forward, gradients still go
    home.

    Each round's send buffer and the replicas always depend on the buffer received last (an
    empty part of it when nothing is read from it): backward then runs the rounds' gradient
    exchanges in reverse order on every rank (a chain, never a hang), and every round's
    backward runs. Backward: see the module doc (reduce-scatter, then home to the owner)."""
    packed_PQ = pack_experts(owned, plan.pack_local_ids)
    Q = packed_PQ.shape[1]
    layout = _Layout(plan, Q)
    bufs = _Buffers(layout)
    bufs.add(packed_PQ.reshape(-1))  # flat: entry i of buffer 0 is packed row i
    received = []
    trace = ("moe.replica_fetch", "exp")  # the gradient return's span: moe.replica_fetch.backward
    for k in range(plan.num_rounds):
        send = bufs.gather(layout.sends[k])
        in_splits, out_splits = layout.splits[k]
        hit = None if cached is None else cached[k]
        with trace_span(
            "moe.replica_fetch",
            kind="comm",
            comm_func="all_to_all",
            group="exp",
            shape=tuple(send.shape),
            dtype=send.dtype,
            in_splits=in_splits,
            out_splits=out_splits,
        ):
            out = cached_all_to_all(comm, send, out_splits, in_splits, hit, trace)
        received.append(out.detach())
        bufs.add(out)
        if layout.compact[k] is not None:  # re-laid in (expert, chunk) order: one copy
            bufs.add(bufs.gather(layout.compact[k]))
    # every slot's chunks in order, back to back: one copy, viewed as rows
    flat = bufs.gather(layout.slots)
    return flat.view(len(plan.recv_experts), Q), received


class ReplicaCache:
    """The replicas of the last fetch on this rank, reused while nothing they depend on changed.

    The key is the plan's replicas and its ``relay`` flag (together they fix every round's
    messages on every rank) and the owners' weight versions, which every rank received in the
    count exchange: all ranks agree on a hit, and a hit moves
    nothing forward (gradients still go home in backward). An optimizer step changes an owner's
    version, so a replica never serves stale weights; new holders (a rotating hotspot) change
    the key: a full refetch.

    replicas_HQ: the replicas served by the last fetch (slot order, detached), or None.
    last_fetch:  the relay plan of the last fetch, or None.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.replicas_HQ: torch.Tensor | None = None
        self.rounds: list[torch.Tensor] | None = None  # each round's received buffer
        self.last_fetch: RelayPlan | None = None

    def invalidate(self) -> None:
        self.key, self.replicas_HQ, self.rounds = None, None, None

    def fetch(
        self, comm, owned: ExpertWeights, plan: RelayPlan, key: tuple, reuse: bool
    ) -> tuple[torch.Tensor, bool]:
        """Packed replicas [H, Q] (slot order) and whether they came from the cache. ``key``:
        (plan replicas, relay flag, owner versions); ``reuse``: the strategy caches replicas at all."""
        hit = reuse and key == self.key
        replicas_HQ, rounds = fetch_replicas(comm, owned, plan, self.rounds if hit else None)
        if reuse:
            self.key, self.replicas_HQ, self.rounds = key, replicas_HQ.detach(), rounds
        self.last_fetch = plan
        return replicas_HQ, hit


def weights_version(weights: ExpertWeights) -> int:
    """Sum of the in-place version counters of the owned parameters: changes whenever an
    optimizer step or ``load_state_dict`` writes them (not for writes through ``.data``)."""
    return sum(t._version for _, t in _present(weights))
