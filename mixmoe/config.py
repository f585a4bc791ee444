"""Frozen, validated configuration of a MoE layer.

Every field is checked at construction, so a bad value fails where it was written, with a message
naming the value and the fix, never deep inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mixmoe.validation import check_block_size, check_float, check_int

GATE_TYPES = ("topk", "switch", "gshard")
ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")
TOPK_NORMALIZE = ("topk_softmax", "softmax_renorm", "softmax")
STRATEGIES = ("local", "a2a", "shadow", "mix")


@dataclass(frozen=True)
class GateConfig:
    """Router settings.

    type:
        ``topk``   FastMoE NaiveGate: top-k of the logits, softmax over the k selected logits
                   (``normalize="topk_softmax"``) or softmax over all experts then the k selected
                   probabilities renormalised to sum to one (``normalize="softmax_renorm"``;
                   the same numbers as ``topk_softmax`` up to rounding), or softmax over all
                   experts and the k selected probabilities NOT renormalised
                   (``normalize="softmax"``: they sum to less than one; Qwen-MoE with
                   ``norm_topk_prob=False``).
        ``switch`` Switch Transformer: top-1, weight = softmax probability of the chosen expert;
                   ``jitter_eps > 0`` multiplies the input by U(1-eps, 1+eps) noise in training.
        ``gshard`` GShard: top-2 of the softmax, weights renormalised over the two; with
                   ``random_routing`` the 2nd choice is kept in training only with probability
                   ``min(1, 2 * w2)`` (w2 its renormalised weight), otherwise dropped (id -1).
    """

    type: str = "topk"
    normalize: str = "topk_softmax"
    jitter_eps: float = 0.0
    random_routing: bool = False
    bias: bool = True

    def __post_init__(self) -> None:
        if self.type not in GATE_TYPES:
            raise ValueError(f"gate type {self.type!r} is unknown; use one of {GATE_TYPES}")
        if self.normalize not in TOPK_NORMALIZE:
            raise ValueError(
                f"gate normalize {self.normalize!r} is unknown; use one of {TOPK_NORMALIZE}"
            )
        check_float("jitter_eps", self.jitter_eps)
        if self.jitter_eps >= 1.0:
            raise ValueError(f"jitter_eps must be in [0, 1), got {self.jitter_eps}")
        if self.jitter_eps and self.type != "switch":
            raise ValueError(
                "jitter_eps is a switch-gate option; set type='switch' or jitter_eps=0"
            )
        if self.random_routing and self.type != "gshard":
            raise ValueError(
                "random_routing is a gshard-gate option; set type='gshard' or random_routing=False"
            )


@dataclass(frozen=True)
class MoEConfig:
    """Shape and behaviour of one MoE layer.

    num_experts is the GLOBAL number of experts N; under expert parallelism over W ranks each rank
    owns N // W of them (expert g lives on rank g // (N // W)).

    plan_async: under ``mix``, plan on the dispatcher's background thread while this rank's rows
    for its own experts are computed (True), or plan first and compute after (False), or
    ``None`` (the default): True when the step's tokens are on a CUDA device (the own rows run
    on the GPU while the host plans), False on CPU, where the plan and the compute share the
    cores (measured: mix/a2a 0.79-0.80 planning first vs 0.96-0.99 planning in the background,
    2 gloo ranks x 1 thread, `bench layer --plan`). Every setting gives the same plan and the
    same numbers; only the overlap differs.
    """

    model_dim: int
    hidden_dim: int
    num_experts: int
    top_k: int = 2
    activation: str = "gelu"
    bias: bool = True
    gate: GateConfig = field(default_factory=GateConfig)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    block_size: int = 64
    strategy: str = "local"
    max_replicas: int = 4
    plan_async: bool | None = None

    def __post_init__(self) -> None:
        check_int("model_dim", self.model_dim, 1)
        check_int("hidden_dim", self.hidden_dim, 1)
        check_int("num_experts", self.num_experts, 1)
        check_int("top_k", self.top_k, 1)
        check_int("max_replicas", self.max_replicas, 0)
        if self.plan_async is not None and not isinstance(self.plan_async, bool):
            raise TypeError(
                f"plan_async must be True, False or None (auto: on CUDA only), got "
                f"{self.plan_async!r}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                f"use top_k <= num_experts"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is unknown; use one of {ACTIVATIONS}")
        if not isinstance(self.gate, GateConfig):
            raise TypeError(f"gate must be a GateConfig, got {type(self.gate).__name__}")
        if self.gate.type == "switch" and self.top_k != 1:
            raise ValueError(f"the switch gate routes top-1; got top_k={self.top_k}, use top_k=1")
        if self.gate.type == "gshard" and self.top_k != 2:
            raise ValueError(f"the gshard gate routes top-2; got top_k={self.top_k}, use top_k=2")
        check_float("aux_loss_coef", self.aux_loss_coef)
        check_float("z_loss_coef", self.z_loss_coef)
        check_block_size(self.block_size)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is unknown; use one of {STRATEGIES}")
