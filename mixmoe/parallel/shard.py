"""``parallelize_moe``: shard a single-device MoE layer's experts over an expert-parallel group and
swap in an expert-parallel strategy. The layer's code does not change.

Rank r keeps global experts r*E .. r*E+E-1 (E = N / W). Expert parameters are marked
``skip_allreduce = True`` and listed for DDP to ignore; gate and other parameters stay ordinary
data-parallel parameters.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from mixmoe.dispatch.expert_parallel import STRATEGY_SPECS, ExpertParallelDispatcher
from mixmoe.layers.experts import Experts
from mixmoe.layers.moe import MoE
from mixmoe.placement.profile import HardwareProfile


def _shard_experts(full: Experts, rank: int, world_size: int) -> Experts:
    if full.num_experts % world_size:
        raise ValueError(
            f"num_experts={full.num_experts} is not divisible by world size {world_size}; use a "
            f"multiple of {world_size}"
        )
    E = full.num_experts // world_size
    w = full.w1
    local = Experts(
        E,
        full.model_dim,
        full.hidden_dim,
        full.activation,
        full.b1 is not None,
        device=w.device,
        dtype=w.dtype,
    )
    with torch.no_grad():
        for name, p in local.named_expert_parameters():
            source = getattr(full, name)
            p.copy_(source[rank * E : (rank + 1) * E])
            p.__dict__.update(source.__dict__)  # marks set by the user (scan_expert_func) survive
    local.first_expert, local.num_global_experts = rank * E, full.num_experts
    return local


def parallelize_moe(
    layer: MoE, comm, strategy: str | None = None, profile: HardwareProfile | None = None
) -> MoE:
    """In place: keep this rank's experts and install the strategy (default: ``layer.config.strategy``,
    which must then be a2a, shadow or mix). Every rank must call it with the same arguments and a
    layer built with the same seed (or load a checkpoint afterwards). Returns ``layer``."""
    if not isinstance(layer, MoE):
        raise TypeError(f"parallelize_moe expects a mixmoe.MoE, got {type(layer).__name__}")
    strategy = strategy or layer.config.strategy
    if strategy not in STRATEGY_SPECS:
        raise ValueError(
            f"strategy {strategy!r} is not expert-parallel; use one of {sorted(STRATEGY_SPECS)}"
        )
    if layer.experts.num_global_experts != layer.experts.num_experts:
        raise ValueError("this layer is already sharded")
    layer.experts = _shard_experts(layer.experts, comm.rank, comm.world_size)
    layer.dispatcher = ExpertParallelDispatcher(comm, layer.config, strategy, profile)
    mark_expert_parameters(layer)
    return layer


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(qualified name, parameter) of every expert parameter in ``model``."""
    for mod_name, mod in model.named_modules():
        if isinstance(mod, Experts):
            for name, p in mod.named_expert_parameters():
                yield (f"{mod_name}.{name}" if mod_name else name), p


def mark_expert_parameters(model: nn.Module) -> list[str]:
    """Mark expert parameters ``skip_allreduce = True`` and make DDP ignore them
    (``model._ddp_params_and_buffers_to_ignore``, read when DDP wraps the model). Returns names."""
    names = []
    for name, p in expert_parameters(model):
        p.skip_allreduce = True
        names.append(name)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(names)
    model._ddp_params_and_buffers_to_ignore = sorted(ignored)
    return names


def average_expert_gradients(model: nn.Module, edp_comm) -> None:
    """Average expert gradients across the expert-data-parallel group (the ranks that own the same
    experts in other EP groups). Call after backward, before the optimizer step."""
    if edp_comm.world_size == 1:
        return
    for _, p in expert_parameters(model):
        if p.grad is not None:
            edp_comm.all_reduce(p.grad)
            p.grad /= edp_comm.world_size
