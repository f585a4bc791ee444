"""mixmoe's expert-parallel strategies as transformers EP implementations.

Legend: T tokens on this rank, K top-k, D model dim, F expert hidden dim, W ranks of the EP group,
E experts per rank, N = W*E experts.

transformers 5 shards the experts of a MoE model over the ``ep`` dimension of its device mesh
when a model is loaded with ``from_pretrained(..., distributed_config=DistributedConfig(ep_size=W,
fsdp_size=..., ep_implementation=NAME))``; the experts module's forward then calls
``EPImplementationInterface[NAME](experts, ep_mesh, tp_mesh)`` as
``impl(hidden_states_TD, top_k_index_TK, top_k_weights_TK)`` (global expert ids) inside a context
in which the module's parameters are the LOCAL tensors of its DTensor shards (rank r of the EP
group holds experts r*E .. r*E+E-1, exactly mixmoe's ownership). ``import mixmoe.hf`` registers

    mixmoe_a2a     dropless all-to-all, no replication
    mixmoe_shadow  FasterMoE shadowing: hot experts broadcast to every rank
    mixmoe_mix     the mixed strategy: cost-model replicas, local rows overlap the exchange

Each runs mixmoe's engine, ``ExpertParallelDispatcher`` (counts exchange, planner, replica fetch,
64-row blocks, overlap), over the EP mesh's process group, and computes every work item with the
module's own weight layout through the one layout adapter (``hf_layout``; the fused ops of
``mixmoe.hf.experts.run_layout_rows``). Replica weights are packed from the owner's local tensors, so a
replica's gradient flows back by autograd into the owner's local tensor, from there into its
DTensor parameter and to FSDP's reduction, like the gradient of any owned expert: nothing is
added to ``.grad`` by hand, so nothing is lost or counted twice under FSDP.

``register_ep_implementation(name, strategy, profile=..., max_replicas=..., plan_ahead=...)``
registers a strategy with a measured ``HardwareProfile`` for the planner (the registered three
use the device's default profile), another replica budget, or ``mix`` planned a step ahead.
``ep_implementations(model)`` returns the instances transformers built (their ``last_stats``
say what the last step did: rows moved, replicas).

The replica cache of ``mix`` is keyed on the version of the experts module's FSDP2-SHARDED
parameters (``mixmoe.comm.fsdp``): FSDP2 refills the unsharded expert weights in place while
preserving their version counters, so their own versions do not see an optimizer step, but the
sharded parameters the optimizer writes do. Forwards between two optimizer steps (gradient
accumulation's micro-batches, evaluation) reuse the replicas when the plan repeats; a module
that is not an FSDP2 unit fetches them every forward.

Limits (each raises a ValueError naming it): ``tp_size`` must be 1; a ``post_expert_norm``
(``has_post_expert_norm=True``) is not expert-sharded by transformers' plan, so it is refused;
every expert tensor must hold the rank's E experts along dim 0 (transformers' ``grouped_gemm``
rule).
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.comm import ProcessGroupCommunicator
from mixmoe.comm.fsdp import sharded_parameters_version
from mixmoe.config import MoEConfig
from mixmoe.dispatch.expert_parallel import ExpertParallelDispatcher
from mixmoe.dispatch.step import ExpertOutputs, ExpertWork
from mixmoe.dispatch.strategies import strategy_spec
from mixmoe.hf.experts import BLOCK_SIZE, combine_dtype, run_layout_rows
from mixmoe.hf.layout import HFExpertsLayout, hf_experts_layout, read_flags
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.placement.profile import HardwareProfile
from mixmoe.types import Routing
from mixmoe.validation import check_int, check_plan_ahead


class MixmoeEP:
    """One mixmoe strategy behind transformers' ``EPImplementation`` contract. transformers builds
    one per experts module when it applies the EP plan; the dispatcher is built at the first
    call (when top-k is known). Its replica cache is keyed on the FSDP2-sharded parameters'
    version (see the module docstring).

    ``last_stats``: the dispatcher's stats of the last call (rows moved, replicas, ...);
    ``replicas_seen``: replicas summed over every call; ``cached_fetches``: calls whose
    replicas came from the cache; ``plans_fitted``: calls whose plan was the step before's,
    fitted (``plan_ahead``; tests read them); ``plan_wait_ms``: what the calls waited for the
    planning thread, summed (this rank's timing)."""

    # set by ``ep_implementation_class``
    strategy = "mix"
    max_replicas = 4
    profile: HardwareProfile | None = None
    plan_ahead = False

    def __init__(self, experts: nn.Module, ep_mesh, tp_mesh) -> None:
        if tp_mesh.size() != 1:
            raise ValueError(
                f"ep_implementation={self.name!r} needs tp_size=1 (every rank of the EP group "
                f"holds its own batch), got a TP mesh of size {tp_mesh.size()}; use "
                "DistributedConfig(tp_size=1, ...) or ep_implementation='all_to_all'"
            )
        flags = read_flags(experts)
        if flags.has_post_expert_norm:
            raise ValueError(
                f"{type(experts).__name__}: has_post_expert_norm=True is not supported by "
                f"ep_implementation={self.name!r} (the norm's parameters are not expert-sharded); "
                "use ep_implementation='all_to_all', or the 'mixmoe' experts implementation on "
                "one device"
            )
        self.experts = experts
        self.comm = ProcessGroupCommunicator(ep_mesh.get_group())
        self.num_local_experts = int(experts.num_experts)
        self.num_experts = self.num_local_experts * self.comm.world_size
        self.dispatcher: ExpertParallelDispatcher | None = None
        self.last_stats: dict = {}
        self._spec: HFExpertsLayout | None = None  # the current call's layout (_compute_own)
        self.replicas_seen = 0
        self.cached_fetches = 0
        self.plans_fitted = 0
        self.plan_wait_ms = 0.0
        experts.mixmoe_ep = self  # found again by ``ep_implementations(model)``

    @property
    def name(self) -> str:
        return f"mixmoe_{self.strategy}"

    def _config(self, spec: HFExpertsLayout, top_k: int) -> MoEConfig:
        w = spec.weights
        D, F = w.w1_SDF.shape[1], w.w2_SFD.shape[1]
        gated = w.w3_SDF is not None or w.w1_SDF.shape[2] == 2 * F
        # the activation only feeds the cost model (3 GEMMs when gated) and the rank agreement;
        # the math is the module's own (``spec``)
        activation = "swiglu" if gated else (spec.activation or "gelu")
        return MoEConfig(
            model_dim=D,
            hidden_dim=F,
            num_experts=self.num_experts,
            top_k=top_k,
            activation=activation,
            bias=w.b1_SF is not None,
            block_size=BLOCK_SIZE,
            strategy=self.strategy,
            max_replicas=self.max_replicas,
            plan_ahead=self.plan_ahead,
        )

    def _layout(self) -> HFExpertsLayout:
        spec = hf_experts_layout(self.experts)
        E = self.num_local_experts
        w = spec.weights
        wrong = {
            name: tuple(t.shape)
            for name, t in vars(w).items()
            if t is not None and (t.dim() < 2 or t.shape[0] != E)
        }
        if wrong:
            raise ValueError(
                f"{type(self.experts).__name__}: expert tensors {wrong} do not hold this rank's "
                f"{E} experts along dim 0; shard every expert parameter (and bias) with the "
                "'grouped_gemm' rule of the ep_plan"
            )
        return spec

    def _compute_own(
        self, work: ExpertWork, x_TD: torch.Tensor, weights: ExpertWeights
    ) -> torch.Tensor:
        """The dispatcher's own-rows compute (while an async plan is made), in this module's
        weight layout: the same math as every other work item of ``__call__``."""
        return run_layout_rows(
            self._spec, weights, x_TD, work.token_P, work.pos_TK, work.weights_TK, work.schedule
        )

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``y_TD[t] = sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t])``
        over the experts of the whole EP group (global ids); output dtype ``hidden_states``'."""
        x_TD = hidden_states
        if x_TD.dim() != 2 or top_k_index.shape != top_k_weights.shape:
            raise ValueError(
                f"expected hidden_states [T, D] and top_k_index / top_k_weights [T, K], got "
                f"{tuple(x_TD.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}"
            )
        spec = self._layout()
        if self.dispatcher is None:
            config = self._config(spec, top_k_index.shape[1])
            self.dispatcher = ExpertParallelDispatcher(
                self.comm, config, self.strategy, self.profile, compute_own=self._compute_own
            )
        # FSDP2 copies the all-gathered expert weights in place while PRESERVING their version
        # counters, so their versions do not see an optimizer step: the replica cache is keyed
        # on the version of the module's SHARDED parameters, which the optimizer writes. Not an
        # FSDP2 unit: fetch afresh every call (every rank runs the same model, so all agree)
        version = sharded_parameters_version(self.experts)
        if version is None:
            self.dispatcher.invalidate_replicas()
        ids_TK = top_k_index.to(torch.int64)
        weights_TK = top_k_weights.to(combine_dtype(x_TD, spec))
        routing = Routing(ids_TK, weights_TK, x_TD.new_empty((x_TD.shape[0], 0)))
        self._spec = spec  # the layout the dispatcher's own-rows compute uses (_compute_own)
        rows, layout, meta = self.dispatcher.dispatch(x_TD, routing, spec.weights, version=version)
        # under an async plan (mix) the dispatcher already ran the own rows, with this module's math
        local_TD, received_RD = rows.local_done_TD, None
        for work in layout.work:
            source = rows.local_TD if work.source == "local" else rows.received()
            w = spec.weights if work.weights == "owned" else rows.replicas
            out = run_layout_rows(
                spec, w, source, work.token_P, work.pos_TK, work.weights_TK, work.schedule
            )
            if work.source == "received":
                received_RD = out if received_RD is None else received_RD + out
            else:
                local_TD = out if local_TD is None else local_TD + out
        y_TD = self.dispatcher.combine(ExpertOutputs(local_TD, received_RD), meta)
        self.last_stats = dict(meta.stats)
        self.replicas_seen += int(meta.stats["replicas"])
        self.cached_fetches += bool(meta.stats["replica_cached"])
        self.plans_fitted += bool(meta.stats.get("plan_fitted"))
        self.plan_wait_ms += meta.plan_wait_ms
        return y_TD.to(x_TD.dtype)


