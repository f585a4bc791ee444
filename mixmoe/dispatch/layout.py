"""From routing ids to the block layout: which padded row holds which (token, choice).

Legend: T tokens, K top-k, N experts (= weight slots locally), R = T*K routed rows,
P padded rows.

Rows are sorted by expert with a stable sort, so within one expert rows keep token order
(token-major, then choice): the layout is a pure function of ``ids_TK``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mixmoe.schedule.blocks import BlockSchedule, build_block_schedule, slot_ends
from mixmoe.schedule.sort import num_blocks, sort_by_expert


def counts_to_host(counts: torch.Tensor) -> list[int]:
    """THE host synchronisation of a MoE layer's forward: the row counts come to the CPU once,
    and every buffer size and split of the step is derived from them."""
    return counts.tolist()


def count_matrix_to_host(rows_WX: torch.Tensor, header: int) -> tuple[torch.Tensor, torch.Tensor]:
    """THE host synchronisation of an expert-parallel layer's forward: the all-gathered rows
    ``[header ints | counts]`` come to the CPU once, as ``C_WN`` (a contiguous int64 tensor:
    the planners read it as one block) and the headers ``[W, header]`` (int64). No Python lists
    (at W = 1024 ranks and N = 4096 experts a list copy alone costs ~75 ms). On an accelerator
    the rows are split on the device and land in pinned memory from torch's caching host
    allocator, so the host neither copies C nor faults in fresh pages for it (a fresh 32 MiB
    pageable tensor: ~16 ms of page faults on this repo's CPU VM, the split on the host ~19 ms
    more); on the CPU the split is the one copy."""
    W, X = rows_WX.shape
    n = W * (X - header)
    if rows_WX.device.type == "cpu":
        every = rows_WX.to(torch.int64)
        return every[:, header:].contiguous(), every[:, :header]
    # counts first, then the headers: one flat device tensor, one transfer
    packed = torch.cat([rows_WX[:, header:].reshape(-1), rows_WX[:, :header].reshape(-1)])
    host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=packed.is_cuda)
    host.copy_(packed)  # synchronous: the sync
    return host[:n].view(W, X - header), host[n:].view(W, header)


@dataclass(frozen=True)
class RowLayout:
    """schedule: the block layout (slot = expert).
    token_P:  source token of each padded row, T for padding (selects a zero row).
    pos_TK:   padded row of each (token, choice), P for a dropped choice (selects a zero row).
    counts_N: rows per expert (device tensor); counts_host: the same as a Python list.
    """

    schedule: BlockSchedule
    token_P: torch.Tensor
    pos_TK: torch.Tensor
    counts_N: torch.Tensor
    counts_host: list[int]


def expert_row_layout(ids_TK: torch.Tensor, num_experts: int, block_size: int) -> RowLayout:
    """Sort the T*K routed rows by expert and cut them into blocks. Ids of -1 (dropped) get no
    row. One host sync (``counts_to_host``)."""
    T, K = ids_TK.shape
    device = ids_TK.device
    rows = sort_by_expert(ids_TK, num_experts)
    order_R, counts_N = rows.order_R, rows.counts_N
    counts_host = counts_to_host(counts_N)
    schedule = build_block_schedule(
        counts_N,
        torch.arange(num_experts, device=device),
        num_blocks(counts_host, block_size),
        block_size,
        num_rows=sum(counts_host),
    )
    ends = slot_ends(counts_host, list(range(num_experts)), num_experts, block_size)
    schedule = dataclasses.replace(schedule, slot_ends=ends)  # one segment per expert, in order
    src_P = schedule.src_P
    token_P = torch.where(src_P >= 0, order_R[src_P.clamp(min=0)] // K, T)
    pos_R = torch.full((T * K,), schedule.num_padded_rows, dtype=torch.int64, device=device)
    pos_R[order_R[: schedule.num_rows]] = schedule.padded_position_R()
    return RowLayout(schedule, token_P, pos_R.view(T, K), counts_N, counts_host)
