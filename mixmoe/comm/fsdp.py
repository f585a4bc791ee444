"""What mixmoe reads of a module sharded by FSDP2 (``fully_shard``): the version of its sharded
parameters.

FSDP2 all-gathers a unit's parameters into unsharded tensors before its forward and refills them
IN PLACE while preserving their version counters, so the unsharded weights' ``_version`` does not
change when an optimizer step changes their values. The sharded parameters are what the
optimizer (and ``load_state_dict``) writes in place: their version counters do change. A replica
cache keyed on them is therefore valid under FSDP: unchanged sharded versions mean the
all-gathered weights hold the same values.
"""

from __future__ import annotations

from torch import nn


def sharded_parameters_version(module: nn.Module) -> int | None:
    """Sum of the in-place version counters of the sharded parameters of ``module``'s own FSDP2
    unit (``fully_shard(module)``), or None when ``module`` is not an FSDP2 unit with parameters
    (or this torch's FSDP2 internals are not the ones read here: the caller must then treat
    every call as a change). Read it during the module's forward: FSDP2 binds its sharded
    parameters to the module's own at its first forward (before, they may be placeholders)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return None
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        params = [p.sharded_param for p in group.fsdp_params] if group is not None else []
    except AttributeError:  # FSDP2 internals changed: no version, never cache
        return None
    if not params:
        return None
    # an in-place op on a DTensor bumps the wrapper's counter (the optimizer's update, a
    # load_state_dict copy); one below autograd bumps only its local tensor's: count both
    return sum(p._version + getattr(p, "_local_tensor", p)._version for p in params)
