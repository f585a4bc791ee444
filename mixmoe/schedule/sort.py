"""Sort routed rows by expert and count them: the one place where (token, choice) rows meet experts.

Legend: T tokens, K top-k, N experts, R = T*K routed rows (token-major: row ``t * K + k``).

Used by the single-device layout, the expert-parallel step and the load-balancing loss, so every
part of the layer counts the same rows the same way. A choice with id -1 (dropped) is counted in an
extra bin that is cut off, and sorts after every kept row. No host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def expert_counts(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``counts_N`` (int64): rows routed to each expert; ids of -1 are not counted."""
    key_R = torch.where(ids_TK >= 0, ids_TK, num_experts).reshape(-1)
    return torch.bincount(key_R, minlength=num_experts + 1)[:num_experts]


@dataclass(frozen=True)
class SortedRows:
    """order_R: routed rows (``t * K + k``) sorted by expert, stable (within an expert rows keep
    token order), dropped rows last. counts_N: rows per expert (device tensor)."""

    order_R: torch.Tensor
    counts_N: torch.Tensor


def sort_by_expert(ids_TK: torch.Tensor, num_experts: int) -> SortedRows:
    """Sort the T*K routed rows by expert id (a stable sort) and count them.

    ``ids_TK`` may be relabelled ids (the expert-parallel step sorts by its own segment order);
    every id must lie in [-1, num_experts)."""
    key_R = torch.where(ids_TK >= 0, ids_TK, num_experts).reshape(-1)
    order_R = torch.argsort(key_R, stable=True)
    counts_N = torch.bincount(key_R, minlength=num_experts + 1)[:num_experts]
    return SortedRows(order_R, counts_N)


def num_blocks(counts: list[int], block_size: int) -> int:
    """Blocks of the layout of segments with these (host) row counts: ``sum(ceil(c / B))``."""
    return sum(-(-c // block_size) for c in counts)
