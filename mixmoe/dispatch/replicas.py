"""Replica weights: pack an expert's parameters into one row, relay rows owner -> holders.

Legend: E owned experts, H replicas held here, Q packed parameters per expert.

The fetch follows each hot expert's binomial relay tree (``placement/relay.py``): in round k every
rank that already holds the weights sends them to one that does not, so no rank sends more than
ceil(log2(H + 1)) copies of one expert (a flat fan-out makes the owner send all H). One
``all_to_all`` of packed rows per round, the rounds of every expert together. Backward runs the
rounds in reverse: each relay rank adds the gradients its receivers return to its own before
sending the sum on, and the owner's pack (``index_select``) adds the total to the owned
parameters' ``.grad`` once: replicas never drift and optimizers only ever see owned parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from mixmoe.comm.autograd import cached_all_to_all
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.placement.relay import relay_rounds
from mixmoe.tracing import trace_span

Row = tuple[
    int, int
]  # (buffer, row): buffer 0 = this rank's packed owned experts, k + 1 = round k's


@dataclass(frozen=True)
class RelayRound:
    """One round of the relay on this rank: one all_to_all of packed rows.

    send_rows: the rows sent, in send order (grouped by receiver ascending, then expert id), each
               read from a buffer this rank holds before the round.
    in_splits / out_splits: rows sent to / received from each rank.
    recv_experts: global id of each received row, in receive order (sender ascending, then id).
    """

    send_rows: tuple[Row, ...]
    in_splits: list[int]
    out_splits: list[int]
    recv_experts: tuple[int, ...]


@dataclass(frozen=True)
class RelayPlan:
    """Host-side description of the replica fetch on this rank: every hot expert's weights travel
    down its binomial relay tree (``placement.relay.relay_rounds``), the rounds of all experts
    run together, one all_to_all per round; every rank joins every round.

    pack_local_ids: owned experts (0..E-1, ascending) this rank sends in any round: packed once,
                    so the pack's backward adds each one's returning gradient to ``.grad`` once.
    rounds:         the rounds, in order.
    slot_rows:      where each replica slot's row arrives (slots in ``recv_experts`` order).
    recv_experts:   global ids of the replicas held here, ascending (the replica slot order).
    """

    pack_local_ids: list[int]
    rounds: tuple[RelayRound, ...]
    slot_rows: tuple[Row, ...]
    recv_experts: tuple[int, ...]

    @property
    def in_splits(self) -> list[int]:
        """Rows sent to each rank over all rounds (a trace's summary of the fetch)."""
        return [sum(col) for col in zip(*(rd.in_splits for rd in self.rounds), strict=True)]

    @property
    def out_splits(self) -> list[int]:
        """Rows received from each rank over all rounds."""
        return [sum(col) for col in zip(*(rd.out_splits for rd in self.rounds), strict=True)]

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
        plan's ``replicas``); ``distance``: the relay's nearest-first order (None: by rank);
        ``relay`` False: the owner sends every copy, in one round (a flat fan-out). Identical
        round structure on every rank (every rank computes every tree)."""
        E, r, W = experts_per_rank, rank, world_size
        if relay:
            trees = [(g, relay_rounds(g // E, holders, distance)) for g, holders in replicas]
        else:
            trees = [(g, (tuple((g // E, h) for h in holders),)) for g, holders in replicas]
        num_rounds = max((len(t) for _, t in trees), default=0)
        pack = sorted(  # owned experts this rank sends (it relays others from its buffers)
            {g - r * E for g, t in trees if g // E == r for edges in t for s, _ in edges if s == r}
        )
        where: dict[int, Row] = {r * E + i: (0, j) for j, i in enumerate(pack)}  # expert -> row
        rounds = []
        for k in range(num_rounds):
            edges = [(s, q, g) for g, t in trees if k < len(t) for s, q in t[k]]
            sends = sorted((q, g) for s, q, g in edges if s == r)  # by receiver, then expert
            recvs = sorted((s, g) for s, q, g in edges if q == r)  # the all_to_all's order
            in_splits, out_splits = [0] * W, [0] * W
            for q, _ in sends:
                in_splits[q] += 1
            for s, _ in recvs:
                out_splits[s] += 1
            # a sender holds what it sends: owned (packed) or received in an earlier round
            send_rows = tuple(where[g] for _, g in sends)
            for i, (_, g) in enumerate(recvs):
                where[g] = (k + 1, i)
            rounds.append(RelayRound(send_rows, in_splits, out_splits, tuple(g for _, g in recvs)))
        held = tuple(g for g, holders in replicas if r in holders)
        return RelayPlan(pack, tuple(rounds), tuple(where[g] for g in held), held)


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


def _gather(buffers: list[torch.Tensor], rows: tuple[Row, ...]) -> torch.Tensor:
    """``[buffers[b][i] for (b, i) in rows]`` as one tensor, always depending on the last buffer
    (an empty selection too): each round's send then depends on the round before, so backward
    runs the rounds' gradient exchanges in reverse order on every rank (a chain, never a hang),
    and the replicas depend on every round (each one's backward runs). No copy when ``rows``
    are exactly the last buffer's rows in order."""
    last = len(buffers) - 1
    if [b for b, _ in rows] == [last] * len(rows) and [i for _, i in rows] == list(
        range(buffers[last].shape[0])
    ):
        return buffers[last]
    device = buffers[0].device
    picked, slots = [], []
    for b in sorted({b for b, _ in rows} | {last}):
        mine = [j for j, (src, _) in enumerate(rows) if src == b]
        idx = torch.tensor([rows[j][1] for j in mine], dtype=torch.int64, device=device)
        picked.append(buffers[b].index_select(0, idx))
        slots += mine
    grouped = torch.cat(picked)  # rows grouped by buffer; put them back in the asked order
    if slots == sorted(slots):
        return grouped
    inverse = [0] * len(slots)
    for pos, j in enumerate(slots):
        inverse[j] = pos
    return grouped.index_select(0, torch.tensor(inverse, dtype=torch.int64, device=device))


def fetch_replicas(
    comm, owned: ExpertWeights, plan: RelayPlan, cached: list[torch.Tensor] | None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Packed replica rows [H, Q] on this rank, in slot order, and each round's received rows
    (what the cache keeps). ``cached``: every round's received rows from an earlier fetch, when
    every rank agreed the cache is valid: nothing moves forward, gradients still go home.

    Backward runs the rounds in reverse, each an all_to_all of gradients: a relay rank's
    gradient of a row it received is its own use plus everything its receivers sent back
    (autograd sums them) before it goes on to its sender; the owner's pack adds the total to
    ``.grad`` once."""
    buffers = [pack_experts(owned, plan.pack_local_ids)]
    trace = ("moe.replica_fetch", "exp")  # the gradient return's span: moe.replica_fetch.backward
    for k, rd in enumerate(plan.rounds):
        send = _gather(buffers, rd.send_rows)
        hit = None if cached is None else cached[k]
        with trace_span(
            "moe.replica_fetch",
            kind="comm",
            comm_func="all_to_all",
            group="exp",
            shape=tuple(send.shape),
            dtype=send.dtype,
            in_splits=rd.in_splits,
            out_splits=rd.out_splits,
        ):
            buffers.append(cached_all_to_all(comm, send, rd.out_splits, rd.in_splits, hit, trace))
    return _gather(buffers, plan.slot_rows), [b.detach() for b in buffers[1:]]


class ReplicaCache:
    """The replicas of the last fetch on this rank, reused while nothing they depend on changed.

    The key is the plan's replicas (hence the relay rounds) and the owners' weight versions,
    which every rank received in the count exchange: all ranks agree on a hit, and a hit moves
    nothing forward (gradients still go home in backward). An optimizer step changes an owner's
    version, so a replica never serves stale weights; new holders (a rotating hotspot) change
    the key: a full refetch.

    replicas_HQ: the replicas served by the last fetch (slot order, detached), or None.
    last_fetch:  the relay plan of the last fetch, or None.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.replicas_HQ: torch.Tensor | None = None
        self.rounds: list[torch.Tensor] | None = None  # each round's received rows
        self.last_fetch: RelayPlan | None = None

    def invalidate(self) -> None:
        self.key, self.replicas_HQ, self.rounds = None, None, None

    def fetch(
        self, comm, owned: ExpertWeights, plan: RelayPlan, key: tuple, reuse: bool
    ) -> tuple[torch.Tensor, bool]:
        """Packed replicas [H, Q] (slot order) and whether they came from the cache. ``key``:
        (plan replicas, owner versions); ``reuse``: the strategy caches replicas at all."""
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
