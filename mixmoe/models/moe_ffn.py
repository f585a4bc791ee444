"""``MoEFFN``: a MoE layer standing where a model's dense FFN stood, and the collection of every
MoE layer's auxiliary losses of a model's last forward.

Legend: D model dim.

A transformer block calls its FFN as ``y = ffn(x)`` and has no room for a second output, so each
``MoEFFN`` hands its ``MoEAux`` to the ``MoEAuxCollector`` of the model it belongs to. The
collector lives on the model (not in a module-global list): it is cleared by a forward pre-hook
on the model's root module, so it always holds the losses of the model's last forward, and two
models (or a ``copy.deepcopy`` of one) never share one.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.layers.moe import MoE
from mixmoe.types import MoEAux

COLLECTOR_ATTR = "mixmoe_aux_collector"


class MoEAuxCollector:
    """The ``MoEAux`` of every MoE layer of one model's last forward, by qualified layer name.

    ``begin()`` (called by the root's forward pre-hook) forgets the previous forward; each
    ``MoEFFN`` records its aux under its name (a layer run twice in one forward, e.g. recomputed
    under activation checkpointing, keeps its latest aux: never counted twice).
    """

    def __init__(self) -> None:
        self._aux: dict[str, MoEAux] = {}

    def begin(self, *_: object) -> None:
        self._aux = {}

    def record(self, name: str, aux: MoEAux) -> None:
        self._aux[name] = aux

    def aux(self) -> dict[str, MoEAux]:
        return dict(self._aux)


class MoEFFN(nn.Module):
    """``forward(x[..., D]) -> dropout(moe(x))[..., D]``; the MoE's aux goes to ``collector``
    under ``name`` (and stays readable as ``self.aux``, the last call's)."""

    def __init__(
        self,
        moe: MoE,
        *,
        name: str,
        collector: MoEAuxCollector,
        dropout: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a mixmoe.MoE, got {type(moe).__name__}")
        self.moe = moe
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.name = name
        self.collector = collector
        self.aux: MoEAux | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.moe(x)
        self.aux = aux
        self.collector.record(self.name, aux)
        return self.dropout(y)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


def attach_collector(model: nn.Module) -> MoEAuxCollector:
    """The model's collector, created (and hooked to the model's forward) on first use."""
    collector = getattr(model, COLLECTOR_ATTR, None)
    if collector is None:
        collector = MoEAuxCollector()
        # a plain attribute, not a submodule: deepcopy copies it together with the bound hook
        object.__setattr__(model, COLLECTOR_ATTR, collector)
        model.register_forward_pre_hook(collector.begin)
    return collector


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(qualified name, layer) of every mixmoe ``MoE`` in ``model``, in module order (the
    handle for ``mixmoe.parallel.parallelize_moe`` on each)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def moe_aux(model: nn.Module) -> dict[str, MoEAux]:
    """The ``MoEAux`` of every ``MoEFFN`` in ``model`` from the model's last forward, by the
    layer's name. Raises ValueError when the model has no MoE FFN or no forward recorded one."""
    ffns = [m for m in model.modules() if isinstance(m, MoEFFN)]
    if not ffns:
        raise ValueError(
            f"{type(model).__name__} has no MoE FFN; convert it first, e.g. "
            f"mixmoe.models.moefy.moefy(model, config)"
        )
    out: dict[str, MoEAux] = {}
    for collector in {id(f.collector): f.collector for f in ffns}.values():
        out.update(collector.aux())
    names = {f.name for f in ffns}
    out = {n: a for n, a in out.items() if n in names}
    if not out:
        raise ValueError("no MoE layer has run since the model's last forward began; run a forward")
    return out


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the scaled auxiliary losses (``MoEAux.loss``) of every MoE layer of ``model``'s
    last forward: add it to the task loss before ``backward``."""
    losses = [a.loss for a in moe_aux(model).values()]
    return torch.stack(losses).sum()
