"""What a strategy returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DispatchResult:
    """y_TD: combined expert outputs; counts_N: rows this rank routed to each global expert;
    stats: what the strategy did (rows moved across ranks, replicas, rows per rank, ...)."""

    y_TD: torch.Tensor
    counts_N: torch.Tensor
    stats: dict = field(default_factory=dict)
