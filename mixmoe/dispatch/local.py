"""``local`` strategy: every expert on this device (world size 1).

dispatch: gate ids -> row layout (one host sync) -> one work item reading ``x_TD`` by index;
experts: one fused expert MLP call writing token order (gather, GEMMs and the K-sum fused);
combine: nothing left to do.
"""

from __future__ import annotations

import torch

from mixmoe.config import MoEConfig
from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.dispatch.step import (
    DispatchedRows,
    ExpertLayout,
    ExpertOutputs,
    ExpertWork,
    LocalStepMeta,
)
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.tracing import trace_span
from mixmoe.types import Routing


class LocalDispatcher:
    """``dispatch(x_TD, routing, weights) -> (rows, layout, meta)``; ``combine(out, meta) -> y_TD``.

    ``weights`` holds all N experts (slot g = expert g)."""

    name = "local"

    def __init__(self, config: MoEConfig) -> None:
        self.config = config
        self.block_size = config.block_size

    def _check(self, weights: ExpertWeights) -> None:
        cfg = self.config
        if cfg.strategy != "local":
            raise ValueError(
                f"MoEConfig(strategy={cfg.strategy!r}) but this layer was never parallelized, so "
                "it would silently run 'local'; call mixmoe.parallel.parallelize_moe(layer, comm) "
                "on every rank, or use strategy='local'"
            )
        if weights.num_slots != cfg.num_experts:
            raise ValueError(
                f"this layer holds {weights.num_slots} of the {cfg.num_experts} experts (built "
                "for one expert-parallel rank); call mixmoe.parallel.parallelize_moe(layer, comm) "
                "on every rank before the first forward"
            )

    def dispatch(
        self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights
    ) -> tuple[DispatchedRows, ExpertLayout, LocalStepMeta]:
        self._check(weights)
        with trace_span("moe.count", kind="host"):
            layout = expert_row_layout(routing.ids_TK, weights.num_slots, self.block_size)
        work = ExpertWork(
            source="local",
            weights="owned",
            token_P=layout.token_P,
            pos_TK=layout.pos_TK,
            weights_TK=routing.weights_TK,
            schedule=layout.schedule,
            span="moe.experts",
        )
        return DispatchedRows(x_TD), ExpertLayout((work,)), LocalStepMeta(layout.counts_N)

    def combine(self, out: ExpertOutputs, meta: LocalStepMeta) -> torch.Tensor:
        return out.local_TD
