"""Device index tensors of one expert-parallel step on one rank, built from ONE host -> device
upload of the step's small integer lists.

Legend: T tokens here, K top-k, D model dim, W ranks, E experts per rank, N = W*E experts,
H replicas held here, R = T*K routed rows, P padded rows of one work item.

Rows are sorted once, by a relabelled expert id that puts this rank's segments in the order
[own experts | replica experts | experts sent away (ascending, hence grouped by owner) | dropped],
so every group is a contiguous run of the sorted rows and the send buffer is one gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixmoe.dispatch.step import ExpertWork
from mixmoe.dispatch.step_plan import StepPlan
from mixmoe.schedule.blocks import BlockSchedule, build_block_schedule
from mixmoe.schedule.sort import num_blocks, sort_by_expert
from mixmoe.types import Routing


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


def _schedule(counts_G, slots_G, counts: list[int], block_size: int) -> BlockSchedule:
    return build_block_schedule(
        counts_G, slots_G, num_blocks(counts, block_size), block_size, num_rows=sum(counts)
    )


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


def build_step_layout(
    routing: Routing,
    counts: list[int],
    step: StepPlan,
    num_experts: int,
    block_size: int,
    *,
    with_replicas: bool,
) -> StepLayout:
    """``counts``: this rank's row counts per global expert (host). ``with_replicas``: build the
    replica work item (possibly empty: H = 0 here while other ranks hold replicas). No host
    sync."""
    ids_TK = routing.ids_TK
    T, K = ids_TK.shape
    R, N, B = T * K, num_experts, block_size
    device = ids_TK.device
    order = step.own_experts + step.rep_experts + step.send_experts
    relabel = [0] * N
    for i, g in enumerate(order):
        relabel[g] = i
    own_c = [counts[g] for g in step.own_experts]
    rep_c = [counts[g] for g in step.rep_experts]
    E, H = len(own_c), len(rep_c)
    relabel_N, own_cG, own_sG, rep_cG, rep_sG, recv_cG, recv_sG = _upload(
        [
            relabel,
            own_c,
            list(range(E)),
            rep_c,
            list(range(H)),
            step.recv_counts,
            step.recv_slots,
        ],
        device,
    )
    relabelled_TK = torch.where(ids_TK >= 0, relabel_N[ids_TK.clamp(min=0)], -1)
    order_R = sort_by_expert(relabelled_TK, N).order_R
    token_R = order_R // max(K, 1)
    n_own, n_rep, n_send = sum(own_c), sum(rep_c), sum(counts[g] for g in step.send_experts)

    sched_own = _schedule(own_cG, own_sG, own_c, B)
    own = ExpertWork(
        source="local",
        weights="owned",
        token_P=_source_rows(sched_own.src_P, token_R, T),
        pos_TK=_positions(order_R, 0, sched_own, R).view(T, K),
        weights_TK=routing.weights_TK,
        schedule=sched_own,
        span="moe.experts_local",
    )
    replica = None
    if with_replicas:
        sched_rep = _schedule(rep_cG, rep_sG, rep_c, B)
        replica = ExpertWork(
            source="local",
            weights="replica",
            token_P=_source_rows(sched_rep.src_P, token_R[n_own:], T),
            pos_TK=_positions(order_R, n_own, sched_rep, R).view(T, K),
            weights_TK=routing.weights_TK,
            schedule=sched_rep,
            span="moe.experts_local",
        )
    sched_recv = _schedule(recv_cG, recv_sG, step.recv_counts, B)
    n_recv = sched_recv.num_rows
    received = ExpertWork(
        source="received",
        weights="owned",
        token_P=torch.where(sched_recv.src_P >= 0, sched_recv.src_P, n_recv),
        pos_TK=sched_recv.padded_position_R().view(n_recv, 1),
        weights_TK=None,
        schedule=sched_recv,
        span="moe.experts_remote",
    )
    first_send = n_own + n_rep
    send_R = order_R[first_send : first_send + n_send]
    pos_back_R = torch.full((R,), n_send, dtype=torch.int64, device=device)
    pos_back_R[send_R] = torch.arange(n_send, device=device)
    return StepLayout(
        own=own,
        replica=replica,
        received=received,
        order_R=order_R,
        send_token_S=token_R[first_send : first_send + n_send],
        pos_back_TK=pos_back_R.view(T, K),
        num_send=n_send,
    )
