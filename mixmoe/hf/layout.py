"""The ONE adapter from transformers' experts weight layouts to mixmoe's.

Legend: S weight slots (= experts), D model dim, F expert hidden dim.

transformers 5 stores the experts of a MoE family as 3-D parameters on one module whose class is
decorated with ``@use_experts_implementation(...)``. The decorator sets flags on every instance
that say how to read them:

    has_gate         gate_up_proj (gated MLP) or up_proj (plain MLP, ``act_fn``)
    is_transposed    False: gate_up_proj [S, 2F, D], down_proj [S, D, F] (``nn.Linear`` order)
                     True:  gate_up_proj [S, D, 2F], down_proj [S, F, D]
    is_concatenated  True: gate columns [0, F) then up columns [F, 2F); False: interleaved
                     (gate 0, up 0, gate 1, up 1, ...)
    has_bias         gate_up_proj_bias [S, 2F] (or up_proj_bias [S, F]), down_proj_bias [S, D]
    has_post_expert_norm  ``post_expert_norm`` on each expert's output, before the routing weight

and the gated math is the class's ``_apply_gate(gate_up_out)`` (the default: ``act_fn(gate) *
up`` over the two halves). mixmoe's layout is ``ExpertWeights``: w1_SDF (gate), w3_SDF (up),
w2_SFD, biases, and an activation name (``swiglu`` = silu(gate) * up).

``hf_experts_layout(module)`` turns one experts module into ``HFExpertsLayout``: views of the
module's parameters (autograd flows to them; nothing is copied), plus either a mixmoe activation
name (then ``token_expert_mlp`` runs it as it is) or the module's own elementwise function
(``custom_gate`` / ``act_fn``: a custom ``_apply_gate`` such as GPT-OSS's clamped SwiGLU, or an
activation mixmoe does not have), which mixmoe then applies between its two grouped GEMMs.
``require_mixmoe_activation=True`` (model conversion: mixmoe's ``MoE`` layer has no custom gate)
raises a ValueError naming the flag instead. A layout that cannot be read exactly always raises.

``expert_weights(tensors, flags)`` is the pure tensor part: tests pass the parameters' ``.grad``
through it to compare gradients in mixmoe's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from mixmoe.ops.expert_mlp import ExpertWeights, activate

# the elementwise functions mixmoe's fused op has, and the probe that identifies one
MIXMOE_ACTIVATIONS = ("silu", "gelu", "relu")
_PROBE = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)

FLAG_NAMES = ("has_gate", "is_transposed", "is_concatenated", "has_bias", "has_post_expert_norm")


@dataclass(frozen=True)
class HFExpertsFlags:
    """The flags ``@use_experts_implementation`` set, and whether the class overrides
    ``_apply_gate`` (``custom_gate``)."""

    has_gate: bool
    is_transposed: bool
    is_concatenated: bool
    has_bias: bool
    has_post_expert_norm: bool
    custom_gate: bool


@dataclass(frozen=True)
class HFExpertsLayout:
    """One transformers experts module in mixmoe's terms.

    weights:    views of the module's parameters. With ``activation`` set, mixmoe's layout;
                for ``swiglu`` w1 = [gate | up] [S, D, 2F] and w3 None (``ExpertWeights``'
                concatenated form), split into w1 gate / w3 up only with
                ``require_mixmoe_activation`` or a post-norm. With ``activation=None`` and a gated module,
                w1_SDF holds the gate AND up columns in transformers' order, [S, D, 2F], and w3 is
                None: ``elementwise`` (the module's ``_apply_gate``) maps that to [.., F].
    activation: a mixmoe activation (``swiglu``, ``silu``, ``gelu``, ``relu``) or None.
    elementwise: None, or what runs between the two GEMMs (``_apply_gate`` or ``act_fn``).
    post_norm:  None, or the module's ``post_expert_norm`` (applied to each expert output row).
    num_experts: S; ids >= S are expert-parallel sentinels (dropped choices).
    """

    weights: ExpertWeights
    activation: str | None
    elementwise: Callable[[torch.Tensor], torch.Tensor] | None
    post_norm: nn.Module | None
    num_experts: int


def read_flags(module: nn.Module) -> HFExpertsFlags:
    """The layout flags of a transformers experts module (TypeError if it has none)."""
    missing = [n for n in FLAG_NAMES if not hasattr(module, n)]
    if missing:
        raise TypeError(
            f"{type(module).__name__} has no {missing}: it is not an experts module decorated "
            "with transformers' @use_experts_implementation"
        )
    from transformers.integrations.moe import _default_apply_gate

    return HFExpertsFlags(
        has_gate=bool(module.has_gate),
        is_transposed=bool(module.is_transposed),
        is_concatenated=bool(module.is_concatenated),
        has_bias=bool(module.has_bias),
        has_post_expert_norm=bool(module.has_post_expert_norm),
        custom_gate=getattr(type(module), "_apply_gate", None) is not _default_apply_gate,
    )


def _as_SIO(w: torch.Tensor, is_transposed: bool) -> torch.Tensor:
    """[S, out, in] (``nn.Linear`` order) or, transposed, [S, in, out] -> a [S, in, out] view."""
    return w if is_transposed else w.transpose(1, 2)


def _split_gate_up(t: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up halves of the LAST dim (views)."""
    if concatenated:
        F = t.shape[-1] // 2
        return t[..., :F], t[..., F:]
    return t[..., 0::2], t[..., 1::2]


def expert_weights(
    tensors: Mapping[str, torch.Tensor | None], flags: HFExpertsFlags, *, split_gate: bool = True
) -> ExpertWeights:
    """mixmoe's ``ExpertWeights`` (views) from transformers' tensors (``gate_up_proj`` or
    ``up_proj``, ``down_proj``, and with ``has_bias`` their ``*_bias``). ``split_gate``: gated
    weights as w1 (gate) and w3 (up); False: w1 = the whole [S, D, 2F] in transformers' column
    order. Works on any tensors of those shapes (parameters, or their gradients)."""

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"the experts module has no {name!r}, which its flags require")
        return t

    first = "gate_up_proj" if flags.has_gate else "up_proj"
    w_SDO = _as_SIO(get(first), flags.is_transposed)
    b_SO = get(f"{first}_bias") if flags.has_bias else None
    w2_SFD = _as_SIO(get("down_proj"), flags.is_transposed)
    b2_SD = get("down_proj_bias") if flags.has_bias else None
    if flags.has_gate and w_SDO.shape[-1] != 2 * w2_SFD.shape[1]:
        raise ValueError(
            f"gate_up_proj has {w_SDO.shape[-1]} output features, down_proj {w2_SFD.shape[1]} "
            "input features: expected twice as many (gate and up); check is_transposed"
        )
    if not (flags.has_gate and split_gate):
        return ExpertWeights(w_SDO, w2_SFD, b_SO, b2_SD)
    w1_SDF, w3_SDF = _split_gate_up(w_SDO, flags.is_concatenated)
    b1_SF, b3_SF = _split_gate_up(b_SO, flags.is_concatenated) if b_SO is not None else (None,) * 2
    return ExpertWeights(w1_SDF, w2_SFD, b1_SF, b2_SD, w3_SDF, b3_SF)


