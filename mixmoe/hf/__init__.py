"""``import mixmoe.hf``: register mixmoe in Hugging Face transformers.

After the import (idempotent: importing again, or calling ``register()`` again, changes nothing)

    model.set_experts_implementation("mixmoe")

runs the experts of every transformers MoE family whose experts class uses
``@use_experts_implementation`` through mixmoe's fused expert ops (``mixmoe.hf.experts``),
and, when the installed transformers has expert parallelism
(``transformers.distributed.expert_parallel``, 5.23+),

    from_pretrained(path, distributed_config=DistributedConfig(
        ep_size=W, fsdp_size=..., ep_implementation="mixmoe_mix"))   # or mixmoe_a2a, mixmoe_shadow

runs mixmoe's expert-parallel strategies as transformers EP implementations
(``mixmoe.hf.ep``). ``EP_IMPLEMENTATIONS`` lists the names registered (empty when that
transformers has no expert parallelism). Needs transformers >= 5 (``pip install 'mixmoe[models]'``).

``layout``   the one adapter from transformers' experts weight layouts to mixmoe's
``experts``  mixmoe as a transformers experts implementation
``convert``  exact conversion of transformers sparse-MoE blocks into mixmoe ``MoE`` layers
``ep``       mixmoe's strategies as transformers expert-parallel implementations
``bias_balance``  aux-loss-free balancing: moves routers' ``e_score_correction_bias`` once per
             optimizer step (transformers never does)

Importing any of them imports this package first, which registers (transformers is needed then).
"""

from __future__ import annotations

EXPERTS_IMPLEMENTATION = "mixmoe"
EP_IMPLEMENTATIONS: tuple[str, ...] = ()


def register() -> None:
    """Add ``"mixmoe"`` to ``transformers.integrations.moe.ExpertsInterface`` and the mixmoe EP
    implementations to ``EPImplementationInterface`` (global mappings)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # transformers missing, or older than 5
        raise ImportError(
            "mixmoe.hf needs transformers>=5 with transformers.integrations.moe; install it with "
            "pip install 'mixmoe[models]'"
        ) from e
    from mixmoe.hf.experts import mixmoe_experts_forward

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, mixmoe_experts_forward)
    try:
        import transformers.distributed.expert_parallel  # noqa: F401
    except ImportError:  # a transformers 5 without expert parallelism: experts only
        return
    from mixmoe.hf.ep import EP_CLASSES, register_ep_implementations

    register_ep_implementations()
    global EP_IMPLEMENTATIONS
    EP_IMPLEMENTATIONS = tuple(EP_CLASSES)


register()