def ep_implementation_class(
    strategy: str,
    *,
    profile: HardwareProfile | None = None,
    max_replicas: int = 4,
    plan_ahead: bool = False,
) -> type[MixmoeEP]:
    """A ``MixmoeEP`` class running ``strategy`` (``a2a``, ``shadow`` or ``mix``) with this
    hardware profile for the planner (None: the device's default) and replica budget;
    ``plan_ahead`` (``mix`` only): each step fits the plan of the step before's counts
    (``MoEConfig.plan_ahead``)."""
    strategy_spec(strategy)  # a clear error for 'local' or an unknown name
    check_int("max_replicas", max_replicas, 0)
    check_plan_ahead(plan_ahead, strategy, "plan_ahead=False")
    attrs = {"strategy": strategy, "profile": profile, "max_replicas": max_replicas,
             "plan_ahead": plan_ahead}  # fmt: skip
    return type(f"MixmoeEP_{strategy}", (MixmoeEP,), attrs)


# the names ``import mixmoe.hf`` registers, with the default profile and replica budget
EP_CLASSES: dict[str, type[MixmoeEP]] = {
    f"mixmoe_{s}": ep_implementation_class(s) for s in ("a2a", "shadow", "mix")
}


def ep_implementations(model: nn.Module) -> list[MixmoeEP]:
    """The mixmoe EP implementations transformers built for ``model``'s experts modules, in
    module order (empty if the model does not use one)."""
    return [
        m.mixmoe_ep for m in model.modules() if isinstance(getattr(m, "mixmoe_ep", None), MixmoeEP)
    ]


