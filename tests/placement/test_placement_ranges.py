"""Row ranges (``mixmoe.placement.ranges``), the compact form of a balanced plan's helper rows.

Each function is checked against a twin written from the module doc's definitions, sharing no
code: the stream as an explicit list of rows (``_stream_rows``) for the expansion into share
entries, every allowed cut position enumerated for the rounding, and the share loop of
``plan_pricing`` for the closed-form loads. Plus the ``Plan`` rules for ranges and the errors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixmoe.placement.ranges as ranges_module
from mixmoe.placement.cost_model import Prediction, plan_pricing
from mixmoe.placement.plan import Plan
from mixmoe.placement.ranges import cut_ranges, cut_ranges_many, range_shares, stream_sources

P = Prediction((), (), (), (), (), 0.0)


@st.composite
def _ranged(draw, blocks: bool):
    """(C_WN, E, plan with ranges, block): random counts (zeros included), a few hot experts
    with random holders and random amounts per helper (cut at whole blocks when ``blocks``)."""
    W = draw(st.integers(2, 7))
    E = draw(st.integers(1, 3))
    N = W * E
    seed = draw(st.integers(0, 10**6))
    gen = torch.Generator().manual_seed(seed)
    C = torch.randint(0, 150, (W, N), generator=gen)
    C[torch.rand(W, N, generator=gen) < 0.3] = 0
    blk = draw(st.sampled_from([1, 4, 16]))
    hot = sorted(draw(st.sets(st.integers(0, N - 1), min_size=1, max_size=3)))
    replicas, ranges = [], []
    for g in hot:
        o = g // E
        others = [r for r in range(W) if r != o]
        holders = sorted(draw(st.sets(st.sampled_from(others), min_size=1, max_size=len(others))))
        replicas.append((g, tuple(holders)))
        col = C[:, g].tolist()
        total = sum(col[s] for s in stream_sources(col, o, holders))
        helpers = draw(st.permutations(holders))[: draw(st.integers(1, len(holders)))]
        amounts = [(y, draw(st.integers(1, max(1, total)))) for y in helpers]
        if blocks:
            cut = cut_ranges(col, o, holders, amounts, blk)
        else:  # any amounts that fit in the stream, in helper order
            cut, left = [], total
            for y, n in amounts:
                n = min(n, left)
                if n:
                    cut.append((y, n))
                left -= n
            cut = tuple(cut)
        if cut:
            ranges.append((g, cut))
    plan = Plan(tuple(hot), tuple(replicas), P, P, relay=draw(st.booleans()), ranges=tuple(ranges))
    return C, E, plan, blk


def _stream_rows(col_W: list[int], owner: int, holders) -> list[int]:
    """The stream of one expert as one source id per row, in order (the module doc)."""
    rows = []
    for s in range(len(col_W)):
        if s != owner and s not in holders:
            rows += [s] * col_W[s]
    return rows + [owner] * col_W[owner]


def _shares_twin(C_WN: torch.Tensor, plan: Plan, E: int) -> list:
    """Share entries from the stream row by row: each row's rank, runs merged per segment."""
    out = []
    for g, ranges in plan.ranges:
        o = g // E
        col = C_WN[:, g].tolist()
        rows = _stream_rows(col, o, plan.holders(g))
        at = []
        for y, n in ranges:
            at += [y] * n
        at += [o] * (len(rows) - len(at))
        by_source: dict[int, list[list[int]]] = {}
        for s, r in zip(rows, at, strict=True):
            runs = by_source.setdefault(s, [])
            if runs and runs[-1][0] == r:
                runs[-1][1] += 1
            else:
                runs.append([r, 1])
        for s, runs in by_source.items():
            if runs != [[o, col[s]]]:  # whole at the owner: the replica rule, no entry
                out.append((s, g, tuple((r, n) for r, n in runs)))
    return sorted(out)


@settings(max_examples=60, deadline=None)
@given(_ranged(blocks=False))
def test_range_shares_equal_the_stream_row_by_row(case) -> None:
    C, E, plan, _ = case
    assert range_shares(C, plan, E) == _shares_twin(C, plan, E)


@settings(max_examples=60, deadline=None)
@given(_ranged(blocks=False))
def test_closed_form_loads_equal_the_expanded_share_loop(case) -> None:
    """``range_loads`` (closed form, one link) equals the share loop of the expanded plan."""
    C, E, plan, _ = case
    expanded = plan.expanded(C, E)
    assert not expanded.ranges
    want, rounds = plan_pricing(C, expanded, E)
    got, got_rounds = plan_pricing(C, plan, E)
    assert torch.equal(got, want) and got_rounds == rounds


