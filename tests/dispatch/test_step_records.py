"""The records one step hands from stage to stage (``dispatch/step.py``, ``layout.py``, the
strategy registry) are frozen: a stage may not rewrite what the next one reads (the work items,
the layout, the meta ``combine`` uses, a strategy's flags shared by every layer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.comm import LocalCommunicator
from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.dispatch.step import ExpertOutputs
from mixmoe.dispatch.strategies import STRATEGY_SPECS
from mixmoe.parallel import parallelize_moe


def _local_step(strategy: str | None = None):
    """One dispatch of the single-device layer, or (``strategy``) of the expert-parallel
    dispatcher on a world of one."""
    torch.manual_seed(0)
    layer = MoE(MoEConfig(model_dim=8, hidden_dim=12, num_experts=4), dtype=torch.float64)
    if strategy is not None:
        parallelize_moe(layer, LocalCommunicator(), strategy)
    x = torch.randn(7, 8, dtype=torch.float64)
    routing, _, _ = layer.gate(x)
    step = layer.dispatcher.dispatch(x, routing, layer.experts.weights())
    if strategy is not None:
        layer.dispatcher.close()
    return step


def _records() -> dict:
    rows, layout, meta = _local_step()
    ids_TK = torch.tensor([[0, 2], [1, 0], [2, 3]])
    return {
        "DispatchedRows": (rows, "local_TD"),
        "ExpertLayout": (layout, "work"),
        "ExpertWork": (layout.work[0], "pos_TK"),
        "LocalStepMeta": (meta, "counts_N"),
        "StepMeta": (_local_step("mix")[2], "counts_N"),
        "ExpertOutputs": (ExpertOutputs(torch.zeros(3, 8)), "received_RD"),
        "RowLayout": (expert_row_layout(ids_TK, 4, 4), "token_P"),
        "StrategySpec": (STRATEGY_SPECS["mix"], "overlap"),
    }


@pytest.mark.parametrize("name", list(_records()))
def test_step_records_are_frozen(name: str) -> None:
    record, field = _records()[name]
    assert type(record).__name__ == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, field, None)


def test_a_local_step_hands_the_experts_only_the_tokens() -> None:
    """The single-device dispatcher's rows: the tokens, no replicas, nothing received, no local
    output computed ahead (the defaults of ``DispatchedRows``)."""
    rows, layout, meta = _local_step()
    assert rows.replicas is None and rows.receive is None and rows.local_done_TD is None
    assert meta.stats == {}  # a local step has no stats (the layer reports None)
    with pytest.raises(ValueError, match="received no rows"):
        rows.received()
    assert [(w.source, w.weights, w.span) for w in layout.work] == [
        ("local", "owned", "moe.experts")
    ]
    assert ExpertOutputs(torch.zeros(3, 8)).received_RD is None


def test_an_unparallelized_layer_names_its_dispatcher_local() -> None:
    """Like the expert-parallel dispatchers' ``name`` (the strategy they run)."""
    layer = MoE(MoEConfig(model_dim=8, hidden_dim=12, num_experts=4))
    assert layer.dispatcher.name == "local"


def test_strategy_registry_is_the_documented_one() -> None:
    """``strategies.py``: a2a and shadow exchange synchronously and cache nothing; mix overlaps
    the exchange with the local blocks, caches replicas and may plan in the background. (The
    flags change only speed and the replica traffic, never the numbers: the equality tests
    cannot see them.)"""
    flags = {
        name: (spec.name, spec.overlap, spec.cache_replicas, spec.plan_async)
        for name, spec in STRATEGY_SPECS.items()
    }
    assert flags == {
        "a2a": ("a2a", False, False, False),
        "shadow": ("shadow", False, False, False),
        "mix": ("mix", True, True, True),
    }


@pytest.mark.parametrize("strategy", ["a2a", "shadow"])
def test_only_mix_plans_in_the_background_even_when_asked(strategy: str) -> None:
    from mixmoe.comm import LocalCommunicator
    from mixmoe.parallel import parallelize_moe

    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, plan_async=True)
    layer = parallelize_moe(MoE(cfg, dtype=torch.float64), LocalCommunicator(), strategy)
    assert not layer.dispatcher.plans_async("cpu") and not layer.dispatcher.plans_async("cuda")
    layer(torch.randn(5, 8, dtype=torch.float64))
    assert layer.dispatcher._planner_thread is None


def test_config_fingerprint_is_31_bits_and_tells_every_agreed_field_apart() -> None:
    """Ranks compare fingerprints to refuse a config, strategy or world size that differs: each
    of them must change the digest, which must fit a non-negative int32."""
    from mixmoe.dispatch.strategies import config_fingerprint

    base = {"model_dim": 8, "hidden_dim": 12, "num_experts": 4, "top_k": 2}
    changed = {
        "num_experts": 8,
        "top_k": 1,
        "model_dim": 16,
        "hidden_dim": 24,
        "activation": "swiglu",
        "bias": False,
        "block_size": 32,
        "max_replicas": 1,
        "gate": GateConfig(score="sigmoid", normalize="renorm"),
        "shared_experts": 1,
        "balance_loss": "sequence",
        "plan_ahead": True,
    }
    want = config_fingerprint(MoEConfig(**base), 2, "mix")
    assert want == config_fingerprint(MoEConfig(**base), 2, "mix")  # a pure function
    prints = {"base": want, "a2a": config_fingerprint(MoEConfig(**base), 2, "a2a")}
    prints["W=4"] = config_fingerprint(MoEConfig(**base), 4, "mix")
    for field, value in changed.items():
        prints[field] = config_fingerprint(MoEConfig(**{**base, field: value}), 2, "mix")
    assert len(set(prints.values())) == len(prints), prints
    assert all(0 <= p < 2**31 for p in prints.values()), prints