def register_ep_implementation(
    name: str,
    strategy: str,
    *,
    profile: HardwareProfile | None = None,
    max_replicas: int = 4,
    plan_ahead: bool = False,
) -> None:
    """Register ``strategy`` under ``name`` in transformers' ``EPImplementationInterface``
    (global mapping), e.g. a ``mix`` planned with a measured ``HardwareProfile`` (or a step
    ahead: ``plan_ahead``); then ``DistributedConfig(ep_implementation=name)``. Registering a
    name again replaces it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    cls = ep_implementation_class(strategy, profile=profile, max_replicas=max_replicas,
                                  plan_ahead=plan_ahead)  # fmt: skip
    _ep_interface().register(name, cls)


def register_ep_implementations() -> None:
    """Add ``mixmoe_a2a``, ``mixmoe_shadow``, ``mixmoe_mix`` to transformers'
    ``EPImplementationInterface`` (global mapping; idempotent)."""
    interface = _ep_interface()
    for name, cls in EP_CLASSES.items():
        interface.register(name, cls)


def _ep_interface():
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface
    except ImportError as e:
        raise ImportError(
            "mixmoe's EP implementations need transformers>=5.23 with "
            "transformers.distributed.expert_parallel (and accelerate for distributed loading); "
            "install them with pip install 'mixmoe[models]'"
        ) from e
    return EPImplementationInterface
