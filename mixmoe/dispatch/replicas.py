"""Replica weights: pack an expert's parameters into one row, move rows owner -> holders.

Legend: E owned experts, H replicas held here, Q packed parameters per expert.

The fetch is one ``all_to_all`` of packed rows. Its backward returns every replica's gradient to
the owner, where the pack's backward (``index_select``) adds it to the owned parameters' ``.grad``:
replicas never drift and optimizers only ever see owned parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from mixmoe.comm.autograd import cached_all_to_all
from mixmoe.ops.expert_mlp import ExpertWeights


@dataclass(frozen=True)
class FetchPlan:
    """Host-side description of one replica fetch on this rank.

    send_local_ids: owned expert indices (0..E-1) to send, grouped by destination rank ascending.
    in_splits / out_splits: experts sent to / received from each rank.
    recv_experts: global ids of the received replicas, in slot order (ascending).
    """

    send_local_ids: list[int]
    in_splits: list[int]
    out_splits: list[int]
    recv_experts: tuple[int, ...]

    @staticmethod
    def build(replicas, rank: int, world_size: int, experts_per_rank: int) -> FetchPlan:
        """``replicas``: ((g, holder ranks), ...) for every replicated expert, ascending g."""
        E = experts_per_rank
        to_rank: list[list[int]] = [[] for _ in range(world_size)]
        from_rank = [0] * world_size
        recv = []
        for g, holders in replicas:
            owner = g // E
            if owner == rank:
                for h in holders:
                    to_rank[h].append(g - rank * E)
            if rank in holders:
                from_rank[owner] += 1
                recv.append(g)
        return FetchPlan(
            send_local_ids=[i for ids in to_rank for i in ids],
            in_splits=[len(ids) for ids in to_rank],
            out_splits=from_rank,
            recv_experts=tuple(recv),
        )


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


def fetch_replicas(
    comm, owned: ExpertWeights, plan: FetchPlan, cached_HQ: torch.Tensor | None
) -> torch.Tensor:
    """Packed replica rows [H, Q] on this rank (``cached_HQ`` when every rank agreed the cache is
    valid: nothing moves forward, gradients still go home in backward)."""
    send = pack_experts(owned, plan.send_local_ids)
    trace = ("moe.replica_fetch", "exp")  # the gradient return's span: moe.replica_fetch.backward
    return cached_all_to_all(comm, send, plan.out_splits, plan.in_splits, cached_HQ, trace)


def weights_version(weights: ExpertWeights) -> int:
    """Sum of the in-place version counters of the owned parameters: changes whenever an
    optimizer step or ``load_state_dict`` writes them (not for writes through ``.data``)."""
    return sum(t._version for _, t in _present(weights))
