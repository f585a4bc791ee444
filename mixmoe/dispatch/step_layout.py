"""Device index tensors of one expert-parallel step on one rank, in two parts.

Legend: T tokens here, K top-k, D model dim, W ranks, E experts per rank, N = W*E experts,
H replicas held here, R = T*K routed rows, P padded rows of one work item.

The rows end in the order [own experts | replica experts | experts sent away (ascending, hence
grouped by owner) | dropped], so every group is a contiguous run of the sorted rows and the send
buffer is one gather. It is reached in two stable sorts, so that the first part needs no plan:

1. ``build_own_layout`` (plan-independent: this rank's rows for its own experts stay here under
   every plan): one stable sort of all rows by the key [own experts | every other expert by id |
   dropped], and the own work item. No upload: its few sizes are already on the device.
2. ``build_step_layout`` (needs the plan): a stable partition of the rows after the own ones into
   [replica experts | the rest]. Replica and sent experts are both ascending in the plan's order,
   so the result equals one stable sort by the final key. One host -> device upload of the
   step's small integer lists.

Under a plan with share entries (``StepPlan.runs``, ``step_shares.py``) the rows are ordered by
their runs' keys instead (one stable sort by expert, one by key), the own rows may be fewer than
routed here, and a helper gets a second received item: the rows it computes with its replicas.

Every work item's blocks come in slot order (``BlockSchedule.slot_ends``), so bf16 on a Hopper
GPU runs each through torch's grouped GEMM (``mixmoe.ops.grouped_mm_expert_mlp``). The own and
replica items are slot-ordered by construction; the received rows stay source-major in their
buffer (the all_to_all's order, both ways) and are *computed* slot-major: the item's
``token_P``/``pos_TK`` map between the two.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mixmoe.dispatch.step import ExpertWork
from mixmoe.dispatch.step_plan import StepPlan
from mixmoe.schedule.blocks import BlockSchedule, build_block_schedule, slot_ends
from mixmoe.schedule.sort import num_blocks, sort_by_expert
from mixmoe.types import Routing


@dataclass(frozen=True)
class OwnLayout:
    """The plan-independent part of a step.
    own:     the work item of this rank's rows for its own experts.
    order_R: routed rows (``t * K + k``) in [own | other experts ascending | dropped] order.
    num_own: rows for own experts (host int; the first ``num_own`` of ``order_R``).
    """

    own: ExpertWork
    order_R: torch.Tensor
    num_own: int


@dataclass(frozen=True)
class StepLayout:
    """own / replica / received: the three work items (replica None when nothing is held).
    order_R:     routed rows (``t * K + k``) in [own | replica | send | dropped] order.
    send_token_S: token of each row sent away, in send order.
    pos_back_TK: row of the returned buffer holding each (token, choice); ``num_send`` if the
                 choice was not sent.
    num_send:    rows sent away from this rank.
    """

    own: ExpertWork
    replica: ExpertWork | None
    received: ExpertWork
    order_R: torch.Tensor
    send_token_S: torch.Tensor
    pos_back_TK: torch.Tensor
    num_send: int
    received_replica: ExpertWork | None = None


def _upload(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Every list in one int64 tensor, one copy to ``device``, returned as views."""
    flat = [v for values in lists for v in values]
    every = torch.tensor(flat, dtype=torch.int64, device=device)
    return list(torch.split(every, [len(values) for values in lists]))


def _schedule(
    counts_G, slots_G, counts: list[int], slots: list[int], num_slots: int, block_size: int
) -> BlockSchedule:
    """The block schedule of segments (device ``counts_G``/``slots_G``, host ``counts``/``slots``),
    with ``slot_ends`` when the segments come in slot order (every work item here does: the
    one-device grouped GEMM can then run on it)."""
    schedule = build_block_schedule(
        counts_G, slots_G, num_blocks(counts, block_size), block_size, num_rows=sum(counts)
    )
    ends = slot_ends(counts, slots, num_slots, block_size)
    return dataclasses.replace(schedule, slot_ends=ends)


def _slot_major(
    counts: list[int], slots: list[int], keep: list[bool]
) -> tuple[list[int], list[int], list[int]]:
    """The receive buffer's segments (source-major) that ``keep`` selects, reordered slot-major
    (each slot's segments in source order), and per reordered segment the offset from its row in
    that order to its row in the receive buffer: (counts, slots, delta)."""
    order = sorted((g for g in range(len(counts)) if keep[g]), key=lambda g: (slots[g], g))
    start, acc = [], 0
    for c in counts:
        start.append(acc)
        acc += c
    counts_new, delta, acc = [], [], 0
    for g in order:
        counts_new.append(counts[g])
        delta.append(start[g] - acc)
        acc += counts[g]
    return counts_new, [slots[g] for g in order], delta


