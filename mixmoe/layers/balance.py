"""Once per optimizer step, for every MoE layer of a model: close the step's load (balance
metrics) and move the aux-loss-free selection bias (``MoE.end_step``).

Legend: N experts.

Why once per optimizer step, explicitly: gradient accumulation runs several forwards per step
and activation recomputation runs a forward again inside the backward. The layers only
accumulate counts during forward (recomputations are not counted); the bias moves here, once,
from the whole step's counts. Either call ``end_balance_step(model)`` after ``optimizer.step()``
or let ``install_balance_hook(optimizer, model)`` do it from an optimizer step hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixmoe.layers.moe import MoE
from mixmoe.types import LoadRecord

AllReduce = Callable[[torch.Tensor], object]


def end_balance_step(
    model: nn.Module, all_reduce: AllReduce | None = None
) -> list[tuple[str, LoadRecord]]:
    """``(qualified name, LoadRecord)`` of every ``MoE`` in ``model`` (module order), each layer's
    bias updated and its step load reset. ``all_reduce(t)`` (in place, sum) adds the counts of
    ranks with other tokens (data parallelism): ONE call per step for all layers (their counts
    concatenated), on every rank."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if all_reduce is not None and layers:
        flat = torch.cat([m.step_load_N for _, m in layers])
        all_reduce(flat)
        sizes = [m.step_load_N.numel() for _, m in layers]
        for (_, m), part in zip(layers, flat.split(sizes), strict=True):
            m.step_load_N.copy_(part)
    return [(name, m.end_step()) for name, m in layers]


class BalanceHook:
    """An optimizer step hook calling ``end_balance_step`` after every ``optimizer.step()``;
    ``records`` holds the last step's records, ``remove()`` detaches it."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, all_reduce: AllReduce | None
    ) -> None:
        self.model, self.all_reduce = model, all_reduce
        self.records: list[tuple[str, LoadRecord]] = []
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.records = end_balance_step(self.model, self.all_reduce)

    def remove(self) -> None:
        self._handle.remove()


def install_balance_hook(
    optimizer: torch.optim.Optimizer, model: nn.Module, all_reduce: AllReduce | None = None
) -> BalanceHook:
    """Run ``end_balance_step(model, all_reduce)`` after each ``optimizer.step()``."""
    return BalanceHook(optimizer, model, all_reduce)
