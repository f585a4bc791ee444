"""``local`` strategy: every expert on this device (world size 1).

gate ids -> row layout (one host sync) -> gather rows -> expert MLP on blocks -> weighted combine.
"""

from __future__ import annotations

import torch

from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.dispatch.result import DispatchResult
from mixmoe.ops.expert_mlp import ExpertWeights, expert_mlp
from mixmoe.ops.rows import combine_rows, gather_rows
from mixmoe.tracing import trace_span
from mixmoe.types import Routing


class LocalDispatcher:
    """Callable strategy: ``(x_TD, routing, weights, activation) -> DispatchResult``.

    ``weights`` holds all N experts (slot g = expert g)."""

    name = "local"

    def __init__(self, block_size: int = 64) -> None:
        self.block_size = block_size

    def __call__(
        self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights, activation: str
    ) -> DispatchResult:
        with trace_span("moe.count", kind="host"):
            layout = expert_row_layout(routing.ids_TK, weights.num_slots, self.block_size)
        with trace_span("moe.dispatch", kind="compute"):
            x_PD = gather_rows(x_TD, layout.token_P)
        with trace_span("moe.experts", kind="compute"):
            out_PD = expert_mlp(x_PD, weights, layout.schedule, activation)
        with trace_span("moe.combine", kind="compute"):
            y_TD = combine_rows(out_PD, layout.pos_TK, routing.weights_TK)
        return DispatchResult(y_TD, layout.counts_N)
