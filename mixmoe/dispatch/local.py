"""``local`` strategy: every expert on this device (world size 1).

gate ids -> row layout (one host sync) -> gather rows -> expert MLP on blocks -> weighted combine
(the last three fused into the grouped GEMMs on CUDA).
"""

from __future__ import annotations

import torch

from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.dispatch.result import DispatchResult
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.token_expert_mlp import token_expert_mlp
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
        with trace_span("moe.experts", kind="compute"):
            # gather -> expert MLP over blocks -> weighted combine (fused into the GEMMs on CUDA)
            y_TD = token_expert_mlp(
                x_TD,
                layout.token_P,
                layout.pos_TK,
                routing.weights_TK,
                weights,
                layout.schedule,
                activation,
            )
        return DispatchResult(y_TD, layout.counts_N)