def _allowed(col_W: list[int], owner: int, holders, blk: int) -> list[int]:
    """Every stream position a cut may sit at: a segment's start or end, or whole blocks in."""
    out, at = {0}, 0
    for s in stream_sources(col_W, owner, holders):
        out.update(range(at, at + col_W[s], blk))
        at += col_W[s]
        out.add(at)
    return sorted(out)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=2, max_size=8),
    st.sampled_from([1, 16, 64]),
    st.data(),
)
def test_cut_ranges_moves_each_cut_to_the_nearest_allowed_position(col, blk, data) -> None:
    W = len(col)
    owner = data.draw(st.integers(0, W - 1))
    holders = data.draw(st.sets(st.sampled_from([r for r in range(W) if r != owner])))
    helpers = data.draw(st.permutations(sorted(holders)))
    amounts = [(y, data.draw(st.integers(1, 400))) for y in helpers]
    got = cut_ranges(col, owner, holders, amounts, blk)
    allowed = _allowed(col, owner, holders, blk)
    # twin: each cumulative cut capped at the stream's end, to the nearest allowed position
    # (ties: the lower), never below the previous cut; zero ranges dropped
    want, at, total = [], 0, 0
    for y, n in amounts:
        total += n
        q = min(total, allowed[-1])
        q = min(allowed, key=lambda p: (abs(p - q), p))
        q = max(q, at)
        if q > at:
            want.append((y, q - at))
        at = q
    assert got == tuple(want)
    assert sum(n for _, n in got) <= allowed[-1]


@settings(max_examples=40, deadline=None)
@given(_ranged(blocks=True))
def test_cut_ranges_pass_check_shares_expanded_or_not(case) -> None:
    C, E, plan, blk = case
    plan.check_shares(C, E, blk)
    plan.expanded(C, E).check_shares(C, E, blk)


def _plan(**kw) -> Plan:
    fields = {"hot": (0,), "replicas": ((0, (1, 2)),), "prediction": P, "baseline": P}
    return Plan(**{**fields, **kw})


def test_plan_rules_for_ranges() -> None:
    with pytest.raises(ValueError, match="strictly ascending by expert"):
        _plan(hot=(0, 1), replicas=((0, (1,)), (1, (0,))), ranges=((1, ((0, 4),)), (0, ((1, 4),))))
    with pytest.raises(ValueError, match="distinct ranks with rows > 0"):
        _plan(ranges=((0, ((1, 4), (1, 4))),))
    with pytest.raises(ValueError, match="distinct ranks with rows > 0"):
        _plan(ranges=((0, ((1, 0),)),))
    with pytest.raises(ValueError, match=r"both ranges and share entries"):
        _plan(ranges=((0, ((1, 4),)),), shares=((1, 0, ((2, 4),)),))
    plan = _plan(ranges=((0, ((1, 4),)),))
    with pytest.raises(ValueError, match="must be expanded"):
        plan.segment_runs(2, 0, 5, 1)


def test_check_ranges_errors() -> None:
    # W = 3, E = 1: expert 0 owned by rank 0, stream = rank 2's 40 rows then rank 0's 20
    C = [[20, 0, 0], [8, 0, 0], [40, 0, 0]]
    holders = ((0, (1,)),)
    with pytest.raises(ValueError, match=r"ranks \[2\] that hold no replica"):
        _plan(replicas=holders, ranges=((0, ((2, 16),)),)).check_shares(C, 1, 16)
    with pytest.raises(ValueError, match="more than its stream's 60"):
        _plan(replicas=holders, ranges=((0, ((1, 61),)),)).check_shares(C, 1, 16)
    with pytest.raises(ValueError, match="cut source 2's segment 20 rows in"):
        _plan(replicas=holders, ranges=((0, ((1, 20),)),)).check_shares(C, 1, 16)
    ok = _plan(replicas=holders, ranges=((0, ((1, 48),)),))  # 40 of rank 2, 1 block of rank 0
    ok.check_shares(C, 1, 8)
    assert ok.expanded(C, 1).shares == ((0, 0, ((1, 8), (0, 12))), (2, 0, ((1, 40),)))


@settings(max_examples=40, deadline=None)
@given(_ranged(blocks=False), st.sampled_from([1, 16, 64]), st.sampled_from([0, 64]))
def test_cut_ranges_many_equals_one_at_a_time(case, blk, list_w) -> None:
    """The batched cuts (one gather, one cumulative sum; ``LIST_CUT_W`` = 0 forces them at
    these small W) equal ``cut_ranges`` expert by expert."""
    C, E, plan, _ = case
    items = [(g, plan.holders(g), ranges) for g, ranges in plan.ranges]
    want = [cut_ranges(C[:, g].tolist(), g // E, h, a, blk) for g, h, a in items]
    saved = ranges_module.LIST_CUT_W
    ranges_module.LIST_CUT_W = list_w
    try:
        assert cut_ranges_many(C, items, E, blk) == want
    finally:
        ranges_module.LIST_CUT_W = saved


def test_a_range_ending_where_a_segment_starts() -> None:
    """Expert 0 (owner 0, holders 1 and 3): stream = rank 2's 40 rows, then rank 0's 20. The
    first range ends exactly at the owner's segment: that segment starts in the second range."""
    C = torch.tensor([[20, 0, 0, 0], [8, 0, 0, 0], [40, 0, 0, 0], [4, 0, 0, 0]])
    plan = _plan(replicas=((0, (1, 3)),), ranges=((0, ((1, 40), (3, 8))),))
    plan.check_shares(C, 1, 8)
    want = ((0, 0, ((3, 8), (0, 12))), (2, 0, ((1, 40),)))
    assert plan.expanded(C, 1).shares == want
    for rank in range(4):  # each rank's entries: its own segment, and all of an expert it holds
        mine = plan.expanded(C, 1, rank).shares
        assert mine == tuple(e for e in want if e[0] == rank or rank in (0, 1, 3))
