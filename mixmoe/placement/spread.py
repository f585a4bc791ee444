"""A water-fill start for experts too heavy for one helper: replicas spread before the fill.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g; expert g is owned by rank g // E).

The water-fill (``mixmoe.placement.balance``) moves rows one helper at a time, and a move is
kept only if it relieves the bottleneck. An expert whose rows are many ranks' worth (zipf:1.2 at
W = 256: the hottest expert has 53 ranks' worth) cannot start that way: its first helper must pay
a replica (and the owner its scatter copy) and can take only the rows up to the water level, less
than the copy costs the owner, so no first move is ever kept and the fill stops with the owner
as the bottleneck. ``spread_start`` pays those copies up front: every expert heavier than a
rank's mean rows gets ceil(rows / mean) - 1 holders, the least-loaded ranks by an estimate of
the rows each will compute, so that the fill then only moves the owner's rows to holders it
already has (its receivers include the least-loaded holder of the expert).
"""

from __future__ import annotations

import heapq

import torch

from mixmoe.placement import native_candidates

__all__ = ["spread_start"]


def spread_start(
    C_WN: torch.Tensor, colsum_N: torch.Tensor, experts_per_rank: int, slots: int
) -> dict[int, tuple[int, ...]]:
    """``{g: holder ranks}`` for every expert g with more rows than a rank's mean (rows / W),
    heaviest first (ties by id), each given ceil(rows_g / mean) - 1 holders (at most W - 1):
    the ranks with the fewest estimated rows, ties by rank, never g's owner, never a rank with
    ``slots`` replicas already. A rank's estimate starts at the rows its own experts receive and
    grows by rows_g / (holders + 1) per expert it holds (the even split the fill aims at).
    Deterministic: a function of the counts only. Empty when no expert is heavier than the mean,
    ``slots`` is 0, or the mean is below one row (fewer rows than ranks: ``int(mean)``, the
    holder count's divisor, would be 0, and no expert is worth one rank's rows to split).
    Heavier than the mean: ``rows_g > rows / W`` compared in float64 (exact: an int64 tensor
    compared with a Python float would round both to float32). Compiled where the library
    runs (``native_candidates``: the same dict, in the same order); this Python otherwise."""
    # compiled at every size: measured faster at W = 8 (0.03 -> 0.007 ms) up to W = 1024
    # (zipf:1.2: 12.6 -> 0.46 ms)
    out = native_candidates.spread_start(C_WN, colsum_N, experts_per_rank, slots)
    return out if out is not None else _spread_start_python(C_WN, colsum_N, experts_per_rank, slots)


def _spread_start_python(
    C_WN: torch.Tensor, colsum_N: torch.Tensor, experts_per_rank: int, slots: int
) -> dict[int, tuple[int, ...]]:
    """``spread_start`` in Python: the compiled one's slow twin and fallback."""
    W, N = C_WN.shape
    E = experts_per_rank
    total = int(colsum_N.sum())
    if slots <= 0 or W < 2 or total == 0:
        return {}
    mean = total / W
    if mean < 1:  # fewer rows than ranks: int(mean) == 0 below, nothing worth a rank to split
        return {}
    heavy = (colsum_N.to(torch.float64) > mean).nonzero().flatten().tolist()
    if not heavy:
        return {}
    cols = colsum_N.tolist()
    load = colsum_N.view(W, E).sum(1).tolist()  # rows each rank computes as owner (a2a)
    held = [0] * W
    out: dict[int, tuple[int, ...]] = {}
    for g in sorted(heavy, key=lambda g: (-cols[g], g)):
        o = g // E
        k = min(W - 1, -(-cols[g] // int(mean)) - 1)  # holders besides the owner
        # the k least-loaded ranks with a free slot, owner excluded (ties: the lower rank)
        free = ((load[r], r) for r in range(W) if r != o and held[r] < slots)
        holders = sorted(r for _, r in heapq.nsmallest(k, free))
        if not holders:
            continue
        share = cols[g] / (len(holders) + 1)
        load[o] -= cols[g] - share  # the owner keeps one share
        for r in holders:
            held[r] += 1
            load[r] += share
        out[g] = tuple(holders)
    return out
