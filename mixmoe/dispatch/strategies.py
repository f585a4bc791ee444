"""The expert-parallel strategies, one registry: each spec carries its planner and its flags.

Legend: W ranks, N experts, C the count matrix [W, N].

    a2a     nothing replicated (FastMoE / Megatron style), synchronous exchange.
    shadow  FasterMoE's shadowing rule, hot experts broadcast to every rank, synchronous exchange.
    mix     the cost-model planner, run on a background thread while the own rows are computed
            (``MoEConfig.plan_async``); local blocks overlap the exchange; replicas cached while
            the owners' weights are unchanged.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import torch

from mixmoe.config import MoEConfig
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.counts import CountSums
from mixmoe.placement.planner import Plan, plan_mix, plan_none, plan_shadow
from mixmoe.placement.profile import HardwareProfile


class Planner(Protocol):
    """A strategy's planner: deterministic, a function of its arguments alone. ``sums``: C's
    ``CountSums`` where the layer has them (else None: the planner sums C itself)."""

    def __call__(
        self,
        C_WN: torch.Tensor,
        shape: LayerShape,
        profile: HardwareProfile,
        config: MoEConfig,
        sums: CountSums | None = None,
    ) -> Plan: ...


@dataclass(frozen=True)
class StrategySpec:
    """name; planner(C, shape, profile, config, sums=None) -> Plan (deterministic: the same on
    every rank; ``sums``: C's ``CountSums`` where the layer has them);
    overlap: local blocks computed while the token all_to_all is in flight;
    cache_replicas: reuse fetched replicas while their owners' weights are unchanged;
    plan_async: the plan may run on a background thread while the own rows are computed (when
    ``MoEConfig.plan_async`` is set too);
    counts_by_column: the count exchange brings C stored by columns (``dispatch.layout``): its
    compiled planner, fit and bookkeeping walk down C's columns."""

    name: str
    planner: Planner
    overlap: bool
    cache_replicas: bool
    plan_async: bool = False
    counts_by_column: bool = False


STRATEGY_SPECS: dict[str, StrategySpec] = {
    "a2a": StrategySpec(
        "a2a",
        lambda C, shape, prof, cfg, sums=None: plan_none(C, shape, prof, sums=sums),
        False,
        False,
    ),
    "shadow": StrategySpec(
        "shadow",
        lambda C, shape, prof, cfg, sums=None: plan_shadow(C, shape, prof, sums=sums),
        False,
        False,
    ),
    "mix": StrategySpec(
        "mix",
        # share entries cut at the layer's blocks, so that no block straddles two ranks
        lambda C, shape, prof, cfg, sums=None: plan_mix(
            C,
            shape,
            prof,
            cfg.max_replicas,
            block_size=cfg.block_size,
            balance=getattr(cfg, "plan_helpers", True),
            sums=sums,
        ),
        True,
        True,
        True,
        True,
    ),
}


# ``local`` (W = 1, every expert on the one device) priced by the cost model: nothing moves,
# nothing is replicated (``plan_none``'s loads). Not an expert-parallel strategy: the layer runs
# it without a dispatcher, so it is not in STRATEGY_SPECS; the calibration and the simulator
# price it through ``planning_spec``.
LOCAL_SPEC = StrategySpec(
    "local",
    lambda C, shape, prof, cfg, sums=None: plan_none(C, shape, prof, sums=sums),
    False,
    False,
)


def planning_spec(name: str, world_size: int) -> StrategySpec:
    """The spec whose planner prices strategy ``name`` on ``world_size`` ranks: ``strategy_spec``
    for a2a / shadow / mix (W >= 2), ``LOCAL_SPEC`` for ``local`` (W = 1 only)."""
    if name == "local":
        if world_size != 1:
            raise ValueError(
                f"strategy 'local' runs on one rank, got world_size {world_size}; use a2a, "
                "shadow or mix on several ranks"
            )
        return LOCAL_SPEC
    spec = strategy_spec(name)
    if world_size == 1:
        raise ValueError(
            f"strategy {name!r} is expert-parallel and needs world_size >= 2; on one rank the "
            "strategy is 'local'"
        )
    return spec


def strategy_spec(name: str) -> StrategySpec:
    """The spec of an expert-parallel strategy; a clear error for anything else."""
    if name not in STRATEGY_SPECS:
        raise ValueError(
            f"strategy {name!r} is not expert-parallel; use one of {sorted(STRATEGY_SPECS)}"
        )
    return STRATEGY_SPECS[name]


def config_fingerprint(config: MoEConfig, world_size: int, strategy: str) -> int:
    """A stable 31-bit digest of everything all ranks must agree on, including the strategy the
    dispatcher RUNS (not ``config.strategy``: ``parallelize_moe(layer, comm, name)`` overrides it)."""
    key = (
        config.num_experts,
        config.top_k,
        config.model_dim,
        config.hidden_dim,
        config.activation,
        config.bias,
        config.block_size,
        config.max_replicas,
        config.plan_helpers,
        config.plan_ahead,  # ranks fitting and ranks planning afresh would plan differently
        strategy,
        world_size,
        # the router and the shared experts: ranks routing differently would not hang, but they
        # would silently compute another layer than the single-device one
        repr(config.gate),
        config.shared_experts,
        config.shared_dim,
        config.shared_gate,
        config.balance_loss,
    )
    return zlib.crc32(repr(key).encode()) & 0x7FFFFFFF
