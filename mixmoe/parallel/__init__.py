"""Applying expert parallelism from outside the modules, and checkpoints that ignore it."""

from mixmoe.parallel.checkpoint import gather_full_state_dict, load_full_state_dict
from mixmoe.parallel.shard import (
    average_expert_gradients,
    expert_parameters,
    mark_expert_parameters,
    parallelize_moe,
)

__all__ = [
    "average_expert_gradients",
    "expert_parameters",
    "gather_full_state_dict",
    "load_full_state_dict",
    "mark_expert_parameters",
    "parallelize_moe",
]
