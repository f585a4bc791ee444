"""Drop-in replacements for a transformer FFN, with the argument names people already use.

``MixMOETransformerMLP`` follows the Tutel-style ``moe_layer`` signature used by the original
mixed-strategy prototype; ``FMoETransformerMLP`` follows FastMoE. Both return ``y`` only (same
shape as the input) and keep the auxiliary outputs of the last forward in ``self.aux``
(``self.l_aux`` is the scaled aux loss to add to the task loss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixmoe.config import GateConfig, MoEConfig
from mixmoe.layers.moe import MoE
from mixmoe.types import MoEAux

_GATE_ALIASES = {
    "top": "topk",
    "topk": "topk",
    "naive": "topk",
    "switch": "switch",
    "gshard": "gshard",
}
_ACT_BY_NAME = {"gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu", "swiglu": "swiglu"}
_EXPERT_KEYS = {
    "num_local_expert",
    "count_per_node",
    "hidden_size",
    "hidden_size_per_expert",
    "activation_fn",
    "type",
}
_GATE_KEYS = {
    "type",
    "k",
    "capacity_factor",
    "fp32_gate",
    "normalize",
    "jitter_eps",
    "random_routing",
}


def _activation_name(fn: str | Callable | type | None) -> str:
    """Map a name, a callable or an activation class to one of the built-in activations.

    A callable is identified by evaluating it on a fixed probe and comparing with the built-ins
    (so ``lambda x: F.relu(x)`` works); anything else is refused: the fused kernels only implement
    these activations.
    """
    if fn is None:
        return "gelu"
    if isinstance(fn, str):
        if fn.lower() not in _ACT_BY_NAME:
            raise ValueError(f"activation_fn {fn!r} is unknown; use one of {sorted(_ACT_BY_NAME)}")
        return _ACT_BY_NAME[fn.lower()]
    if isinstance(fn, type) and issubclass(fn, nn.Module):
        fn = fn()
    if not callable(fn):
        raise TypeError(f"activation_fn must be a name or a callable, got {type(fn).__name__}")
    probe = torch.linspace(-4.0, 4.0, 97, dtype=torch.float64)
    try:
        got = fn(probe)
    except Exception as err:  # noqa: BLE001 - report any failure of the user's callable
        raise TypeError(f"activation_fn {fn!r} failed on a float64 tensor: {err}") from err
    for name, ref in (("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu)):
        if isinstance(got, torch.Tensor) and torch.allclose(got, ref(probe), atol=1e-6):
            return name
    raise ValueError(
        f"activation_fn {fn!r} is not one of relu, gelu (exact), silu; pass one of them or a "
        "name ('gelu', 'relu', 'silu', 'swiglu')"
    )


class MixMOETransformerMLP(nn.Module):
    """``MixMOETransformerMLP(gate_type={'type': 'top', 'k': 2}, experts={'num_local_expert': E,
    'hidden_size': F, 'activation_fn': ...}, model_dim=D)``; ``forward(x[..., D]) -> y[..., D]``.

    Legacy arguments: ``scan_expert_func(name, param)`` is called on every expert parameter
    (e.g. to mark it ``skip_allreduce``); ``world_size``/``expert_rank`` describe the expert-parallel
    group (experts are ``num_local_expert`` per rank, so N = E * world_size): the module builds only
    the experts of ``expert_rank`` (the weights a single-device module built from the same seed
    holds for them) and runs once ``mixmoe.parallel.parallelize_moe(module.moe, comm)`` installed
    the strategy on every rank (which checks ``expert_rank == comm.rank``); ``total_batch_size``
    is accepted and checked but unused (mixmoe sizes its
    buffers per step from the counts).
    """

    def __init__(
        self,
        gate_type: Mapping[str, Any] | None = None,
        experts: Mapping[str, Any] | None = None,
        model_dim: int | None = None,
        *,
        scan_expert_func: Callable[[str, nn.Parameter], Any] | None = None,
        world_size: int = 1,
        expert_rank: int = 0,
        total_batch_size: int | None = None,
        bias: bool = True,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        gate_type = dict(gate_type or {"type": "top", "k": 2})
        experts = dict(experts or {})
        if model_dim is None:
            raise ValueError("model_dim is required, e.g. model_dim=1024")
        unknown = set(gate_type) - _GATE_KEYS
        if unknown:
            raise ValueError(
                f"gate_type has unknown keys {sorted(unknown)}; known: {sorted(_GATE_KEYS)}"
            )
        unknown = set(experts) - _EXPERT_KEYS
        if unknown:
            raise ValueError(
                f"experts has unknown keys {sorted(unknown)}; known: {sorted(_EXPERT_KEYS)}"
            )
        if experts.get("type", "ffn") != "ffn":
            raise ValueError(f"experts type {experts['type']!r} is not supported; use 'ffn'")
        gate_name = str(gate_type.get("type", "top"))
        if gate_name not in _GATE_ALIASES:
            raise ValueError(
                f"gate_type type {gate_name!r} is unknown; use one of {sorted(_GATE_ALIASES)}"
            )
        capacity = gate_type.get("capacity_factor", 0)
        if capacity not in (0, None) and capacity > 0:
            raise ValueError(
                f"capacity_factor={capacity}: mixmoe is dropless and never drops tokens; "
                "remove capacity_factor (or set it to 0)"
            )
        local = experts.get("num_local_expert", experts.get("count_per_node"))
        hidden = experts.get("hidden_size", experts.get("hidden_size_per_expert"))
        if local is None or hidden is None:
            raise ValueError(
                "experts needs 'num_local_expert' (experts per rank) and 'hidden_size', got "
                f"{experts!r}"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not 0 <= expert_rank < world_size:
            raise ValueError(f"expert_rank={expert_rank} must be in [0, world_size={world_size})")
        if total_batch_size is not None and (
            isinstance(total_batch_size, bool)
            or not isinstance(total_batch_size, int)
            or total_batch_size < 1
        ):
            raise ValueError(f"total_batch_size must be a positive int, got {total_batch_size!r}")
        gate_kind = _GATE_ALIASES[gate_name]
        default_k = {"switch": 1, "gshard": 2}.get(gate_kind, 2)
        self.config = MoEConfig(
            model_dim=model_dim,
            hidden_dim=hidden,
            num_experts=local * world_size,
            top_k=gate_type.get("k", default_k),
            activation=_activation_name(experts.get("activation_fn")),
            bias=bias,
            gate=GateConfig(
                type=gate_kind,
                normalize=gate_type.get("normalize", "topk_softmax"),
                jitter_eps=gate_type.get("jitter_eps", 0.0),
                random_routing=gate_type.get("random_routing", False),
            ),
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
        )
        self.world_size, self.expert_rank, self.total_batch_size = (
            world_size,
            expert_rank,
            total_batch_size,
        )
        # built for its rank: only the num_local_expert experts of expert_rank are allocated
        self.moe = MoE(
            self.config, ep_rank=expert_rank, ep_size=world_size, device=device, dtype=dtype
        )
        self.aux: MoEAux | None = None
        if scan_expert_func is not None:
            for name, param in self.moe.experts.named_expert_parameters():
                scan_expert_func(name, param)

    @property
    def l_aux(self) -> torch.Tensor | None:
        """The scaled auxiliary loss of the last forward (None before the first)."""
        return None if self.aux is None else self.aux.loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.aux = self.moe(x)
        return y


class FMoETransformerMLP(MixMOETransformerMLP):
    """FastMoE-style alias: ``FMoETransformerMLP(num_expert, d_model, d_hidden, top_k=2,
    activation=GELU)``; the NaiveGate (top-k softmax) router."""

    def __init__(
        self,
        num_expert: int = 32,
        d_model: int = 1024,
        d_hidden: int = 4096,
        activation: str | Callable | type | None = None,
        top_k: int = 2,
        world_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            gate_type={"type": "top", "k": top_k},
            experts={
                "num_local_expert": num_expert,
                "hidden_size": d_hidden,
                "activation_fn": activation,
            },
            model_dim=d_model,
            world_size=world_size,
            **kwargs,
        )
