"""The block layout: segments of rows cut into fixed-size blocks.

Legend: G segments, S weight slots, Nb blocks, B block size (64 by default), R valid rows,
P = Nb * B padded rows.

A *segment* is a run of rows that all use one weight slot (locally: all rows routed to one expert;
under the mixed strategy: the rows one source rank sends to one expert). Segments are laid out one
after another in a row buffer of R rows ("sorted order"). Each segment is cut into ceil(c / B)
blocks; the last block of a segment may be partial: its tail rows are *masked*, never dropped.

The padded layout gives every block B rows: padded row ``b * B + i`` holds sorted row
``block_row_start[b] + i`` when ``i < block_rows[b]`` and is padding otherwise (``src_P = -1``).
Kernels index weights by ``block_slot`` and rows by ``src_P`` (fused gather) or read the padded
buffer directly.

Everything here is built with vectorised torch ops: no Python loop over rows or blocks.
``mixmoe.reference.schedule`` is the loop twin that defines the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockSchedule:
    """Frozen description of a block layout (all int64 tensors on one device).

    block_size:       B.
    block_slot_Nb:    weight slot of each block.
    block_seg_Nb:     segment of each block.
    block_row_start_Nb: first sorted row of each block.
    block_rows_Nb:    valid rows of each block, in [1, B].
    seg_row_start_G:  first sorted row of each segment (exclusive cumsum of the counts).
    seg_counts_G:     rows of each segment.
    seg_block_start_G: first block of each segment.
    src_P:            sorted row held by each padded row, -1 for masked padding.
    num_rows:         R = total valid rows (a Python int).
    slot_ends:        when the blocks are sorted by slot with slot s's blocks contiguous (the
                      one-device layout), the padded row where each slot's blocks end (Python
                      ints, one per slot: grouped GEMMs with per-group offsets run on the layout
                      as it is); None otherwise.
    """

    block_size: int
    block_slot_Nb: torch.Tensor
    block_seg_Nb: torch.Tensor
    block_row_start_Nb: torch.Tensor
    block_rows_Nb: torch.Tensor
    seg_row_start_G: torch.Tensor
    seg_counts_G: torch.Tensor
    seg_block_start_G: torch.Tensor
    src_P: torch.Tensor
    num_rows: int
    slot_ends: tuple[int, ...] | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.block_slot_Nb.numel())

    @property
    def num_padded_rows(self) -> int:
        return self.num_blocks * self.block_size

    def padded_position_R(self) -> torch.Tensor:
        """Padded row of every sorted row (the inverse of ``src_P`` on its valid entries),
        computed arithmetically: no device sync."""
        device, B = self.src_P.device, self.block_size
        seg_R = torch.repeat_interleave(
            torch.arange(self.seg_counts_G.numel(), device=device),
            self.seg_counts_G,
            output_size=self.num_rows,
        )
        within_R = torch.arange(self.num_rows, device=device) - self.seg_row_start_G[seg_R]
        return (self.seg_block_start_G[seg_R] + within_R // B) * B + within_R % B


def slot_ends(
    counts_G: list[int], slots_G: list[int], num_slots: int, block_size: int
) -> tuple[int, ...] | None:
    """``BlockSchedule.slot_ends`` of segments with host counts and slots, in layout order: the
    padded row where each slot's blocks end, or None when the segments' slots decrease somewhere
    (the blocks are then not sorted by slot: the walk below stops at the first decrease)."""
    ends, end, g = [], 0, 0
    for s in range(num_slots):
        while g < len(slots_G) and slots_G[g] == s:
            end += -(-counts_G[g] // block_size) * block_size
            g += 1
        ends.append(end)
    return tuple(ends) if g == len(slots_G) else None


def build_block_schedule(
    seg_counts_G: torch.Tensor,
    seg_slot_G: torch.Tensor,
    num_blocks: int | None = None,
    block_size: int = 64,
    num_rows: int | None = None,
) -> BlockSchedule:
    """Cut segments of ``seg_counts_G`` rows (segment g uses slot ``seg_slot_G[g]``) into blocks.

    ``num_blocks`` (``sum(ceil(c / B))``) and ``num_rows`` (``sum(c)``) may be passed when the
    caller already knows them on the host; otherwise they are read from the device here (a small
    host sync each).
    Zero-row segments get no block.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if seg_counts_G.shape != seg_slot_G.shape or seg_counts_G.dim() != 1:
        raise ValueError(
            f"seg_counts_G {tuple(seg_counts_G.shape)} and seg_slot_G {tuple(seg_slot_G.shape)} "
            "must be 1-D and of equal length"
        )
    device = seg_counts_G.device
    counts_G = seg_counts_G.to(torch.int64)
    blocks_G = (counts_G + block_size - 1) // block_size
    if num_blocks is None:
        num_blocks = int(blocks_G.sum())
    seg_row_start_G = torch.cumsum(counts_G, 0) - counts_G
    seg_block_start_G = torch.cumsum(blocks_G, 0) - blocks_G

    block_seg_Nb = torch.repeat_interleave(
        torch.arange(counts_G.numel(), device=device), blocks_G, output_size=num_blocks
    )
    index_in_seg_Nb = torch.arange(num_blocks, device=device) - seg_block_start_G[block_seg_Nb]
    block_row_start_Nb = seg_row_start_G[block_seg_Nb] + index_in_seg_Nb * block_size
    block_rows_Nb = torch.clamp(
        counts_G[block_seg_Nb] - index_in_seg_Nb * block_size, max=block_size
    )
    lane_B = torch.arange(block_size, device=device)
    src_NbB = block_row_start_Nb[:, None] + lane_B[None, :]
    src_NbB = torch.where(lane_B[None, :] < block_rows_Nb[:, None], src_NbB, -1)
    return BlockSchedule(
        block_size=block_size,
        block_slot_Nb=seg_slot_G.to(torch.int64)[block_seg_Nb],
        block_seg_Nb=block_seg_Nb,
        block_row_start_Nb=block_row_start_Nb,
        block_rows_Nb=block_rows_Nb,
        seg_row_start_G=seg_row_start_G,
        seg_counts_G=counts_G,
        seg_block_start_G=seg_block_start_G,
        src_P=src_NbB.reshape(-1),
        num_rows=int(counts_G.sum()) if num_rows is None else num_rows,
    )
