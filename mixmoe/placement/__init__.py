"""Replica placement: the cost model of one MoE layer step and the per-step plans built on it.

Host-only, deterministic, no ``torch.distributed``: every rank computes the same plan from the
same all-gathered counts.
"""

from mixmoe.placement.cost_model import LayerShape, Prediction, predict
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
]
