"""Row ranges (``mixmoe.placement.ranges``), the compact form of a balanced plan's helper rows.

Each function is checked against a twin written from the module doc's definitions, sharing no
code: the stream as an explicit list of rows (``_stream_rows``, kept holders' rests included) for
the expansion into share entries, every allowed cut position enumerated for the rounding, and the
share loop of ``plan_pricing`` for the closed-form loads. Plus the ``Plan`` rules for ranges and
kept holders, and the errors.
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
    with random holders, some of them kept (random local rows, whole blocks when ``blocks``),
    and random amounts per helper (cut at whole blocks when ``blocks``)."""
    W = draw(st.integers(2, 7))
    E = draw(st.integers(1, 3))
    N = W * E
    seed = draw(st.integers(0, 10**6))
    gen = torch.Generator().manual_seed(seed)
    C = torch.randint(0, 150, (W, N), generator=gen)
    C[torch.rand(W, N, generator=gen) < 0.3] = 0
    blk = draw(st.sampled_from([1, 4, 16]))
    hot = sorted(draw(st.sets(st.integers(0, N - 1), min_size=1, max_size=3)))
    replicas, ranges, kept = [], [], []
    for g in hot:
        o = g // E
        others = [r for r in range(W) if r != o]
        holders = sorted(draw(st.sets(st.sampled_from(others), min_size=1, max_size=len(others))))
        replicas.append((g, tuple(holders)))
        col = C[:, g].tolist()
        keep = {}
        for y in holders:  # some holders with rows keep only their first rows local
            if col[y] and draw(st.booleans()):
                step = blk if blocks else 1
                keep[y] = draw(st.integers(0, (col[y] - 1) // step)) * step
        if keep:
            kept.append((g, tuple(sorted(keep.items()))))
        total = len(_stream_rows(col, o, holders, keep))
        # helpers: any holders; a kept one's range must not reach its own rest (its rows before
        # that rest only: ``check_ranges``), so a kept helper's amount comes last, capped
        helpers = draw(st.permutations(holders))[: draw(st.integers(0, len(holders)))]
        amounts = [(y, draw(st.integers(1, max(1, total)))) for y in helpers]
        kept_helper = next((y for y in helpers if y in keep), None)
        if kept_helper is not None:
            before = _stream_rows(col, o, holders, keep).index(kept_helper)
            amounts = [(y, n) for y, n in amounts if y not in keep]
            amounts = _fit(amounts, before)
            amounts.append((kept_helper, before - sum(n for _, n in amounts)))
        if blocks:
            cut = cut_ranges(col, o, holders, amounts, blk, keep)
        else:  # any amounts that fit in the stream, in helper order
            cut = tuple(_fit(amounts, total))
        if cut:
            ranges.append((g, cut))
    plan = Plan(tuple(hot), tuple(replicas), P, P, relay=draw(st.booleans()), ranges=tuple(ranges),
                kept=tuple(kept))  # fmt: skip
    return C, E, plan, blk


def _fit(amounts: list, total: int) -> list:
    """``amounts`` in order, each capped at what is left of ``total`` rows; zeros dropped."""
    out, left = [], total
    for y, n in amounts:
        n = min(n, left)
        if n:
            out.append((y, n))
        left -= n
    return out


def _stream_rows(col_W: list[int], owner: int, holders, kept=None) -> list[int]:
    """The stream of one expert as one source id per row, in order (the module doc): a kept
    holder's rows past its local ones at its place."""
    kept = kept or {}
    rows = []
    for s in range(len(col_W)):
        if s in kept:
            rows += [s] * (col_W[s] - kept[s])
        elif s != owner and s not in holders:
            rows += [s] * col_W[s]
    return rows + [owner] * col_W[owner]


def _shares_twin(C_WN: torch.Tensor, plan: Plan, E: int) -> list:
    """Share entries from the stream row by row: each row's rank, runs merged per segment; a
    kept holder's segment: its local rows at itself first, then its rows in the stream."""
    out = []
    ranged, kept = dict(plan.ranges), {g: dict(k) for g, k in plan.kept}
    for g in sorted(set(ranged) | set(kept)):
        o = g // E
        col = C_WN[:, g].tolist()
        keep = kept.get(g, {})
        rows = _stream_rows(col, o, plan.holders(g), keep)
        at = []
        for y, n in ranged.get(g, ()):
            at += [y] * n
        at += [o] * (len(rows) - len(at))
        by_source: dict[int, list[list[int]]] = {y: [[y, n]] for y, n in keep.items() if n}
        for s, r in zip(rows, at, strict=True):
            runs = by_source.setdefault(s, [])
            if runs and runs[-1][0] == r:
                runs[-1][1] += 1
            else:
                runs.append([r, 1])
        for s, runs in by_source.items():
            if s in keep or runs != [[o, col[s]]]:  # whole at the owner: the replica rule
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
    """``range_loads`` (closed form, one link; kept holders included) equals the share loop of
    the expanded plan."""
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
    kept = {g: dict(k) for g, k in plan.kept}
    want = [cut_ranges(C[:, g].tolist(), g // E, h, a, blk, kept.get(g)) for g, h, a in items]
    saved = ranges_module.LIST_CUT_W
    ranges_module.LIST_CUT_W = list_w
    try:
        assert cut_ranges_many(C, items, E, blk, kept) == want
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


def test_plan_rules_for_kept() -> None:
    with pytest.raises(ValueError, match="Plan.kept must be strictly ascending"):
        _plan(hot=(0, 1), replicas=((0, (1,)), (1, (0,))), kept=((1, ((0, 4),)), (0, ((1, 4),))))
    with pytest.raises(ValueError, match="distinct holders with local rows >= 0"):
        _plan(kept=((0, ((1, 4), (1, 8))),))
    with pytest.raises(ValueError, match="distinct holders with local rows >= 0"):
        _plan(kept=((0, ((1, -1),)),))
    with pytest.raises(ValueError, match=r"both ranges and share entries"):
        _plan(kept=((0, ((1, 4),)),), shares=((2, 0, ((0, 4),)),))
    with pytest.raises(ValueError, match="must be expanded"):
        _plan(kept=((0, ((1, 0),)),)).segment_runs(1, 0, 5, 1)


def test_check_kept_errors() -> None:
    # W = 3, E = 1: expert 0 owned by rank 0, holders 1 (8 rows) and 2 (40 rows)
    C = [[20, 0, 0], [8, 0, 0], [40, 0, 0]]
    holders = ((0, (1, 2)),)
    with pytest.raises(ValueError, match=r"name ranks \[2\] that hold no replica"):
        _plan(replicas=((0, (1,)),), kept=((0, ((2, 16),)),)).check_shares(C, 1, 16)
    with pytest.raises(ValueError, match="holder 2 keeps 40 local rows of its 40"):
        _plan(replicas=holders, kept=((0, ((2, 40),)),)).check_shares(C, 1, 8)
    with pytest.raises(ValueError, match="keeps 12 local rows, not a whole number of 8-row"):
        _plan(replicas=holders, kept=((0, ((2, 12),)),)).check_shares(C, 1, 8)
    # the stream: 32 rows of rank 2's rest, then rank 0's 20; a cut 12 rows into the rest
    with pytest.raises(ValueError, match="cut source 2's segment 12 rows in"):
        _plan(replicas=holders, kept=((0, ((2, 8),)),), ranges=((0, ((1, 12),)),)).check_shares(
            C, 1, 8
        )


def test_kept_holders_by_hand() -> None:
    """Expert 0 (owner 0, holders 1 and 3), block 8: holder 1 keeps 16 of its 40 rows, so the
    stream is rank 1's other 24, rank 2's 24, then rank 0's 20."""
    C = torch.tensor([[20, 0, 0, 0], [40, 0, 0, 0], [24, 0, 0, 0], [4, 0, 0, 0]])
    kept = ((0, ((1, 16),)),)
    alone = _plan(replicas=((0, (1, 3)),), kept=kept)
    alone.check_shares(C, 1, 8)
    assert alone.expanded(C, 1).shares == ((1, 0, ((1, 16), (0, 24))),)
    other = _plan(replicas=((0, (1, 3)),), kept=kept, ranges=((0, ((3, 32),)),))
    other.check_shares(C, 1, 8)
    assert other.expanded(C, 1).shares == ((1, 0, ((1, 16), (3, 24))), (2, 0, ((3, 8), (0, 16))))
    want, _ = plan_pricing(C, other.expanded(C, 1), 1)
    got, _ = plan_pricing(C, other, 1)
    assert torch.equal(got, want)
    # rows: 0 computes 16 of rank 2's + its 20; 1 its 16 local; 3 its own 4 + 32 received
    assert got[0].tolist() == [36, 16, 0, 36]
    assert got[2].tolist() == [16, 24, 24, 32]  # remote: received (0, 3) or sent (1, 2)
    # holder 1's own range may not cover its rest: it keeps those rows local instead
    with pytest.raises(ValueError, match="give kept holder 1 rows of its own rest"):
        _plan(replicas=((0, (1, 3)),), kept=kept, ranges=((0, ((1, 32),)),)).check_shares(C, 1, 8)
