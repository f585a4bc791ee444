"""The records one step hands from stage to stage (``dispatch/step.py``, ``layout.py``, the
strategy registry) are frozen: a stage may not rewrite what the next one reads (the work items,
the layout, the meta ``combine`` uses, a strategy's flags shared by every layer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe import MoE, MoEConfig
from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.dispatch.step import ExpertOutputs
from mixmoe.dispatch.strategies import STRATEGY_SPECS


def _local_step():
    torch.manual_seed(0)
    layer = MoE(MoEConfig(model_dim=8, hidden_dim=12, num_experts=4), dtype=torch.float64)
    x = torch.randn(7, 8, dtype=torch.float64)
    routing, _, _ = layer.gate(x)
    return layer.dispatcher.dispatch(x, routing, layer.experts.weights())


def _records() -> dict:
    rows, layout, meta = _local_step()
    ids_TK = torch.tensor([[0, 2], [1, 0], [2, 3]])
    return {
        "DispatchedRows": (rows, "local_TD"),
        "ExpertLayout": (layout, "work"),
        "ExpertWork": (layout.work[0], "pos_TK"),
        "LocalStepMeta": (meta, "counts_N"),
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
