"""Replica placement: the cost model of one MoE layer step and the per-step plans built on it.

Host-only, deterministic, no ``torch.distributed``: every rank computes the same plan from the
same all-gathered counts. One file per job: ``counts`` (validating C, its sums), ``cost_model``
(pricing any ``Plan``), ``plan`` (the value), ``relay`` (the replica weights' route), the planners
``shadow``, ``replica_search`` (source replicas), ``balance`` (water-filling with helpers),
``spread`` (the fill's start for experts too heavy for one helper), ``thinned`` (the fill's starts
from a candidate in shadow's form, its coldest experts dropped) and ``planner`` (``plan_none``,
``plan_mix``: the mixed strategy's plan, start here).
"""

from mixmoe.placement.cost_model import LayerShape, Prediction, predict, predict_plan
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import plan_mix, plan_none, plan_shadow
from mixmoe.placement.profile import CPU_PROFILE, GPU_PROFILE, HardwareProfile, default_profile

__all__ = [
    "CPU_PROFILE",
    "GPU_PROFILE",
    "HardwareProfile",
    "LayerShape",
    "Plan",
    "Prediction",
    "default_profile",
    "plan_mix",
    "plan_none",
    "plan_shadow",
    "predict",
    "predict_plan",
]
