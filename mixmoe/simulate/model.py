"""Model-level what-if: L MoE layers + the dense part + data-parallel all-reduce + pipeline bubble.

Legend: L MoE layers, P pipeline stages, M micro-batches per step, dp data-parallel replicas of
the dense parameters, edp expert-data-parallel replicas of the expert parameters.

One micro-batch through the whole model costs

    t_mb = L * layer_step + dense

with ``layer_step`` a strategy's predicted MoE layer step (``mixmoe.simulate.layer``; forward +
backward of the micro-batch's tokens per rank) and ``dense = 6 * dense_params * tokens /
gemm_flops`` (forward + backward of the non-expert parameters, 2 FLOP per multiply-add). With
the layers split evenly over P stages, a 1F1B pipeline step takes (M + P - 1) micro-batch slots
of t_mb / P (the ideal 1F1B formula: a bubble fraction of (P - 1) / (M + P - 1)). The gradient
all-reduces run after the pipeline drains, not overlapped: a ring all-reduce of B bytes over n
ranks costs 2 (n - 1) / n * B / link_bandwidth + 2 (n - 1) * link_latency, for the dense
gradients of one stage (dp ranks) and the expert gradients one rank owns (edp ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.profile import HardwareProfile
from mixmoe.validation import check_int

__all__ = ["ModelShape", "ModelStep", "allreduce_s", "predict_model"]


@dataclass(frozen=True)
class ModelShape:
    """layers L (MoE layers), dense_params (non-expert parameters of the whole model), tokens per
    rank per micro-batch, pipeline_stages P, microbatches M, dp, edp (>= 1 each)."""

    layers: int = 1
    dense_params: int = 0
    tokens: int = 1
    pipeline_stages: int = 1
    microbatches: int = 1
    dp: int = 1
    edp: int = 1

    def __post_init__(self) -> None:
        check_int("layers", self.layers, 1)
        check_int("dense_params", self.dense_params, 0)
        for name in ("tokens", "pipeline_stages", "microbatches", "dp", "edp"):
            check_int(name, getattr(self, name), 1)
        if self.layers % self.pipeline_stages:
            raise ValueError(
                f"layers={self.layers} do not split evenly over pipeline_stages="
                f"{self.pipeline_stages}; use a multiple of {self.pipeline_stages}"
            )


@dataclass(frozen=True)
class ModelStep:
    """Seconds of one training step and its parts (see the module doc)."""

    microbatch_s: float
    pipeline_s: float
    bubble_fraction: float
    dense_allreduce_s: float
    expert_allreduce_s: float
    step_s: float


def allreduce_s(nbytes: float, ranks: int, profile: HardwareProfile) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks`` (0 for one rank)."""
    if ranks <= 1:
        return 0.0
    return (
        2 * (ranks - 1) / ranks * nbytes / profile.link_bandwidth
        + 2 * (ranks - 1) * profile.link_latency
    )


def predict_model(
    layer_step_s: float, layer: LayerShape, model: ModelShape, profile: HardwareProfile
) -> ModelStep:
    """One step of the model whose every MoE layer costs ``layer_step_s`` per micro-batch."""
    P, M = model.pipeline_stages, model.microbatches
    dense_s = 6 * model.dense_params * model.tokens / profile.gemm_flops
    t_mb = model.layers * layer_step_s + dense_s
    pipeline = (M + P - 1) * t_mb / P
    dense_bytes = model.dense_params / P * layer.bytes_per_element
    expert_bytes = model.layers / P * layer.experts_per_rank * layer.params_bytes_per_expert
    ar_dense = allreduce_s(dense_bytes, model.dp, profile)
    ar_expert = allreduce_s(expert_bytes, model.edp, profile)
    return ModelStep(
        microbatch_s=t_mb,
        pipeline_s=pipeline,
        bubble_fraction=(P - 1) / (M + P - 1),
        dense_allreduce_s=ar_dense,
        expert_allreduce_s=ar_expert,
        step_s=pipeline + ar_dense + ar_expert,
    )
