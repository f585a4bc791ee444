"""The step bookkeeping of plans with share entries (``dispatch/step_shares.py`` through
``build_step_plan``) against a loop twin written from the plan's definition: every segment's
rows at each rank (``Plan.segment_runs``), summed the obvious way. ``build_step_plan`` runs
compiled (``step_native``); the Python (``step_plan_python``, both its runs paths) must give
the same StepPlan."""

from __future__ import annotations

import random

import pytest
import torch

import mixmoe.dispatch.step_shares as step_shares
import mixmoe.placement.ranges as ranges_module
from mixmoe.dispatch.step_plan import build_step_plan, step_plan_python
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import plan_none
from mixmoe.placement.profile import HardwareProfile

PROFILE = HardwareProfile("test", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9)
B = 4


def random_share_plan(C: list[list[int]], E: int, rng: random.Random, base: Plan) -> Plan:
    """Random holders; most segments cut into whole-block runs at random allowed ranks."""
    W = len(C)
    N = W * E
    holders = {}
    for g in range(N):
        others = [h for h in range(W) if h != g // E]
        if others and rng.random() < 0.6:
            holders[g] = tuple(sorted(rng.sample(others, rng.randint(1, len(others)))))
    shares = []
    for s in range(W):
        for g in range(N):
            if not C[s][g] or rng.random() < 0.3:
                continue
            allowed = [g // E, *holders.get(g, ())]
            ranks = rng.sample(allowed, rng.randint(1, len(allowed)))
            runs, left = [], C[s][g]
            for c in ranks[:-1]:
                m = B * rng.randint(0, (left - 1) // B)
                if m:
                    runs.append((c, m))
                    left -= m
            runs.append((ranks[-1], left))
            shares.append((s, g, tuple(runs)))
    hot = tuple(sorted(holders))
    return Plan(
        hot, tuple((g, holders[g]) for g in hot), base.prediction, base.baseline, tuple(shares)
    )


def _key(r: int, c: int, g: int, E: int, W: int, rep: tuple) -> int:
    """A run's group key: sent to c (by c, then g) | own slot | replica slot."""
    if c != r:
        return E + len(rep) + c * W * E + g
    return g - r * E if g // E == r else E + rep.index(g)


def loop_twin(C: list[list[int]], plan: Plan, r: int, E: int) -> dict:
    W = len(C)
    N = W * E
    at = [[dict(plan.segment_runs(s, g, C[s][g], E)) for g in range(N)] for s in range(W)]
    rep = plan.replica_slots(r)
    cols = sorted([*range(r * E, (r + 1) * E), *rep])
    recv = [at[s][g].get(r, 0) if s != r else 0 for s in range(W) for g in cols]

    def at_runs(g: int):  # this rank's runs of its segment of g, in row order
        return plan.segment_runs(r, g, C[r][g], E)

    return {
        "in_splits": [sum(at[r][g].get(c, 0) for g in range(N)) if c != r else 0 for c in range(W)],
        "out_splits": [
            sum(at[s][g].get(r, 0) for g in range(N)) if s != r else 0 for s in range(W)
        ],
        "recv_counts": recv,
        "recv_slots": [g - r * E if g // E == r else rep.index(g) for g in cols] * W,
        "recv_replica": [g // E != r for g in cols] * W,
        "rows_moved": sum(
            n for s in range(W) for g in range(N) for c, n in at[s][g].items() if c != s
        ),
        "own_c": [at[r][r * E + e].get(r, 0) for e in range(E)],
        "rep_c": [at[r][g].get(r, 0) for g in rep],
        # this rank's runs in row order (expert ascending, then the segment's runs), each with
        # its group key: own slot e | replica slot h | sent to c, by c then g
        "runs": [(n, _key(r, c, g, E, W, rep)) for g in range(N) for c, n in at_runs(g)],
    }


@pytest.fixture(params=["by_expert", "by_key"])
def runs_path(request, monkeypatch):
    """Both ways of building a rank's runs (``step_shares._runs_by_expert`` up to
    ``LIST_RUNS_N`` experts, ``_runs_by_key`` above) and of ``range_rows_moved`` (lists up to
    ``LIST_MOVED_W`` ranks, tensor ops above), forced at these small sizes."""
    if request.param == "by_key":
        monkeypatch.setattr(step_shares, "LIST_RUNS_N", 0)
        monkeypatch.setattr(ranges_module, "LIST_MOVED_W", 0)
    return request.param


@pytest.mark.parametrize("W,E", [(2, 1), (2, 3), (3, 2), (4, 2), (5, 1)])
@pytest.mark.parametrize("seed", range(5))
def test_share_bookkeeping_equals_the_loop_twin(W, E, seed, runs_path):
    rng = random.Random(100 * seed + 10 * W + E)
    gen = torch.Generator().manual_seed(seed)
    N = W * E
    C_WN = (torch.rand(W, N, generator=gen) ** 2 * 40).to(torch.int64)
    C_WN[torch.rand(W, N, generator=gen) < 0.2] = 0
    C = C_WN.tolist()
    plan = random_share_plan(C, E, rng, plan_none(C_WN, LayerShape(8, 16, E, W, 4), PROFILE))
    plan.check_shares(C, E, B)
    for r in range(W):
        step = build_step_plan(C_WN, plan, r, E)
        assert step_plan_python(C_WN, plan, r, E) == step
        want = loop_twin(C, plan, r, E)
        runs = step.runs
        got = {
            "in_splits": step.in_splits,
            "out_splits": step.out_splits,
            "recv_counts": step.recv_counts,
            "recv_slots": step.recv_slots,
            "recv_replica": step.recv_replica,
            "rows_moved": step.rows_moved,
            "own_c": runs.own_c,
            "rep_c": runs.rep_c,
            "runs": list(zip(runs.run_len, runs.run_key, strict=True)),
        }
        assert got == want, (r, plan)
        # the runs cover this rank's kept rows, in by-expert order; keys put each in its group
        assert sum(runs.run_len) == sum(C[r]) and min(runs.run_len, default=1) > 0
        H = len(step.rep_experts)
        assert runs.n_send == sum(step.in_splits)
        by_key: dict[int, int] = {}
        for n, key in zip(runs.run_len, runs.run_key, strict=True):
            by_key[key] = by_key.get(key, 0) + n
        for key, n in by_key.items():  # own slot e | replica slot h | sent to c for expert g
            if key < E:
                assert n == want["own_c"][key]
            elif key < E + H:
                assert n == want["rep_c"][key - E]
            else:
                c, g = divmod(key - E - H, N)
                assert c != r and n == dict(plan.segment_runs(r, g, C[r][g], E))[c]
        assert runs.owned_rows_stay == (sum(want["own_c"]) == sum(C[r][r * E : (r + 1) * E]))
        assert step.owned_rows_stay() == runs.owned_rows_stay


def test_plan_without_shares_keeps_the_fast_path():
    C_WN = torch.tensor([[5, 0], [3, 9]])
    step = build_step_plan(C_WN, plan_none(C_WN, LayerShape(8, 16, 1, 2, 4), PROFILE), 0, 1)
    assert step.runs is None and step.recv_replica == [] and step.owned_rows_stay()


@pytest.mark.parametrize("seed", range(12))
def test_ranges_plan_bookkeeping_equals_its_full_expansion(seed: int, runs_path) -> None:
    """A plan with row ranges and kept holders (each rank expanding only the entries it reads,
    its rows moved in closed form) gives every rank the same ``StepPlan`` as the plan with
    every range and kept holder expanded into share entries (the share path, no ranges
    code)."""
    from mixmoe.placement.ranges import cut_ranges, range_shares, stream_sources

    rng = random.Random(seed)
    W, E = rng.randint(2, 6), rng.randint(1, 3)
    N = W * E
    gen = torch.Generator().manual_seed(seed)
    C_WN = torch.randint(0, 3 * B * 4, (W, N), generator=gen)
    C_WN[torch.rand(W, N, generator=gen) < 0.3] = 0
    replicas, ranges, kept = [], [], []
    for g in sorted(rng.sample(range(N), rng.randint(1, N))):
        o = g // E
        others = [r for r in range(W) if r != o]
        holders = tuple(sorted(rng.sample(others, rng.randint(1, len(others)))))
        replicas.append((g, holders))
        col = C_WN[:, g].tolist()
        # some holders keep only their first whole blocks local (the rest joins the stream)
        keep = {
            y: rng.randint(0, (col[y] - 1) // B) * B
            for y in holders
            if col[y] and rng.random() < 0.4
        }
        if keep:
            kept.append((g, tuple(sorted(keep.items()))))
        total = sum(col[s] - keep.get(s, 0) for s in stream_sources(col, o, holders, keep))
        free = [y for y in holders if y not in keep]  # a kept holder takes no range here
        helpers = rng.sample(free, rng.randint(0, len(free)))
        cut = cut_ranges(
            col, o, holders, [(y, rng.randint(1, total + 1)) for y in helpers], B, keep
        )
        if cut:
            ranges.append((g, cut))
    base = plan_none(C_WN, LayerShape(8, 16, E, W, 2), PROFILE)
    hot = tuple(g for g, _ in replicas)
    plan = Plan(hot, tuple(replicas), base.prediction, base.baseline, relay=True,
                ranges=tuple(ranges), kept=tuple(kept))  # fmt: skip
    plan.check_shares(C_WN, E, B)
    full = plan.expanded(C_WN, E)
    assert not full.ranges and not full.kept
    for r in range(W):
        mine = range_shares(C_WN, plan, E, r)
        assert set(mine) <= set(full.shares)  # a subset of the entries, the same runs
        step = build_step_plan(C_WN, plan, r, E)
        assert step == build_step_plan(C_WN, full, r, E) == step_plan_python(C_WN, plan, r, E), r
