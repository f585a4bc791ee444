"""``import mixmoe.hf``: register mixmoe in Hugging Face transformers.

After the import (idempotent: importing again, or calling ``register()`` again, changes nothing)

    model.set_experts_implementation("mixmoe")

runs the experts of every transformers MoE family whose experts class uses
``@use_experts_implementation`` through mixmoe's fused expert ops (``mixmoe.models.hf_experts``).
Needs transformers >= 5 (``pip install 'mixmoe[models]'``).
"""

from __future__ import annotations

EXPERTS_IMPLEMENTATION = "mixmoe"


def register() -> None:
    """Add ``"mixmoe"`` to ``transformers.integrations.moe.ExpertsInterface`` (global mapping)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # transformers missing, or older than 5
        raise ImportError(
            "mixmoe.hf needs transformers>=5 with transformers.integrations.moe; install it with "
            "pip install 'mixmoe[models]'"
        ) from e
    from mixmoe.models.hf_experts import mixmoe_experts_forward

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, mixmoe_experts_forward)


register()
