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


def _slot_major(counts: list[int], slots: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The receive buffer's segments (source-major) reordered slot-major (each slot's segments in
    source order), and per reordered segment the offset from its row in that order to its row in
    the receive buffer: (counts, slots, delta)."""
    order = sorted(range(len(counts)), key=lambda g: (slots[g], g))
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


def build_own_layout(
    routing: Routing, counts: list[int], rank: int, experts_per_rank: int, block_size: int
) -> OwnLayout:
    """The own work item: ``counts`` are this rank's row counts per global expert (host), the
    experts owned here are ``rank * E .. rank * E + E - 1``. No plan, no upload, no host sync."""
    ids_TK = routing.ids_TK
    T, K = ids_TK.shape
    R, E, B = T * K, experts_per_rank, block_size
    first, device = rank * E, ids_TK.device
    N = len(counts)
    # own experts -> 0..E-1, experts below them shift up by E, experts above keep their id:
    # [own | others ascending]; dropped (-1) rows sort last
    shifted_TK = torch.where(ids_TK < first, ids_TK + E, ids_TK)
    key_TK = torch.where((ids_TK >= first) & (ids_TK < first + E), ids_TK - first, shifted_TK)
    order_R = sort_by_expert(torch.where(ids_TK >= 0, key_TK, -1), N).order_R
    own_c = counts[first : first + E]
    counts_E = torch.tensor(own_c, dtype=torch.int64).to(device)  # E ints: no sync on a GPU
    sched = _schedule(counts_E, torch.arange(E, device=device), own_c, list(range(E)), E, B)
    own = ExpertWork(
        source="local",
        weights="owned",
        token_P=_source_rows(sched.src_P, order_R // max(K, 1), T),
        pos_TK=_positions(order_R, 0, sched, R).view(T, K),
        weights_TK=routing.weights_TK,
        schedule=sched,
        span="moe.experts_local",
    )
    return OwnLayout(own=own, order_R=order_R, num_own=sum(own_c))


def build_step_layout(
    routing: Routing,
    own: OwnLayout,
    counts: list[int],
    step: StepPlan,
    block_size: int,
    *,
    with_replicas: bool,
) -> StepLayout:
    """The rest of the step from the plan's bookkeeping: ``own`` from ``build_own_layout`` (same
    routing and counts), ``counts`` this rank's row counts per global expert (host).
    ``with_replicas``: build the replica work item (possibly empty: H = 0 here while other ranks
    hold replicas). One upload, no host sync."""
    ids_TK = routing.ids_TK
    T, K = ids_TK.shape
    R, B = T * K, block_size
    device = ids_TK.device
    rep_c = [counts[g] for g in step.rep_experts]
    H = len(rep_c)
    # the received rows are computed slot-major (blocks sorted by slot); the buffer stays
    # source-major, as the all_to_all delivers and returns it
    recv_c, recv_s, recv_delta = _slot_major(step.recv_counts, step.recv_slots)
    rep_H, rep_cG, rep_sG, recv_cG, recv_sG, recv_dG = _upload(
        [list(step.rep_experts), rep_c, list(range(H)), recv_c, recv_s, recv_delta],
        device,
    )
    n_own = own.num_own
    order_R = own.order_R
    if H:  # stable partition of the other rows: [replica experts | sent | dropped]
        rest_R = order_R[n_own:]
        away_R = ~torch.isin(ids_TK.reshape(-1)[rest_R], rep_H)
        order_R = torch.cat([order_R[:n_own], rest_R[torch.argsort(away_R, stable=True)]])
    token_R = order_R // max(K, 1)
    n_rep, n_send = sum(rep_c), sum(counts[g] for g in step.send_experts)
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
    sched_recv = _schedule(recv_cG, recv_sG, recv_c, recv_s, len(step.own_experts), B)
    n_recv = sched_recv.num_rows
    # buffer row of each slot-major row: its row plus its segment's offset
    seg_P = sched_recv.block_seg_Nb.repeat_interleave(B, output_size=sched_recv.num_padded_rows)
    src_P = sched_recv.src_P
    seg_R = torch.repeat_interleave(
        torch.arange(len(recv_c), device=device), recv_cG, output_size=n_recv
    )
    pos_recv = torch.empty(n_recv, dtype=torch.int64, device=device)
    pos_recv[torch.arange(n_recv, device=device) + recv_dG[seg_R]] = sched_recv.padded_position_R()
    received = ExpertWork(
        source="received",
        weights="owned",
        token_P=torch.where(src_P >= 0, src_P + recv_dG[seg_P], n_recv),
        pos_TK=pos_recv.view(n_recv, 1),
        weights_TK=None,
        schedule=sched_recv,
        span="moe.experts_remote",
    )
    first_send = n_own + n_rep
    send_R = order_R[first_send : first_send + n_send]
    pos_back_R = torch.full((R,), n_send, dtype=torch.int64, device=device)
    pos_back_R[send_R] = torch.arange(n_send, device=device)
    return StepLayout(
        own=own.own,
        replica=replica,
        received=received,
        order_R=order_R,
        send_token_S=token_R[first_send : first_send + n_send],
        pos_back_TK=pos_back_R.view(T, K),
        num_send=n_send,
    )
