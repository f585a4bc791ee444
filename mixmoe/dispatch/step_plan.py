"""Host-side bookkeeping of one expert-parallel step on one rank, derived from the count matrix
and the placement plan (CPU tensors only, no communication; identical on every rank for the
shared parts).

Legend: W ranks, E experts per rank, N = W*E experts, C the count matrix [W, N].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mixmoe.dispatch.replicas import RelayPlan
from mixmoe.dispatch.step_native import step_fields
from mixmoe.dispatch.step_shares import SourceRuns, share_fields
from mixmoe.placement.counts import CountSums
from mixmoe.placement.plan import Plan
from mixmoe.placement.ranges import range_rows_moved


@dataclass(frozen=True)
class StepPlan:
    """own_experts:  global ids owned here (slot e = own_experts[e]).
    rep_experts:  replicas held here this step, in replica-slot order.
    send_experts: experts whose rows leave this rank (ascending, hence grouped by owner).
    in_splits / out_splits: token rows sent to / received from each rank.
    recv_counts / recv_slots: segments of the receive buffer (source-major, then expert id) and
                  the weight slot each uses.
    fetch:        the replica fetch of this rank (the relay rounds).
    rows_moved:   rows crossing ranks over the whole group (0: every all-to-all is skipped, on
                  every rank alike).
    recv_replica: per receive segment, whether its slot is a replica slot (rows a helper computes
                  with its replica); empty: every slot is owned (plans without shares).
    runs:         this rank's rows cut by the plan's share entries (``step_shares.SourceRuns``),
                  or None: the replica rule alone (own rows here, replicated rows here, the rest
                  at their owner), the fast path.
    expert_rows_N: C summed over ranks (int64 [N]: every rank's rows of each expert), read off
                  the compiled bookkeeping's pass over C, or None (the Python's: the caller sums
                  C itself). Not compared: a function of C alone.
    """

    own_experts: tuple[int, ...]
    rep_experts: tuple[int, ...]
    send_experts: tuple[int, ...]
    in_splits: list[int]
    out_splits: list[int]
    recv_counts: list[int]
    recv_slots: list[int]
    fetch: RelayPlan
    rows_moved: int
    recv_replica: list[bool] = field(default_factory=list)
    runs: SourceRuns | None = None
    expert_rows_N: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def owned_rows_stay(self) -> bool:
        """Whether every row this rank routes to its own experts is computed here."""
        return self.runs is None or self.runs.owned_rows_stay


def build_step_plan(
    C_WN: torch.Tensor,
    plan: Plan,
    rank: int,
    experts_per_rank: int,
    distance: Callable[[int, int], int] | None = None,
    sums: CountSums | None = None,
    fetch: RelayPlan | None = None,
) -> StepPlan:
    """The step's bookkeeping for ``rank`` from the count matrix (int64 CPU tensor [W, N]) and the
    plan (``sums``: C's ``CountSums`` where known: the compiled part then sums no column). The
    replicas travel as the plan says (``plan.relay``: its relay route, ``placement.relay``:
    scatter + all-gather, split by node with ``distance``; else the owner's flat fan-out), as
    the cost model priced them. Compiled (``step_native``: one pass over C's
    rows, the plan's entries in C++) where it runs, else ``step_plan_python``: the same
    StepPlan (``tests/dispatch/test_step_native.py``). ``fetch``: the route of
    ``plan.replicas`` and ``plan.relay`` for this rank and ``distance``, built before
    (``RelayPlan.build``: a function of those alone; ``plan_ahead`` builds it on the planning
    thread with the plan it fits), else built here."""
    W, E, r = C_WN.shape[0], experts_per_rank, rank
    fields = step_fields(C_WN, plan, r, E, sums)
    if fields is None:
        return step_plan_python(C_WN, plan, r, E, distance)
    if fetch is None:
        fetch = RelayPlan.build(plan.replicas, r, W, E, distance, relay=plan.relay)
    assert fetch.recv_experts == fields["rep_experts"], "replica slot order must match the fetch"
    return StepPlan(own_experts=tuple(range(r * E, (r + 1) * E)), fetch=fetch, **fields)


def step_plan_python(
    C_WN: torch.Tensor,
    plan: Plan,
    rank: int,
    experts_per_rank: int,
    distance: Callable[[int, int], int] | None = None,
) -> StepPlan:
    """``build_step_plan`` in Python (the fallback, and the slow twin of ``step_native``):
    vectorised over ranks and experts (only the replicas, at most a few per rank, and the
    share entries are visited one by one; a plan's ranges are expanded into share entries
    first: ``Plan.expanded``)."""
    W, E, r = C_WN.shape[0], experts_per_rank, rank
    N = W * E
    # ranges (the planner's compact form) as the share entries this rank reads; the rows they
    # move across ranks (a total over every rank's segments) in closed form
    explicit, ranges_moved = plan.shares, range_rows_moved(C_WN, plan, E)
    # the share path whenever the whole plan has entries, even when this rank reads none of
    # them (its StepPlan then equals the fully expanded plan's)
    shared = bool(plan.shares or plan.ranges or plan.kept)
    plan = plan.expanded(C_WN, E, r)
    rep = plan.replica_slots(r)
    # only this rank's row and its own experts' columns of the count matrix are read (no [W, N]
    # temporaries: ~25 ms of them per step at W = 1024): a segment (s, g) stays at s when s
    # owns g or holds g's replica
    stays_N = torch.zeros(N, dtype=torch.bool)  # the experts whose rows stay at this rank
    stays_N[r * E : (r + 1) * E] = True
    stays_N[list(rep)] = True
    # rows this rank sends, by owner: its row of C over the experts neither owned nor replicated
    sent_N = torch.where(stays_N, 0, C_WN[r])
    in_splits = sent_N.view(W, E).sum(1).tolist()
    send = tuple(torch.nonzero(~stays_N).flatten().tolist())
    # rows this rank receives: every other source's rows for its own experts, unless the source
    # holds a replica
    replicated_WE = torch.zeros(W, E, dtype=torch.bool)
    for g, holders in plan.replicas:
        if g // E == r:
            replicated_WE[list(holders), g - r * E] = True
    mine_WE = C_WN[:, r * E : (r + 1) * E]
    recv_WE = torch.where(replicated_WE, 0, mine_WE)
    recv_WE[r] = 0
    recv_counts = recv_WE.reshape(-1).tolist()  # source-major, then own expert
    recv_slots = list(range(E)) * W
    out_splits = recv_WE.sum(1).tolist()
    # rows moved (every rank's): all rows less those computed where they were routed, at their
    # owner (the [W, W, E] view's diagonal blocks) or at a replica's holder (one gather)
    sources = [y for _, holders in plan.replicas for y in holders]
    experts = [g for g, holders in plan.replicas for _ in holders]
    stay = int(C_WN.reshape(W, W, E).diagonal(0, 0, 1).sum()) + int(C_WN[sources, experts].sum())
    rows_moved = int(C_WN.sum()) - stay + ranges_moved
    fetch = RelayPlan.build(plan.replicas, r, W, E, distance, relay=plan.relay)
    assert fetch.recv_experts == tuple(rep), "replica slot order must match the fetch order"
    step = StepPlan(
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
    if not shared:
        return step
    fields = share_fields(C_WN, plan, r, E, recv_WE, rows_moved, explicit)
    return dataclasses.replace(step, **fields)
