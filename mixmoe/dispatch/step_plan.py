"""Host-side bookkeeping of one expert-parallel step on one rank, derived from the count matrix
and the placement plan (no tensors, no communication; identical on every rank for the shared
parts).

Legend: W ranks, E experts per rank, N = W*E experts, C the count matrix [W, N].
"""

from __future__ import annotations

from dataclasses import dataclass

from mixmoe.dispatch.replicas import FetchPlan
from mixmoe.placement.planner import Plan


@dataclass(frozen=True)
class StepPlan:
    """own_experts:  global ids owned here (slot e = own_experts[e]).
    rep_experts:  replicas held here this step, in replica-slot order.
    send_experts: experts whose rows leave this rank (ascending, hence grouped by owner).
    in_splits / out_splits: token rows sent to / received from each rank.
    recv_counts / recv_slots: segments of the receive buffer (source-major, then own expert) and
                  the owned slot each uses.
    fetch:        the replica fetch of this rank.
    rows_moved:   rows crossing ranks over the whole group (0: every all-to-all is skipped, on
                  every rank alike).
    """

    own_experts: tuple[int, ...]
    rep_experts: tuple[int, ...]
    send_experts: tuple[int, ...]
    in_splits: list[int]
    out_splits: list[int]
    recv_counts: list[int]
    recv_slots: list[int]
    fetch: FetchPlan
    rows_moved: int


def build_step_plan(C: list[list[int]], plan: Plan, rank: int, experts_per_rank: int) -> StepPlan:
    W, E, r = len(C), experts_per_rank, rank
    N = W * E
    rep = plan.replica_slots(r)
    rep_set = set(rep)
    send = tuple(g for g in range(N) if g // E != r and g not in rep_set)
    in_splits = [0] * W
    for g in send:
        in_splits[g // E] += C[r][g]
    recv_counts, recv_slots, out_splits = [], [], [0] * W
    for s in range(W):
        for e in range(E):
            g = r * E + e
            n = C[s][g] if plan.computed_at(s, g, E) == r and s != r else 0
            recv_counts.append(n)
            recv_slots.append(e)
            out_splits[s] += n
    rows_moved = sum(C[s][g] for s in range(W) for g in range(N) if plan.computed_at(s, g, E) != s)
    fetch = FetchPlan.build(plan.replicas, r, W, E)
    assert fetch.recv_experts == tuple(rep), "replica slot order must match the fetch order"
    return StepPlan(
        own_experts=tuple(range(r * E, (r + 1) * E)),
        rep_experts=tuple(rep),
        send_experts=send,
        in_splits=in_splits,
        out_splits=out_splits,
        recv_counts=recv_counts,
        recv_slots=recv_slots,
        fetch=fetch,
        rows_moved=rows_moved,
    )
