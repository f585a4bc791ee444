"""The balanced mixed plan (``plan_mix``: candidates + water-filling with helper ranks) and the
pricing of share entries and of the replica relay (``cost_model.plan_pricing``).

The pricing is checked against a slow twin written here from the definitions (every segment's
runs through ``Plan.segment_runs``, every relay message through ``relay_messages``); the planner's
guarantees are property tests over random skewed counts.
"""

from __future__ import annotations

import collections
import dataclasses
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixmoe.placement import CPU_PROFILE, HardwareProfile, LayerShape, plan_none, plan_shadow
from mixmoe.placement.cost_model import (
    TOKEN_COLLECTIVES,
    WEIGHT_COLLECTIVES,
    plan_loads,
    plan_pricing,
    predict,
    predict_plan,
)
from mixmoe.placement.plan import Plan
from mixmoe.placement.planner import BLOCK_SIZE, plan_mix, replica_slots
from mixmoe.placement.relay import COPY_GRID_BITS, relay_messages

IB = HardwareProfile("ib-like", 593e12, 40e9, 30e-6)  # h100-ib's figures
CHEAP_LINK = HardwareProfile("cheap-link", 1e12, 1e13, 1e-9)  # compute-bound: balance is free
NODES = dataclasses.replace(IB, ranks_per_node=2, inter_node_bandwidth=5e9, inter_node_latency=5e-5)
PROFILES = {"ib": IB, "cpu": CPU_PROFILE, "cheap": CHEAP_LINK, "nodes": NODES}


def _skewed_counts(W: int, E: int, rows: int, seed: int, hot: float) -> torch.Tensor:
    """counts_WN: each rank routes ``rows`` rows, a share ``hot`` of them to one expert picked
    by the seed, the rest uniformly at random (a fresh generator per draw)."""
    gen = torch.Generator().manual_seed(seed)
    N = W * E
    C = torch.zeros(W, N, dtype=torch.int64)
    g_hot = int(torch.randint(0, N, (1,), generator=gen))
    hot_rows = int(rows * hot)
    C[:, g_hot] = hot_rows
    draws = torch.randint(0, N, (W, rows - hot_rows), generator=gen)
    return C.scatter_add_(1, draws, torch.ones_like(draws))


# -- pricing ---------------------------------------------------------------------------------


def _grid(x: Fraction) -> Fraction:
    """x floored to the relay's pricing grid (a multiple of 2**-COPY_GRID_BITS copies)."""
    return Fraction(int(x * 2**COPY_GRID_BITS), 2**COPY_GRID_BITS)


