"""Frozen, validated configuration of a MoE layer.

Every field is checked at construction, so a bad value fails where it was written, with a message
naming the value and the fix, never deep inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mixmoe.validation import check_block_size, check_bool, check_float, check_int

GATE_TYPES = ("topk", "switch", "gshard")
ACTIVATIONS = ("gelu", "relu", "silu", "swiglu")
TOPK_NORMALIZE = ("topk_softmax", "softmax_renorm", "softmax", "renorm", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
GROUP_SCORES = ("sum_top2", "max")
ROUTER_DTYPES = ("float32", "float64")
BALANCE_LOSSES = ("micro_batch", "sequence", "global_batch")
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

    Scored routing (DeepSeek-V2/V3, GLM-4-MoE, Qwen3-Next; ``type="topk"`` only). Any of the
    options below away from its default routes with ``mixmoe.gating.routing.scored_route``:

        scores_TN = softmax(logits) (``score="softmax"``) or sigmoid(logits) (``"sigmoid"``)
        choice_TN = scores_TN + expert_bias_N          (only with ``expert_bias``; selection only)
        groups:     the N experts split into ``n_groups`` groups of N / n_groups CONSECUTIVE ids;
                    a group's score is the sum of its two best ``choice`` values (``group_score=
                    "sum_top2"``, DeepSeek-V3) or its best one (``"max"``, DeepSeek-V2's
                    group_limited_greedy); only the ``topk_groups`` best groups stay eligible
        ids_TK      = the K best eligible ``choice`` values
        weights_TK  = scores_TN at ids_TK (never the bias), then ``normalize``:
                      ``renorm`` (or ``softmax_renorm``) divide by their sum, ``none`` (or
                      ``softmax``) keep them, ``topk_softmax`` softmax of the selected logits
                      (softmax score only); then times ``route_scale``.

    score:
        ``softmax`` (default) or ``sigmoid``. ``sigmoid`` takes ``normalize="renorm"`` or
        ``"none"``; ``softmax`` takes any ``normalize``.
    n_groups, topk_groups, group_score:
        group-limited top-k; ``topk_groups=None`` means every group (no limit). ``n_groups``
        must divide ``num_experts``; ``sum_top2`` needs at least 2 experts per group; the
        ``topk_groups`` groups must hold at least ``top_k`` experts.
    route_scale:
        the combine weights times this (> 0; DeepSeek's ``routed_scaling_factor``).
    router_dtype:
        ``None`` (default): the router weight lives in the layer's dtype and the softmax runs in
        at least float32 (the classic gates' behaviour). ``"float32"`` / ``"float64"``: the
        router weight is KEPT in that dtype (``layer.to(torch.bfloat16)`` leaves it alone), the
        input is cast to it, and the logits, scores, selection and losses are computed in it;
        the combine weights are returned in the input's dtype.
    expert_bias, bias_update_rate:
        aux-loss-free balancing (DeepSeek-V3). ``expert_bias=True`` gives the gate a float32
        buffer ``expert_bias`` [N] (zeros, in the state_dict) added to the scores for SELECTION
        only. Once per optimizer step (``MoE.end_step`` / ``mixmoe.layers.balance``) it moves by
        ``bias += bias_update_rate * sign(mean_load - load_N)`` from the step's global counts.

    Tie-breaking everywhere (experts and groups): among equal values the LOWER id wins.
    """

    type: str = "topk"
    normalize: str = "topk_softmax"
    jitter_eps: float = 0.0
    random_routing: bool = False
    bias: bool = True
    score: str = "softmax"
    n_groups: int = 1
    topk_groups: int | None = None
    group_score: str = "sum_top2"
    route_scale: float = 1.0
    router_dtype: str | None = None
    expert_bias: bool = False
    bias_update_rate: float = 1e-3

    @property
    def scored(self) -> bool:
        """Whether routing needs ``scored_route`` (any scored-routing option off its default)."""
        return (
            self.score != "softmax"
            or self.normalize in ("renorm", "none")
            or self.group_limited
            or self.route_scale != 1.0
            or self.expert_bias
        )

    @property
    def group_limited(self) -> bool:
        return (
            self.n_groups > 1 and self.topk_groups is not None and self.topk_groups < self.n_groups
        )

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
        self._check_scored()

    def _check_scored(self) -> None:
        if self.score not in SCORE_FUNCTIONS:
            raise ValueError(f"gate score {self.score!r} is unknown; use one of {SCORE_FUNCTIONS}")
        if self.score == "sigmoid" and self.normalize not in ("renorm", "none"):
            raise ValueError(
                f"score='sigmoid' takes normalize='renorm' (weights divided by their sum) or "
                f"'none', got {self.normalize!r}"
            )
        if self.score == "softmax" and self.normalize in ("renorm", "none"):
            raise ValueError(
                f"normalize={self.normalize!r} is spelled for score='sigmoid'; with softmax use "
                "'softmax_renorm' (renormalised) or 'softmax' (as they are)"
            )
        check_int("n_groups", self.n_groups, 1)
        if self.topk_groups is not None:
            check_int("topk_groups", self.topk_groups, 1)
            if self.topk_groups > self.n_groups:
                raise ValueError(
                    f"topk_groups={self.topk_groups} exceeds n_groups={self.n_groups}; use "
                    f"1 <= topk_groups <= n_groups (or None: every group)"
                )
        if self.group_score not in GROUP_SCORES:
            raise ValueError(
                f"group_score {self.group_score!r} is unknown; use one of {GROUP_SCORES}"
            )
        check_float("route_scale", self.route_scale)
        if not 0.0 < self.route_scale < float("inf"):
            raise ValueError(f"route_scale must be finite and > 0, got {self.route_scale}")
        if self.router_dtype is not None and self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"router_dtype {self.router_dtype!r} is unknown; use None (the layer's dtype) or "
                f"one of {ROUTER_DTYPES}"
            )
        check_bool("bias", self.bias)  # a NaN passed for a flag read as True
        check_bool("expert_bias", self.expert_bias)
        check_float("bias_update_rate", self.bias_update_rate)
        if self.bias_update_rate == float("inf"):
            raise ValueError("bias_update_rate must be finite, e.g. 1e-3")
        if self.scored and self.type != "topk":
            raise ValueError(
                "score, normalize='renorm'/'none', group-limited routing, route_scale and "
                f"expert_bias are topk-gate options; set type='topk' (got type={self.type!r})"
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

    plan_ahead: under ``mix``, plan each step from the step before's counts, on the
    dispatcher's background thread while that step runs, and fit that plan to the step's own
    counts on its critical path (``mixmoe.placement.refit``: each helper keeps its share of its
    expert's rows; W = 256 zipf:1.2: ~0.25 ms against ~1-2 ms for a plan): the planning time
    the step waits for shrinks several times, for a plan within a few % of a fresh one while
    the hot experts stay (``mixmoe bench balance --ahead``). A fit predicted more than
    ``refit.REFIT_SLACK`` above its plan's own step (the hot experts moved) and the first step
    plan afresh. False (default): each step plans from its own counts.

    plan_helpers: under ``mix``, balance the plan with helper ranks (True, the default: blocks of
    the busiest ranks' rows move to ranks with spare capacity, ``mixmoe.placement.balance``), or
    keep the best of the a2a, shadow and source-replica plans (False: planning takes a fraction
    of the time on skewed counts, see docs/results/balance-after.md, for a less balanced step).

    balance_loss: which load-balancing loss ``aux_loss_coef`` weighs (all equal 1.0 under perfectly
    uniform routing; P = per-token balance probabilities: softmax(logits), or for
    ``score="sigmoid"`` the sigmoid scores divided by their sum; padded tokens never count):
        ``micro_batch`` (default) N * sum_i f_i * P_i over this forward's tokens (GShard: first
                        choices only), f_i = share of the routed rows that went to expert i;
        ``sequence``    the same per sequence (DeepSeek-V3's sequence-wise loss; an input
                        [..., S, D] has sequences of S tokens, a 2-D input is one sequence),
                        averaged over the sequences with at least one unpadded token;
        ``global_batch`` f_i from the rows of every rank of the expert-parallel group (the
                        dispatcher's count matrix: no extra collective), P_i from this rank's
                        tokens; on one device it equals ``micro_batch``.

    shared_experts, shared_hidden_dim, shared_gate: ``shared_experts`` dense experts every token
    goes through (DeepSeek, Qwen2-MoE), computed as ONE MLP of hidden size ``shared_experts *
    shared_hidden_dim`` (``None``: ``hidden_dim``) with the layer's activation and bias, added to
    the routed output; ``shared_gate=True`` multiplies it by ``sigmoid(x @ w_gate)`` per token
    (Qwen2-MoE's ``shared_expert_gate``, w_gate [D], no bias). Under expert parallelism it is
    computed while the token exchange is in flight.
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
    plan_ahead: bool = False
    plan_helpers: bool = True
    balance_loss: str = "micro_batch"
    shared_experts: int = 0
    shared_hidden_dim: int | None = None
    shared_gate: bool = False

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
        if not isinstance(self.plan_ahead, bool):
            raise TypeError(f"plan_ahead must be True or False, got {self.plan_ahead!r}")
        if not isinstance(self.plan_helpers, bool):
            raise TypeError(f"plan_helpers must be True or False, got {self.plan_helpers!r}")
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
        self._check_groups()
        if self.balance_loss not in BALANCE_LOSSES:
            raise ValueError(
                f"balance_loss {self.balance_loss!r} is unknown; use one of {BALANCE_LOSSES}"
            )
        check_int("shared_experts", self.shared_experts, 0)
        if self.shared_hidden_dim is not None:
            check_int("shared_hidden_dim", self.shared_hidden_dim, 1)
        check_bool("bias", self.bias)
        check_bool("shared_gate", self.shared_gate)
        if self.shared_experts == 0 and (self.shared_gate or self.shared_hidden_dim is not None):
            raise ValueError(
                "shared_gate / shared_hidden_dim need shared experts; set shared_experts >= 1"
            )
        check_float("aux_loss_coef", self.aux_loss_coef)
        check_float("z_loss_coef", self.z_loss_coef)
        check_block_size(self.block_size)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r} is unknown; use one of {STRATEGIES}")

    def _check_groups(self) -> None:
        gate, N = self.gate, self.num_experts
        if N % gate.n_groups:
            raise ValueError(
                f"n_groups={gate.n_groups} does not divide num_experts={N}; use a divisor of {N}"
            )
        per_group = N // gate.n_groups
        if gate.group_limited and gate.group_score == "sum_top2" and per_group < 2:
            raise ValueError(
                f"group_score='sum_top2' needs at least 2 experts per group, got {per_group} "
                f"(num_experts={N}, n_groups={gate.n_groups}); use fewer groups or 'max'"
            )
        if gate.group_limited and self.top_k > gate.topk_groups * per_group:
            raise ValueError(
                f"top_k={self.top_k} exceeds the {gate.topk_groups * per_group} experts of the "
                f"topk_groups={gate.topk_groups} groups kept; raise topk_groups or lower top_k"
            )

    @property
    def shared_dim(self) -> int:
        """Hidden size of the shared-experts MLP (0 without shared experts)."""
        per = self.hidden_dim if self.shared_hidden_dim is None else self.shared_hidden_dim
        return self.shared_experts * per
