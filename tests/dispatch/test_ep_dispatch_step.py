"""What one expert-parallel ``dispatch`` hands the experts, over a world of one
(``LocalCommunicator``), where every strategy's numbers equal the single-device layer's whatever
the hand-off: the own rows computed during an async plan are handed over once (and not queued again
as work), through the caller's ``compute_own`` when given; nothing moves, so no token all_to_all
runs; the step's stats are exact."""

from __future__ import annotations

import pytest
import torch

from mixmoe import MoE, MoEConfig
from mixmoe.comm import LocalCommunicator
from mixmoe.dispatch.expert_parallel import ExpertParallelDispatcher
from mixmoe.dispatch.step import run_work
from mixmoe.parallel import parallelize_moe

T, K = 13, 2


def _layer(strategy: str, plan_async: bool | None = None, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, top_k=K, plan_async=plan_async)
    return parallelize_moe(MoE(cfg, dtype=torch.float64), LocalCommunicator(), strategy)


def _x() -> torch.Tensor:
    return torch.randn(T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def _own_items(layout) -> list:
    return [w for w in layout.work if (w.source, w.weights) == ("local", "owned")]


@pytest.mark.parametrize("plan_async", [True, False])
def test_own_rows_are_computed_once_by_the_dispatcher_or_by_the_experts(plan_async) -> None:
    layer = _layer("mix", plan_async)
    x = _x()
    routing, _, _ = layer.gate(x)
    rows, layout, _ = layer.dispatcher.dispatch(x, routing, layer.experts.weights())
    layer.dispatcher.close()
    if plan_async:  # computed while the plan ran: handed over, not queued again
        assert rows.local_done_TD is not None and _own_items(layout) == []
        want = run_work(_own_items_of_sync(x), x, layer.experts.weights(), "gelu")
        torch.testing.assert_close(rows.local_done_TD, want, rtol=0, atol=0)
    else:
        assert rows.local_done_TD is None and len(_own_items(layout)) == 1
        assert layout.work[0] is _own_items(layout)[0]  # local work first


def _own_items_of_sync(x: torch.Tensor):
    """The own work item of the same step planned on the caller (plan_async=False)."""
    layer = _layer("mix", False)
    routing, _, _ = layer.gate(x)
    _, layout, _ = layer.dispatcher.dispatch(x, routing, layer.experts.weights())
    return _own_items(layout)[0]


def test_the_callers_compute_own_output_is_handed_over() -> None:
    layer = _layer("mix", True)
    calls = []

    def compute_own(work, x_TD, weights):
        calls.append(work)
        return run_work(work, x_TD, weights, "gelu") * 3.0  # marked: only this call makes it

    cfg = layer.config
    dispatcher = ExpertParallelDispatcher(LocalCommunicator(), cfg, "mix", compute_own=compute_own)
    x = _x()
    routing, _, _ = layer.gate(x)
    weights = layer.experts.weights()
    rows, layout, _ = dispatcher.dispatch(x, routing, weights)
    dispatcher.close()
    assert len(calls) == 1 and _own_items(layout) == []
    torch.testing.assert_close(
        rows.local_done_TD, 3.0 * run_work(calls[0], x, weights, "gelu"), rtol=0, atol=0
    )


@pytest.mark.parametrize("strategy", ["a2a", "shadow", "mix"])
def test_nothing_moves_so_no_all_to_all_runs_and_the_stats_are_exact(strategy) -> None:
    layer = _layer(strategy, True)
    comm = layer.dispatcher.comm
    calls = []
    real = comm.all_to_all
    comm.all_to_all = lambda *args, **kwargs: calls.append(args[2:4]) or real(*args, **kwargs)
    x = _x().requires_grad_(True)
    y, aux = layer(x)
    y.sum().backward()
    layer.dispatcher.close()
    assert calls == []  # neither the token exchange, its return, nor their backward
    # mix plans on its thread (plan_async): it waited for it, if at all, >= 0
    assert aux.plan_wait_ms >= 0.0 if strategy == "mix" else aux.plan_wait_ms == 0.0
    assert aux.stats == {
        "rows_moved": 0,
        "replicas": 0,
        "max_rows": T * K,  # every routed row computed on the one rank
        "mean_rows": T * K / 1,
        "replica_cached": False,
        "plan_fitted": False,  # planned from this step's counts (no plan_ahead)
        "shares": 0,  # no share entry: nothing computed away from its rows' owner or source
    }