def _slow_loads(C: list[list[int]], plan: Plan, E: int, per_node: int = 0) -> list[list]:
    """(rows, local, remote, replica) per rank from the definitions, one segment run at a time:
    a run of n rows of segment (s, g) at rank r adds n rows at r, local to s when r == s, else
    remote at both; replica = the copies each rank sends + receives in the relay's messages
    (``relay_messages``: a message of chunk j of n carries 1/n copy; per expert and rank, sends
    and receives each floored to the pricing grid) when the plan relays, else the flat fan-out
    (owner: one per holder, holder: one). ``per_node`` > 0: two more rows, the remote rows and
    copies whose two ranks are on different nodes."""
    W = len(C)
    rows, local, remote, replica = [0] * W, [0] * W, [0] * W, [0] * W
    remote_x, replica_x = [0] * W, [0] * W
    node = (lambda r: r // per_node) if per_node else (lambda r: 0)
    for s in range(W):
        for g in range(W * E):
            for r, n in plan.segment_runs(s, g, C[s][g], E):
                rows[r] += n
                if r == s:
                    local[s] += n
                else:
                    remote[s] += n
                    remote[r] += n
                    if node(r) != node(s):
                        remote_x[s] += n
                        remote_x[r] += n
    distance = (lambda a, b: int(node(a) != node(b))) if per_node else None
    for g, holders in plan.replicas:
        if plan.relay:
            msgs = [m for rnd in relay_messages(g // E, holders, distance) for m in rnd]
        else:
            msgs = [(g // E, h, 0, 1) for h in holders]
        # per rank: [sent, received] copies of g, all and across nodes, exact fractions
        ends: dict[int, list[Fraction]] = collections.defaultdict(lambda: [Fraction(0)] * 4)
        for a, b, _, n in msgs:
            ends[a][0] += Fraction(1, n)
            ends[b][1] += Fraction(1, n)
            if node(a) != node(b):
                ends[a][2] += Fraction(1, n)
                ends[b][3] += Fraction(1, n)
        for r, (sent, recv, sent_x, recv_x) in ends.items():
            replica[r] += float(_grid(sent) + _grid(recv))
            replica_x[r] += float(_grid(sent_x) + _grid(recv_x))
    return [rows, local, remote, replica] + ([remote_x, replica_x] if per_node else [])


@st.composite
def _plans(draw):
    """(counts, shape, Plan) with random holders and share entries cut at whole blocks."""
    W = draw(st.integers(2, 5))
    E = draw(st.integers(1, 3))
    N, blk = W * E, 4
    C = [[draw(st.integers(0, 13)) for _ in range(N)] for _ in range(W)]
    replicas = {}
    for g in sorted(draw(st.sets(st.integers(0, N - 1), max_size=3))):
        others = [r for r in range(W) if r != g // E]
        holders = sorted(draw(st.sets(st.sampled_from(others), min_size=1)))
        replicas[g] = tuple(holders)
    shares = []
    for s in range(W):
        for g in replicas:
            if not C[s][g] or not draw(st.booleans()):
                continue
            ranks = draw(st.permutations([g // E, *replicas[g]]))[: draw(st.integers(1, 3))]
            runs, left = [], C[s][g]
            for r in ranks[:-1]:
                n = min(left // blk, draw(st.integers(0, 2))) * blk
                if n:
                    runs.append((r, n))
                    left -= n
            if left:
                runs.append((ranks[-1], left))
            if len({r for r, _ in runs}) == len(runs):
                shares.append((s, g, tuple(runs)))
    hot = tuple(sorted(replicas))
    P = predict(C, (), LayerShape(4, 4, E, W, 2), IB)
    plan = Plan(hot, tuple((g, replicas[g]) for g in hot), P, P, tuple(shares), draw(st.booleans()))
    plan.check_shares(C, E, blk)
    return C, LayerShape(4, 4, E, W, 2), plan


@settings(max_examples=60, deadline=None)
@given(_plans())
def test_plan_pricing_equals_the_slow_twin(case) -> None:
    C, shape, plan = case
    loads_4W, rounds = plan_pricing(torch.tensor(C), plan, shape.experts_per_rank)
    assert loads_4W.tolist() == _slow_loads(C, plan, shape.experts_per_rank)
    if plan.relay and plan.replicas:
        assert rounds == max(
            len(relay_messages(g // shape.experts_per_rank, h)) for g, h in plan.replicas
        )
    else:
        assert rounds == int(bool(plan.replicas))


@settings(max_examples=60, deadline=None)
@given(_plans(), st.integers(1, 3))
def test_plan_pricing_splits_the_links_of_a_topology(case, per_node: int) -> None:
    """With ``ranks_per_node``: two more rows, the inter-node remote rows and relay edges, as
    the slow twin counts them pair by pair; the step prices them at the inter-node link."""
    C, shape, plan = case
    profile = dataclasses.replace(
        IB, ranks_per_node=per_node, inter_node_bandwidth=5e9, inter_node_latency=50e-6
    )
    loads, _ = plan_pricing(torch.tensor(C), plan, shape.experts_per_rank, profile)
    assert loads.tolist() == _slow_loads(C, plan, shape.experts_per_rank, per_node)
    one_link = predict_plan(C, plan, shape, IB, True)
    nodes = predict_plan(C, plan, shape, profile, True)
    assert nodes.step_s >= one_link.step_s  # a slower link between nodes never helps
    if per_node >= shape.world_size:  # one node: the one-link prices, bit for bit
        assert nodes == one_link


@settings(max_examples=40, deadline=None)
@given(_plans(), st.booleans())
def test_a_plan_without_shares_or_relay_prices_as_today(case, overlap: bool) -> None:
    """No share entry and no relay: the same aggregates as ``plan_loads`` and the same
    Prediction, bit for bit, as ``predict`` of its replicas (today's model)."""
    C, shape, plan = case
    plain = dataclasses.replace(plan, shares=(), ranges=(), relay=False)
    C_WN = torch.tensor(C)
    loads_4W, _ = plan_pricing(C_WN, plain, shape.experts_per_rank)
    assert torch.equal(loads_4W, plan_loads(C_WN, plain.replicas, shape.experts_per_rank))
    assert predict_plan(C, plain, shape, IB, overlap) == predict(
        C, plain.replicas, shape, IB, overlap
    )


def test_relay_rounds_pay_their_latency_and_its_copies_their_bytes() -> None:
    """One expert with 3 holders at W = 4: scatter + all-gather, 2 rounds; the owner sends one
    copy in chunks (not 2 or 3), each holder receives one and sends 2/3 (floored to the grid);
    each round is a fetch and a return."""
    shape = LayerShape(8, 8, 1, 4, 2)
    C = [[5, 0, 0, 0], [5, 0, 0, 0], [5, 0, 0, 0], [5, 0, 0, 0]]
    P = predict(C, (), shape, IB)
    plan = Plan((0,), ((0, (1, 2, 3)),), P, P, relay=True)
    loads, rounds = plan_pricing(torch.tensor(C), plan, 1)
    holder = float(1 + _grid(Fraction(2, 3)))
    assert rounds == 2 and loads[3].tolist() == [1.0, holder, holder, holder]
    assert abs(holder - 5 / 3) < 2**-23
    pred = predict_plan(C, plan, shape, IB, False)
    weight = (
        WEIGHT_COLLECTIVES * 2 * IB.link_latency
        + shape.params_bytes_per_expert * 1 / IB.link_bandwidth
    )
    compute = 5 * shape.flops_per_row / IB.gemm_flops
    assert pred.comm_s[0] == pytest.approx(weight, rel=1e-12)
    assert pred.compute_s[1] == pytest.approx(compute, rel=1e-12)
    assert TOKEN_COLLECTIVES == 4  # no remote row left: the token phase is skipped
    assert pred.token_bytes == (0, 0, 0, 0)
    assert pred.weight_bytes == tuple(
        round(2 * shape.params_bytes_per_expert * x) for x in loads[3].tolist()
    )


# -- plan_mix's guarantees -------------------------------------------------------------------


@st.composite
def _cases(draw):
    W = draw(st.integers(2, 8))
    E = draw(st.integers(1, 4))
    rows = draw(st.sampled_from([64, 300, 2000]))
    hot = draw(st.sampled_from([0.0, 0.3, 0.8]))
    seed = draw(st.integers(0, 10**6))
    profile = draw(st.sampled_from(sorted(PROFILES)))
    max_replicas = draw(st.sampled_from([0, 1, 4]))
    return W, E, rows, hot, seed, profile, max_replicas


def _held(plan: Plan, W: int) -> list[int]:
    held = [0] * W
    for _, holders in plan.replicas:
        for h in holders:
            held[h] += 1
    return held


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_plan_mix_guarantees(case) -> None:
    """Deterministic, valid shares, replica budget, never predicted worse than a2a, nor than
    shadow where shadow's plan fits the budget (``max_replicas`` 0: none does), and its
    prediction is the cost model's price of the plan it returns."""
    W, E, rows, hot, seed, name, max_replicas = case
    profile = PROFILES[name]
    shape = LayerShape(64, 128, E, W, 2)
    C_WN = _skewed_counts(W, E, rows, seed, hot)
    plan = plan_mix(C_WN, shape, profile, max_replicas)
    assert plan_mix(C_WN.clone(), shape, profile, max_replicas) == plan
    assert plan_mix(C_WN.tolist(), shape, profile, max_replicas) == plan
    plan.check_shares(C_WN.tolist(), E, BLOCK_SIZE)
    assert max(_held(plan, W)) <= replica_slots(max_replicas, E)
    step = plan.prediction.step_s
    assert step <= plan_none(C_WN, shape, profile).prediction.step_s
    shadow = plan_shadow(C_WN, shape, profile)
    if len(shadow.hot) <= replica_slots(max_replicas, E):  # shadow's plan fits the budget
        assert step <= shadow.prediction.step_s
    assert step <= plan.baseline.step_s
    assert predict_plan(C_WN, plan, shape, profile, True) == plan.prediction
    if max_replicas == 0:
        assert plan.hot == () and plan.shares == ()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(2, 8), st.integers(1, 4), st.sampled_from([0.3, 0.6, 0.9]), st.integers(0, 10**6)
)
def test_plan_mix_balances_where_links_are_cheap(W: int, E: int, hot: float, seed: int) -> None:
    """Compute-bound (links nearly free) with a budget of E replicas per rank and segments of
    many blocks: the rank imbalance after the plan (max / mean rows computed) is <= 1.10."""
    shape = LayerShape(64, 128, E, W, 2)
    C_WN = _skewed_counts(W, E, 8192, seed, hot)
    plan = plan_mix(C_WN, shape, CHEAP_LINK, 4)
    rows = plan.prediction.rows
    assert max(rows) <= 1.10 * sum(rows) / W, (rows, plan.baseline.rows)


def test_plan_mix_moves_the_owners_own_rows_to_helpers() -> None:
    """A hot rank at W = 4 on cheap links: rank 0 routes 8192 rows to its own expert 0, the
    others a few to theirs. Balance needs helpers to compute the owner's own rows: segment
    (0, 0) is cut into whole-block runs at ranks 1-3, holders of expert 0's replica (relayed)."""
    W, E = 4, 1
    shape = LayerShape(64, 128, E, W, 2)
    C = [[8192, 0, 0, 0], [0, 64, 0, 0], [0, 0, 64, 0], [0, 0, 0, 64]]
    plan = plan_mix(C, shape, CHEAP_LINK, 4)
    assert plan.relay and plan.hot == (0,) and plan.replicas == ((0, (1, 2, 3)),)
    assert max(plan.prediction.rows) <= 1.10 * sum(plan.prediction.rows) / W
    plan.check_shares(C, E, BLOCK_SIZE)
    (s, g, runs), *_ = plan.expanded(C, E).shares
    assert (s, g) == (0, 0) and {r for r, _ in runs} == {0, 1, 2, 3}
    assert all(n % BLOCK_SIZE == 0 for _, n in runs)


def test_plan_mix_is_the_same_in_threads() -> None:
    """Every rank plans alone (a worker thread each in the layer): the same plan in 8 threads."""
    from concurrent.futures import ThreadPoolExecutor

    shape = LayerShape(64, 128, 2, 8, 2)
    C_WN = _skewed_counts(8, 2, 2000, 11, 0.5)
    ref = plan_mix(C_WN, shape, IB, 4)
    with ThreadPoolExecutor(4) as pool:
        plans = list(pool.map(lambda _: plan_mix(C_WN, shape, IB, 4), range(8)))
    assert all(p == ref for p in plans)


def test_replica_slots_rule() -> None:
    assert replica_slots(0, 32) == 0  # replication off
    assert replica_slots(4, 1) == 8 and replica_slots(4, 32) == 32 and replica_slots(12, 4) == 12


def test_plan_mix_rejects_bad_arguments() -> None:
    shape = LayerShape(8, 8, 1, 2, 2)
    with pytest.raises(ValueError, match="block_size"):
        plan_mix([[1, 1], [1, 1]], shape, IB, 4, block_size=0)
    with pytest.raises(TypeError, match="max_replicas"):
        plan_mix([[1, 1], [1, 1]], shape, IB, 4.0)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 8),
    st.integers(1, 4),
    st.sampled_from([300, 2000]),
    st.sampled_from([0.3, 0.8]),
    st.integers(0, 10**6),
    st.sampled_from(["ib", "cheap", "cpu"]),
)
def test_water_fill_bookkeeping_is_the_priced_plan(W, E, rows, hot, seed, name) -> None:
    """The search's own per-rank loads and totals after every move equal the cost model's
    pricing of the plan it would emit then (shares, relay edges and rounds): the moves are
    judged on the numbers the plan is priced with."""
    from mixmoe.placement.balance import WaterFill
    from mixmoe.placement.cost_model import step_model
    from mixmoe.placement.counts import counts_with_sums

    profile = PROFILES[name]
    shape = LayerShape(64, 128, E, W, 2)
    C_WN, colsum_N, _ = counts_with_sums(_skewed_counts(W, E, rows, seed, hot), shape)
    model = step_model(shape, profile, True)
    P = predict(C_WN, (), shape, profile)
    loads, _ = plan_pricing(C_WN, Plan((), (), P, P, relay=True), E)
    fill = WaterFill(model, C_WN, E, {}, 8, BLOCK_SIZE, None, colsum_N, bool(loads[2].any()))
    fill.set_loads(loads.to(torch.int64).tolist())
    for _ in range(12):
        if not fill.step():
            break
        hot_g = tuple(sorted(g for g, h in fill.holders.items() if h))
        plan = Plan(hot_g, tuple((g, tuple(fill.holders[g])) for g in hot_g), P, P,
                    fill.shares(), relay=True)  # fmt: skip
        plan.check_shares(C_WN.tolist(), E, BLOCK_SIZE)
        priced, rounds = plan_pricing(C_WN, plan, E)
        assert priced.tolist() == [fill.rows, fill.local, fill.remote, fill.replica]
        assert rounds == fill.rounds
        pred = model.prediction_W(priced, rounds)
        assert list(map(float.__add__, pred.compute_s, pred.comm_s)) == fill.totals
