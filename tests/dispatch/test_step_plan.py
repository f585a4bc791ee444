"""The expert-parallel step bookkeeping (``dispatch/step_plan.py``, vectorised over ranks and
experts) against a per-segment loop twin written from the plan's definition: segment (s, g) is
computed at s if s owns g or holds a replica of g, else at the owner g // E. ``build_step_plan``
runs compiled (``step_native``); the Python (``step_plan_python``) must give the same StepPlan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe.dispatch.step_plan import build_step_plan, step_plan_python
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.planner import plan_none, plan_shadow
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.replica_search import plan_replicas

# replication pays at once: slow GEMMs, a fast link
REPLICATE = HardwareProfile("test", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9)


def loop_twin(C: list[list[int]], plan, r: int, E: int) -> dict:
    W = len(C)
    N = W * E
    rep = set(plan.replica_slots(r))
    send = tuple(g for g in range(N) if g // E != r and g not in rep)
    in_splits = [0] * W
    for g in send:
        in_splits[g // E] += C[r][g]
    recv_counts, out_splits = [], [0] * W
    for s in range(W):
        for e in range(E):
            g = r * E + e
            n = C[s][g] if plan.computed_at(s, g, E) == r and s != r else 0
            recv_counts.append(n)
            out_splits[s] += n
    moved = sum(C[s][g] for s in range(W) for g in range(N) if plan.computed_at(s, g, E) != s)
    return {
        "own_experts": tuple(g for g in range(N) if g // E == r),
        "send_experts": send,
        "in_splits": in_splits,
        "out_splits": out_splits,
        "recv_counts": recv_counts,
        "recv_slots": list(range(E)) * W,
        "rows_moved": moved,
    }


@pytest.mark.parametrize("W,E", [(1, 3), (2, 2), (3, 4), (5, 1)])
@pytest.mark.parametrize("planner", ["none", "mix", "shadow"])
@pytest.mark.parametrize("seed", range(4))
def test_step_plan_equals_the_loop_twin(W, E, planner, seed):
    gen = torch.Generator().manual_seed(seed)
    N = W * E
    # skewed counts with zeros: some experts hot, some empty, some ranks sending nothing
    C_WN = (torch.rand(W, N, generator=gen) ** 3 * 200).to(torch.int64)
    C_WN[torch.rand(W, N, generator=gen) < 0.2] = 0
    shape = LayerShape(8, 16, E, W, 4)
    plan = {
        "none": lambda: plan_none(C_WN, shape, REPLICATE),
        "mix": lambda: plan_replicas(C_WN, shape, REPLICATE, max_replicas=3),
        "shadow": lambda: plan_shadow(C_WN, shape, REPLICATE),
    }[planner]()
    C = C_WN.tolist()
    for r in range(W):
        step = build_step_plan(C_WN, plan, r, E)
        assert step_plan_python(C_WN, plan, r, E) == step
        want = loop_twin(C, plan, r, E)
        got = {k: getattr(step, k) for k in want}
        assert got == want, f"rank {r}: {got} != {want}"
        assert step.rep_experts == plan.replica_slots(r)


@pytest.mark.parametrize("W,E", [(2, 2), (4, 2)])
def test_step_plan_with_a_replicated_hot_expert(W, E):
    """Every rank sends most of its rows to expert 0: the source-replica search replicates it
    (``plan_replicas``: no share entries, the twin's replica rule), and the bookkeeping keeps
    those rows at their sources."""
    gen = torch.Generator().manual_seed(1)
    C_WN = torch.randint(1, 5, (W, W * E), generator=gen)
    C_WN[:, 0] = 500
    shape = LayerShape(8, 16, E, W, 4)
    plan = plan_replicas(C_WN, shape, REPLICATE, max_replicas=4)
    assert plan.hot and plan.hot[0] == 0, plan
    for r in range(W):
        step = build_step_plan(C_WN, plan, r, E)
        want = loop_twin(C_WN.tolist(), plan, r, E)
        assert {k: getattr(step, k) for k in want} == want


def test_step_plan_is_frozen():
    """One step's bookkeeping is read by the layout, the fetch and combine: never rewritten."""
    C_WN = torch.tensor([[3, 1], [0, 2]])
    step = build_step_plan(C_WN, plan_none(C_WN, LayerShape(8, 16, 1, 2, 4), REPLICATE), 0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.rows_moved = 0
