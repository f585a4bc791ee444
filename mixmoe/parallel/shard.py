"""``parallelize_moe``: shard a single-device MoE layer's experts over an expert-parallel group and
swap in an expert-parallel strategy. The layer's code does not change.

Rank r keeps global experts r*E .. r*E+E-1 (E = N / W). Expert parameters are marked
``skip_allreduce = True`` and listed for DDP to ignore; gate and other parameters stay ordinary
data-parallel parameters.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import nn

from mixmoe.comm import Communicator
from mixmoe.dispatch.expert_parallel import ExpertParallelDispatcher
from mixmoe.dispatch.local import LocalDispatcher
from mixmoe.dispatch.strategies import strategy_spec
from mixmoe.layers.experts import Experts
from mixmoe.layers.moe import MoE
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.profile_io import load_profile


def _shard_experts(full: Experts, rank: int, world_size: int) -> Experts:
    """This rank's slice of a full ``Experts`` (built on the meta device, then filled: the
    slice is the only new allocation)."""
    E = full.num_experts // world_size
    w = full.w1
    local = Experts(
        E,
        full.model_dim,
        full.hidden_dim,
        full.activation,
        full.b1 is not None,
        first_expert=rank * E,
        num_global_experts=full.num_experts,
        device="meta",
        dtype=w.dtype,
    ).to_empty(device=w.device)
    with torch.no_grad():
        for name, p in local.named_expert_parameters():
            source = getattr(full, name)
            p.copy_(source[rank * E : (rank + 1) * E])
            p.__dict__.update(source.__dict__)  # marks set by the user (scan_expert_func) survive
    return local


def parallelize_moe(
    layer: MoE,
    comm: Communicator,
    strategy: str | None = None,
    profile: HardwareProfile | str | os.PathLike[str] | None = None,
) -> MoE:
    """In place: install the expert-parallel strategy (default: ``layer.config.strategy``, which
    must then be a2a, shadow or mix) and make the layer hold this rank's experts
    rank*E .. rank*E+E-1 (E = N / W).

    A layer built for this rank (``MoE(config, ep_rank=comm.rank, ep_size=comm.world_size)``,
    the memory-frugal way) is checked and kept; a full single-device layer (all N experts, same
    seed on every rank, or a checkpoint loaded afterwards) is sliced. Every rank must call it with
    the same arguments: the strategy is part of the agreement checked at the first forward.
    ``profile``: the planners' hardware profile, a ``HardwareProfile``, a preset name or the JSON
    written by ``mixmoe calibrate`` (``mixmoe.placement.profile_io.load_profile``); None: the
    device's default. Returns ``layer``."""
    if not isinstance(layer, MoE):
        raise TypeError(f"parallelize_moe expects a mixmoe.MoE, got {type(layer).__name__}")
    strategy = strategy or layer.config.strategy
    strategy_spec(strategy)  # a clear error for 'local' or an unknown name
    if profile is not None:
        profile = load_profile(profile)
    if not isinstance(layer.dispatcher, LocalDispatcher):
        raise ValueError(f"this layer is already parallelized ({layer.dispatcher.name!r})")
    W, r = comm.world_size, comm.rank
    experts = layer.experts
    N = experts.num_global_experts
    if N % W:
        raise ValueError(
            f"num_experts={N} is not divisible by world size {W}; use a multiple of {W}"
        )
    E = N // W
    if experts.num_experts == N:
        layer.experts = _shard_experts(experts, r, W)
    elif experts.num_experts != E or experts.first_expert != r * E:
        raise ValueError(
            f"this layer holds experts {experts.first_expert}..{experts.first_expert + experts.num_experts - 1} "
            f"of {N}, but rank {r} of {W} owns {r * E}..{r * E + E - 1}; build it with "
            f"MoE(config, ep_rank={r}, ep_size={W}) (the expert-parallel group's rank and size)"
        )
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