def mixmoe_activation_of(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """The mixmoe activation ``act_fn`` computes (checked numerically on a probe in float64, so a
    class name never decides), or None."""
    try:
        got = act_fn(_PROBE)
    except Exception:  # an activation that cannot run on the probe is simply not one of ours
        return None
    for name in MIXMOE_ACTIVATIONS:
        if torch.allclose(got, activate(_PROBE, name), rtol=1e-12, atol=1e-12):
            return name
    return None


def hf_experts_layout(
    module: nn.Module, *, require_mixmoe_activation: bool = False
) -> HFExpertsLayout:
    """Read one transformers experts module (see the module docstring). Raises ValueError naming
    the flag for a layout it cannot run exactly."""
    flags = read_flags(module)
    tensors = dict(module.named_parameters(recurse=False))
    act_fn = getattr(module, "act_fn", None)
    act = mixmoe_activation_of(act_fn) if act_fn is not None else None
    if flags.has_gate and not flags.custom_gate and not flags.is_concatenated:
        raise ValueError(
            f"{type(module).__name__}: is_concatenated=False (interleaved gate/up) with the "
            "default _apply_gate, which splits gate_up in two halves: the layout contradicts the "
            "math; define _apply_gate for the interleaved layout"
        )
    post_norm = getattr(module, "post_expert_norm", None) if flags.has_post_expert_norm else None
    if flags.has_post_expert_norm and post_norm is None:
        raise ValueError(
            f"{type(module).__name__}: has_post_expert_norm=True but no post_expert_norm module"
        )
    if flags.has_gate and not flags.custom_gate and act == "silu":
        activation, elementwise = "swiglu", None
    elif not flags.has_gate and act is not None:
        activation, elementwise = act, None
    else:
        activation = None
        elementwise = module._apply_gate if flags.has_gate else act_fn
        if elementwise is None:
            raise ValueError(f"{type(module).__name__}: has_gate=False but no act_fn")
    if require_mixmoe_activation:
        if flags.has_post_expert_norm:
            raise ValueError(
                f"{type(module).__name__}: has_post_expert_norm=True has no mixmoe MoE layer "
                "equivalent; use the 'mixmoe' experts implementation instead of converting"
            )
        if activation is None:
            why = (
                "a custom _apply_gate"
                if flags.custom_gate
                else f"act_fn {type(act_fn).__name__} (not one of {MIXMOE_ACTIVATIONS})"
            )
            raise ValueError(
                f"{type(module).__name__}: {why} (has_gate={flags.has_gate}) has no mixmoe MoE "
                "layer equivalent; use the 'mixmoe' experts implementation instead of converting"
            )
    # swiglu stays [gate | up] in one w1 (mixmoe's CPU path runs it as one GEMM and gives the
    # gradient of gate_up_proj whole); split for conversion and for the post-norm path
    split = activation is not None and (
        activation != "swiglu" or require_mixmoe_activation or post_norm is not None
    )
    weights = expert_weights(tensors, flags, split_gate=split)
    return HFExpertsLayout(weights, activation, elementwise, post_norm, weights.num_slots)
