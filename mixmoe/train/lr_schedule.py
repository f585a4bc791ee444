"""Learning-rate schedules of ``mixmoe train``: linear warm-up, then constant, cosine or linear
decay to a floor. The rate is a pure function of the step, so a resumed run continues the
schedule exactly (nothing to store in a checkpoint)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float = 0.0,
    warmup_steps: int = 0,
    total_steps: int = 1,
    schedule: str = "constant",
) -> float:
    """The rate of optimizer step ``step`` (0-based).

    Warm-up: ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step
    already moves). Then, with ``p = (step - warmup_steps) / (total_steps - warmup_steps)``
    clamped to [0, 1] (a run past ``total_steps`` stays at the floor): constant ``lr``;
    cosine ``min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2``; linear ``min_lr + (lr -
    min_lr) * (1 - p)``."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r} is unknown; use one of {LR_SCHEDULES}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    return min_lr + (lr - min_lr) * (1.0 - p)
