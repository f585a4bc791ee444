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

from mixmoe.placement.counts import CountSums
from mixmoe.schedule.blocks import BlockSchedule, build_block_schedule, slot_ends
from mixmoe.schedule.sort import num_blocks, sort_by_expert


def counts_to_host(counts: torch.Tensor) -> list[int]:
    """THE host synchronisation of a MoE layer's forward: the row counts come to the CPU once,
    and every buffer size and split of the step is derived from them."""
    return counts.tolist()


def count_matrix_to_host(
    rows_WX: torch.Tensor, header: int, by_column: bool = False
) -> tuple[torch.Tensor, torch.Tensor, CountSums | None]:
    """THE host synchronisation of an expert-parallel layer's forward: the all-gathered rows
    ``[header ints | counts]`` come to the CPU once, as ``C_WN`` (a contiguous int64 tensor:
    the planners read it as one block), the headers ``[W, header]`` (int64) and, from an
    accelerator, C's ``CountSums`` (None on the CPU: the planning thread sums C once,
    ``native_pricing.count_sums``). No Python lists (at W = 1024 ranks and N = 4096 experts a
    list copy alone costs ~75 ms). On an accelerator C is split and summed on the device and
    lands in pinned memory from torch's caching host allocator, so the host neither copies nor
    sums C nor faults in fresh pages for it (a fresh 32 MiB pageable tensor: ~16 ms of page
    faults on this repo's CPU VM, the split on the host ~19 ms more, the sums' pass ~1.4 ms);
    on the CPU the split is the one copy.

    ``by_column``: C stored by columns (``C_WN.t()`` contiguous; the same values), transposed
    where the rows are, for a planner that walks down C's columns (``StrategySpec``'s
    ``counts_by_column``: the compiled mixed planner then reads a column's counts eight to a
    cache line instead of one; W = 1024 under nodes: its plan ~15% and its fit ~25% faster)."""
    if rows_WX.device.type == "cpu":
        every = rows_WX.to(torch.int64)
        C_WN = every[:, header:]
        C_WN = C_WN.t().contiguous().t() if by_column else C_WN.contiguous()
        return C_WN, every[:, :header], None
    packed = pack_counts(rows_WX, header, by_column)
    host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=packed.is_cuda)
    host.copy_(packed)  # synchronous: the sync
    return unpack_counts(host, rows_WX.shape[0], rows_WX.shape[1] - header, header, by_column)


def pack_counts(rows_WX: torch.Tensor, header: int, by_column: bool = False) -> torch.Tensor:
    """``count_matrix_to_host``'s device side: the gathered rows ``[header ints | counts]`` as
    one flat int64 tensor [C_WN row-major (``by_column``: C_WN.t() row-major), headers
    row-major, C's column sums, C's row sums] (one transfer brings them all), computed where
    the rows are."""
    every = rows_WX.to(torch.int64)
    C_WN = every[:, header:]
    C_flat = (C_WN.t() if by_column else C_WN).reshape(-1)  # (transposed: a copy, on the device)
    return torch.cat([C_flat, every[:, :header].reshape(-1), C_WN.sum(0), C_WN.sum(1)])


def unpack_counts(
    packed: torch.Tensor, W: int, N: int, header: int, by_column: bool = False
) -> tuple[torch.Tensor, torch.Tensor, CountSums]:
    """``pack_counts``' tensor (on the host) as (C_WN, headers [W, header], CountSums): views,
    no copy (``by_column``: C_WN a view of C's transpose, ``C_WN.t()`` contiguous)."""
    ends = (W * N, W * N + W * header, W * N + W * header + N, W * N + W * header + N + W)
    C_flat, headers, colsum_N, rowsum_W = (
        packed[a:b] for a, b in zip((0, *ends[:3]), ends, strict=True)
    )
    C_WN = C_flat.view(N, W).t() if by_column else C_flat.view(W, N)
    return C_WN, headers.view(W, header), CountSums(colsum_N, rowsum_W)


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
