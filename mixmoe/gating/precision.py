"""Router arithmetic precision."""

from __future__ import annotations

import torch


def widen(t: torch.Tensor) -> torch.Tensor:
    """At least float32 for softmax/logsumexp: fp16/bf16 logits are widened, float64 is kept."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