def _positions(order_R, first: int, schedule: BlockSchedule, R: int) -> torch.Tensor:
    """Padded row of each routed row computed by the work of sorted rows ``first ..``; P else."""
    pos_R = torch.full((R,), schedule.num_padded_rows, dtype=torch.int64, device=order_R.device)
    pos_R[order_R[first : first + schedule.num_rows]] = schedule.padded_position_R()
    return pos_R


def _source_rows(src_P: torch.Tensor, rows: torch.Tensor, fill: int) -> torch.Tensor:
    """``rows[src]`` for each padded row, ``fill`` for padding."""
    if rows.numel() == 0:
        return torch.full_like(src_P, fill)
    return torch.where(src_P >= 0, rows[src_P.clamp(min=0)], fill)


def _own_work(routing: Routing, order_R, counts_E, own_c: list[int], block_size: int) -> ExpertWork:
    """The work item of the first ``sum(own_c)`` rows of ``order_R`` (own slots in order;
    ``counts_E`` the same counts on the device)."""
    T, K = routing.ids_TK.shape
    E, device = len(own_c), order_R.device
    sched = _schedule(
        counts_E, torch.arange(E, device=device), own_c, list(range(E)), E, block_size
    )
    return ExpertWork(
        source="local",
        weights="owned",
        token_P=_source_rows(sched.src_P, order_R // max(K, 1), T),
        pos_TK=_positions(order_R, 0, sched, T * K).view(T, K),
        weights_TK=routing.weights_TK,
        schedule=sched,
        span="moe.experts_local",
    )


def build_own_layout(
    routing: Routing, counts: list[int], rank: int, experts_per_rank: int, block_size: int
) -> OwnLayout:
    """The own work item: ``counts`` are this rank's row counts per global expert (host), the
    experts owned here are ``rank * E .. rank * E + E - 1``. No plan, no upload, no host sync.
    Valid whenever the plan computes all of them here (``StepPlan.owned_rows_stay``)."""
    ids_TK = routing.ids_TK
    E = experts_per_rank
    first, device = rank * E, ids_TK.device
    N = len(counts)
    # own experts -> 0..E-1, experts below them shift up by E, experts above keep their id:
    # [own | others ascending]; dropped (-1) rows sort last
    shifted_TK = torch.where(ids_TK < first, ids_TK + E, ids_TK)
    key_TK = torch.where((ids_TK >= first) & (ids_TK < first + E), ids_TK - first, shifted_TK)
    order_R = sort_by_expert(torch.where(ids_TK >= 0, key_TK, -1), N).order_R
    own_c = counts[first : first + E]
    counts_E = torch.tensor(own_c, dtype=torch.int64).to(device)  # E ints: no sync on a GPU
    own = _own_work(routing, order_R, counts_E, own_c, block_size)
    return OwnLayout(own=own, order_R=order_R, num_own=sum(own_c))


def _share_order(routing: Routing, num_experts: int, run_len_G, run_key_G, n_kept: int):
    """Routed rows in [own here | replicas here | sent by receiver, then expert | dropped] order
    under a share plan: sorted by expert (stable: the runs back to back, module doc of
    ``step_shares``), then stably by each row's run key."""
    by_expert_R = sort_by_expert(routing.ids_TK, num_experts).order_R
    run_R = torch.repeat_interleave(
        torch.arange(run_len_G.numel(), device=run_len_G.device), run_len_G, output_size=n_kept
    )  # run of each kept row, in by-expert order
    kept_R = by_expert_R[:n_kept][torch.argsort(run_key_G[run_R], stable=True)]
    return torch.cat([kept_R, by_expert_R[n_kept:]])


def _received_work(
    host, uploaded, replica: bool, num_slots: int, n_recv: int, block_size: int
) -> ExpertWork:
    """The work item of the received segments computed with owned (``replica`` False) or replica
    weights: computed slot-major, read from and written to the source-major receive buffer.
    ``host`` / ``uploaded``: the item's (counts, slots, delta) (``_slot_major``) on the host /
    on the device."""
    B = block_size
    c, sl, _ = host
    counts_G, slots_G, delta_G = uploaded
    device = counts_G.device
    sched = _schedule(counts_G, slots_G, c, sl, num_slots, B)
    n_item = sched.num_rows
    # buffer row of each slot-major row: its row plus its segment's offset
    seg_P = sched.block_seg_Nb.repeat_interleave(B, output_size=sched.num_padded_rows)
    src_P = sched.src_P
    seg_R = torch.repeat_interleave(
        torch.arange(len(c), device=device), counts_G, output_size=n_item
    )
    # rows of the buffer another item computes keep P (a zero row here)
    pos_recv = torch.full((n_recv,), sched.num_padded_rows, dtype=torch.int64, device=device)
    pos_recv[torch.arange(n_item, device=device) + delta_G[seg_R]] = sched.padded_position_R()
    return ExpertWork(
        source="received",
        weights="replica" if replica else "owned",
        token_P=torch.where(src_P >= 0, src_P + delta_G[seg_P], n_recv),
        pos_TK=pos_recv.view(n_recv, 1),
        weights_TK=None,
        schedule=sched,
        span="moe.experts_remote",
    )


def build_step_layout(
    routing: Routing,
    own: OwnLayout | None,
    counts: list[int],
    step: StepPlan,
    block_size: int,
    *,
    with_replicas: bool,
) -> StepLayout:
    """The rest of the step from the plan's bookkeeping: ``own`` from ``build_own_layout`` (same
    routing and counts), ``counts`` this rank's row counts per global expert (host).
    ``with_replicas``: build the replica work item (possibly empty: H = 0 here while other ranks
    hold replicas). One upload, no host sync.

    Under a share plan (``step.runs``) the rows are ordered by their runs' keys instead, and
    ``own`` is used only when the plan keeps every own row here (else None may be passed: the
    own item is built from the share order)."""
    ids_TK = routing.ids_TK
    T, K = ids_TK.shape
    R, B = T * K, block_size
    device = ids_TK.device
    runs = step.runs
    rep_c = runs.rep_c if runs is not None else [counts[g] for g in step.rep_experts]
    H = len(rep_c)
    E = len(step.own_experts)
    # the received rows are computed slot-major (blocks sorted by slot), one item per weight
    # set; the buffer stays source-major, as the all_to_all delivers and returns it
    flags = step.recv_replica or [False] * len(step.recv_counts)
    items = [False] + ([True] if any(flags) else [])
    recv_host = [
        _slot_major(step.recv_counts, step.recv_slots, [f == rep for f in flags]) for rep in items
    ]
    recv_lists = [values for item in recv_host for values in item]
    share_lists = [runs.run_len, runs.run_key, runs.own_c] if runs is not None else []
    rep_H, rep_cG, rep_sG, *rest = _upload(
        [list(step.rep_experts), rep_c, list(range(H)), *recv_lists, *share_lists], device
    )
    recv_up, share_up = rest[: 3 * len(items)], rest[3 * len(items) :]
    if runs is None:
        n_own, order_R = own.num_own, own.order_R
        if H:  # stable partition of the other rows: [replica experts | sent | dropped]
            rest_R = order_R[n_own:]
            away_R = ~torch.isin(ids_TK.reshape(-1)[rest_R], rep_H)
            order_R = torch.cat([order_R[:n_own], rest_R[torch.argsort(away_R, stable=True)]])
        own_item = own.own
        n_send = sum(counts[g] for g in step.send_experts)
    else:
        run_len_G, run_key_G, own_cG = share_up
        n_kept = sum(runs.run_len)
        order_R = _share_order(routing, len(counts), run_len_G, run_key_G, n_kept)
        n_own, n_send = sum(runs.own_c), runs.n_send
        if own is not None and runs.owned_rows_stay:
            own_item = own.own  # same rows, same slot order (the async own compute used it)
        else:
            own_item = _own_work(routing, order_R, own_cG, runs.own_c, B)
    token_R = order_R // max(K, 1)
    n_rep = sum(rep_c)
    replica = None
    if with_replicas:
        sched_rep = _schedule(rep_cG, rep_sG, rep_c, list(range(H)), H, B)
        replica = ExpertWork(
            source="local",
            weights="replica",
            token_P=_source_rows(sched_rep.src_P, token_R[n_own:], T),
            pos_TK=_positions(order_R, n_own, sched_rep, R).view(T, K),
            weights_TK=routing.weights_TK,
            schedule=sched_rep,
            span="moe.experts_local",
        )
    n_recv = sum(step.recv_counts)
    received = [
        _received_work(recv_host[i], recv_up[3 * i : 3 * i + 3], rep, H if rep else E, n_recv, B)
        for i, rep in enumerate(items)
    ]
    first_send = n_own + n_rep
    send_R = order_R[first_send : first_send + n_send]
    pos_back_R = torch.full((R,), n_send, dtype=torch.int64, device=device)
    pos_back_R[send_R] = torch.arange(n_send, device=device)
    return StepLayout(
        own=own_item,
        replica=replica,
        received=received[0],
        order_R=order_R,
        send_token_S=token_R[first_send : first_send + n_send],
        pos_back_TK=pos_back_R.view(T, K),
        num_send=n_send,
        received_replica=received[1] if len(received) > 1 else None,
    )
