"""What one step of a strategy hands from ``dispatch`` to the experts and from them to ``combine``.

Legend: T tokens here, K top-k, D model dim, R received rows, P padded rows of one work item.

    rows, layout, meta = dispatcher.dispatch(x_TD, routing, weights)
    out = experts(rows, layout)          # one fused expert MLP call per ``ExpertWork``
    y_TD = dispatcher.combine(out, meta)

Every work item is one call of ``mixmoe.ops.token_expert_mlp``: the first GEMM reads its rows of
a source buffer by index (``token_P``), the second writes through ``pos_TK`` straight into the
order the caller wants (token order with the K-sum for local rows, return order for received
rows). The same ops run on every path: local or expert-parallel, CPU or GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.token_expert_mlp import token_expert_mlp
from mixmoe.schedule.blocks import BlockSchedule
from mixmoe.tracing import trace_span

SOURCES = ("local", "received")
WEIGHT_SETS = ("owned", "replica")


@dataclass(frozen=True)
class ExpertWork:
    """One fused expert-MLP call.

    source:     ``local`` (this rank's ``x_TD``) or ``received`` (rows received this step).
    weights:    ``owned`` (the module's experts) or ``replica`` (this step's fetched replicas).
    token_P:    source row read by each padded row; ``len(source)`` for padding.
    pos_TK:     padded row of each output (row, choice); ``P`` for a choice not computed here.
                Local work: [T, K] (token order, K-sum in order). Received work: [R, 1].
    weights_TK: combine weights (differentiable), or None for unit weights (received rows go
                back unweighted; their source applies the weights).
    schedule:   the block layout (weight slot of every block).
    span:       trace name of the call.
    """

    source: str
    weights: str
    token_P: torch.Tensor
    pos_TK: torch.Tensor
    weights_TK: torch.Tensor | None
    schedule: BlockSchedule
    span: str

    def __post_init__(self) -> None:
        assert self.source in SOURCES and self.weights in WEIGHT_SETS, (self.source, self.weights)


def run_work(
    work: ExpertWork, source: torch.Tensor, weights: ExpertWeights, activation: str
) -> torch.Tensor:
    """One work item's fused expert MLP call, traced under ``work.span``: what the experts run
    for every item, and what a dispatcher runs for the items it computes itself (the own rows,
    while the plan is being made)."""
    with trace_span(work.span, kind="compute"):
        return token_expert_mlp(
            source, work.token_P, work.pos_TK, work.weights_TK, weights, work.schedule, activation
        )


@dataclass(frozen=True)
class ExpertLayout:
    """The work of one step, in execution order (local work first: it overlaps the receive)."""

    work: tuple[ExpertWork, ...]


@dataclass(frozen=True)
class DispatchedRows:
    """The experts' inputs: the local tokens, the replicas fetched this step (or None), under
    expert parallelism the rows received (``received()`` waits for an in-flight exchange), and
    ``local_done_TD``: the output of local work the dispatcher already ran (token order, weighted
    and K-summed: under ``mix`` the own rows, computed while the plan was made), or None. The
    experts add the layout's local work to it."""

    local_TD: torch.Tensor
    replicas: ExpertWeights | None = None
    receive: Callable[[], torch.Tensor] | None = None
    local_done_TD: torch.Tensor | None = None

    def received(self) -> torch.Tensor:
        if self.receive is None:
            raise ValueError("this step received no rows (a single-device dispatcher)")
        return self.receive()


@dataclass(frozen=True)
class ExpertOutputs:
    """local_TD: sum of the local work's outputs (token order, already weighted and K-summed).
    received_RD: outputs of the received rows in return order (unweighted), None if none."""

    local_TD: torch.Tensor
    received_RD: torch.Tensor | None = None


@dataclass(frozen=True)
class LocalStepMeta:
    """counts_N: rows routed to each expert (device tensor)."""

    counts_N: torch.Tensor
    stats: dict = field(default_factory=dict)
