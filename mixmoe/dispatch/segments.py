"""Index arithmetic on runs of rows, built from host-known counts without a device sync.

Legend: G segments, R rows.
"""

from __future__ import annotations

import torch


def concat_ranges(starts: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
    """``cat([arange(s, s + c) for s, c in zip(starts, counts)])`` without a Python loop over rows
    (int64 on ``device``)."""
    total = sum(counts)
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    counts_G = torch.tensor(counts, dtype=torch.int64, device=device)
    starts_G = torch.tensor(starts, dtype=torch.int64, device=device)
    seg_R = torch.repeat_interleave(
        torch.arange(len(counts), device=device), counts_G, output_size=total
    )
    first_G = torch.cumsum(counts_G, 0) - counts_G
    return starts_G[seg_R] + torch.arange(total, device=device) - first_G[seg_R]


def exclusive_cumsum(values: list[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        out.append(acc)
        acc += v
    return out
