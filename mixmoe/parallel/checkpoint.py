"""Checkpoints independent of the world size: gather all experts on rank 0; load a full state dict
into any world size that divides the number of experts (resharding W -> W')."""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.comm import Communicator
from mixmoe.layers.experts import Experts


def _expert_modules(model: nn.Module) -> list[tuple[str, Experts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]


def gather_full_state_dict(model: nn.Module, comm: Communicator) -> dict[str, torch.Tensor] | None:
    """The state dict of ``model`` with every expert tensor holding ALL global experts (as the
    single-device layer would). Collective: every rank calls it; rank 0 gets the dict, others None."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for mod_name, mod in _expert_modules(model):
        for name, p in mod.named_expert_parameters():
            key = f"{mod_name}.{name}" if mod_name else name
            if mod.num_experts == mod.num_global_experts:
                continue
            flat = p.detach().contiguous().reshape(-1)
            every = comm.all_gather_rows(flat)  # [W, E * ...] in rank order = global expert order
            state[key] = every.reshape((mod.num_global_experts,) + tuple(p.shape[1:]))
    return state if comm.rank == 0 else None


def load_full_state_dict(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Load a full (all experts) state dict into a possibly sharded model: each ``Experts`` takes
    its slice first_expert .. first_expert + E. Other tensors load as usual (strict)."""
    state = dict(full_state)
    for mod_name, mod in _expert_modules(model):
        for name, _ in mod.named_expert_parameters():
            key = f"{mod_name}.{name}" if mod_name else name
            if key not in state:
                raise KeyError(f"full state dict has no {key!r}")
            full = state[key]
            if full.shape[0] != mod.num_global_experts:
                raise ValueError(
                    f"{key} holds {full.shape[0]} experts but the model has {mod.num_global_experts}"
                )
            state[key] = full[mod.first_expert : mod.first_expert + mod.num_experts]
    model.load_state_dict(state)
