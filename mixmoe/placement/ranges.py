"""Row ranges: a balanced plan's helper rows, one entry per (expert, helper) instead of one per
moved segment.

Legend: W ranks, E experts per rank, C = counts_WN (C[s][g] = rows rank s routes to expert g;
expert g is owned by o = g // E), H_g the ranks holding a replica of g (never o).

The **stream** of expert g is the rows its owner would compute under the replica rule, in a
fixed order: the segments (s, g) of the sources that neither own g nor hold its replica, by
ascending s, then the owner's own segment last. A range entry ``(g, ((y1, n1), (y2, n2), ...))``
cuts the stream from its start: y1 computes its first n1 rows, y2 the next n2, ..., the owner the
rest (so helpers take the other sources' rows first and the owner's own rows last). Each yi holds
g's replica (and computes its own rows of g, the replica rule). A cut strictly inside a segment
sits a whole number of ``block_size`` blocks from that segment's start, so expanded into share
entries (``range_shares``) every run but a segment's last is whole blocks (``Plan.check_shares``).

Why: a W = 1024 plan with zipf routing moves ~10**5 segments; its ranges are a few thousand
(helpers per hot expert), and their loads follow in closed form (``range_loads``): planning
builds and prices the ranges, only a dispatching rank expands them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "cut_ranges",
    "cut_ranges_many",
    "range_loads",
    "range_rows_moved",
    "range_shares",
    "stream_sources",
]

Share = tuple[int, int]  # (rank computing the run, rows in the run)
LIST_CUT_W = 64  # ranks up to which ``cut_ranges_many`` cuts on Python lists


def stream_sources(col_W: Sequence[int], owner: int, holders: Iterable[int]) -> list[int]:
    """Sources of expert g's stream in order (module doc): the sources with rows that are
    neither ``owner`` nor in ``holders``, ascending, then ``owner`` (when it has rows).
    ``col_W``: C[s][g] for every rank s."""
    held = set(holders)
    out = [s for s, c in enumerate(col_W) if c and s != owner and s not in held]
    if col_W[owner]:
        out.append(owner)
    return out


def _prefix(col_W: Sequence[int], sources: list[int]) -> list[int]:
    """Stream positions where each source's segment starts, plus the stream's length."""
    out = [0]
    for s in sources:
        out.append(out[-1] + col_W[s])
    return out


def cut_ranges(
    col_W: Sequence[int],
    owner: int,
    holders: Iterable[int],
    amounts: Sequence[Share],
    block_size: int,
) -> tuple[Share, ...]:
    """``amounts`` [(helper, rows), ...] (in stream order) as valid ranges: each cumulative cut
    moved to the nearest allowed position (a segment's start or end, or a whole number of
    blocks into it; ties: the lower one) and capped at the stream's end; ranges left with 0
    rows dropped. Deterministic: a pure function of its arguments."""
    return _cut(_prefix(col_W, stream_sources(col_W, owner, holders)), amounts, block_size)


def cut_ranges_many(
    C_WN: torch.Tensor, items: Sequence[tuple[int, Iterable[int], Sequence[Share]]], E: int,
    block_size: int,
) -> list[tuple[Share, ...]]:  # fmt: skip
    """``cut_ranges`` of many experts at once: ``items`` [(g, holders, amounts), ...]; the
    streams' segment starts from one gather and one cumulative sum (a stream's segments as W
    slots, the excluded sources' empty) instead of a Python pass over W ranks per expert: the
    same cuts."""
    if not items:
        return []
    W = C_WN.shape[0]
    gs = [g for g, _, _ in items]
    if W <= LIST_CUT_W:  # a few columns: Python lists cost less than the tensor ops
        cols = C_WN[:, gs].T.tolist()
        return [
            cut_ranges(col, g // E, holders, amounts, block_size)
            for col, (g, holders, amounts) in zip(cols, items, strict=True)
        ]
    cols_GW = C_WN[:, gs].T.clone()
    own_G = cols_GW[torch.arange(len(gs)), torch.tensor([g // E for g in gs])].tolist()
    for i, (g, holders, _) in enumerate(items):  # the owner and the holders leave the stream
        cols_GW[i, [g // E, *holders]] = 0
    # starts of the W source slots, the owner's segment (last) and the stream's end
    starts_GW = torch.zeros(len(gs), W + 2, dtype=torch.int64)
    starts_GW[:, 1 : W + 1] = cols_GW.cumsum(1)
    starts_GW[:, W + 1] = starts_GW[:, W] + torch.tensor(own_G, dtype=torch.int64)
    return [
        _cut(starts, amounts, block_size)
        for starts, (_, _, amounts) in zip(starts_GW.tolist(), items, strict=True)
    ]


def _cut(starts: list[int], amounts: Sequence[Share], block_size: int) -> tuple[Share, ...]:
    """``cut_ranges`` given the stream's segment starts and its end (``starts[-1]``; empty
    segments allowed)."""
    end = starts[-1]
    out, at, want = [], 0, 0
    for y, n in amounts:
        want += n
        q = min(want, end)
        k = bisect_right(starts, q) - 1  # the segment q falls in (or starts at)
        if k < len(starts) - 1:
            off = q - starts[k]
            down = off // block_size * block_size  # the whole block below, or the segment's
            up = min(starts[k + 1] - starts[k], down + block_size)  # next cut: block or end
            q = starts[k] + (down if off - down <= up - off else up)
        q = max(q, at)
        if q > at:
            out.append((y, q - at))
        at = q
    return tuple(out)


def check_ranges(C_WN: torch.Tensor, plan, experts_per_rank: int, block_size: int) -> None:
    """ValueError unless every range entry of ``plan`` names only holders of its expert (never
    the owner), fits in the expert's stream, and cuts inside a segment only at whole blocks."""
    E = experts_per_rank
    if not plan.ranges:
        return
    cols = C_WN[:, [g for g, _ in plan.ranges]].T.tolist()
    for (g, ranges), col_W in zip(plan.ranges, cols, strict=True):
        o, holders = g // E, plan.holders(g)
        outside = [y for y, _ in ranges if y not in holders]
        if outside:
            raise ValueError(
                f"ranges of expert {g} name ranks {outside} that hold no replica of it "
                f"(holders {list(holders)})"
            )
        sources = stream_sources(col_W, o, holders)
        starts = _prefix(col_W, sources)
        q = 0
        for _, n in ranges:
            q += n
            if q > starts[-1]:
                raise ValueError(
                    f"ranges of expert {g} {ranges} cover {sum(n for _, n in ranges)} rows, "
                    f"more than its stream's {starts[-1]}"
                )
            k = bisect_right(starts, q) - 1
            if k < len(sources) and (q - starts[k]) % block_size:
                raise ValueError(
                    f"ranges of expert {g} {ranges} cut source {sources[k]}'s segment "
                    f"{q - starts[k]} rows in, not at a whole {block_size}-row block"
                )


def range_shares(C_WN: torch.Tensor, plan, experts_per_rank: int, rank: int | None = None) -> list:
    """The share entries (``Plan.shares``' form: ``(s, g, ((rank, rows), ...))``) of ``plan``'s
    ranges: every segment a range covers, cut into its runs in stream order (helpers' runs,
    then the owner's rest); segments the ranges leave whole at the owner have none. Sorted by
    (s, g). ``rank``: only the entries that rank's dispatch reads (``Plan.expanded``): its own
    segments (s == rank), and every segment of the experts it owns or holds a replica of."""
    E = experts_per_rank
    if not plan.ranges:
        return []
    gs = [g for g, _ in plan.ranges]
    full = [rank is None or g // E == rank or rank in plan.holders(g) for g in gs]
    mine = {}  # g -> where rank's segment starts in g's stream (the experts not expanded)
    if not all(full):
        part = [i for i, f in enumerate(full) if not f]
        cols_GW = C_WN[:, [gs[i] for i in part]].T.clone()
        for k, i in enumerate(part):  # the owner and the holders leave the stream
            g = gs[i]
            cols_GW[k, [g // E, *plan.holders(g)]] = 0
        # rank's segment starts after the stream's sources below it (the owner comes last)
        starts = cols_GW[:, :rank].sum(1) if rank else torch.zeros(len(part), dtype=torch.int64)
        rows = cols_GW[:, rank].tolist()
        for k, i in enumerate(part):
            mine[gs[i]] = (int(starts[k]), rows[k])
    cols = C_WN[:, [g for g, f in zip(gs, full, strict=True) if f]].T.tolist()
    out = []
    at = 0
    for (g, ranges), f in zip(plan.ranges, full, strict=True):
        o = g // E
        # range i covers stream rows [ends[i - 1], ends[i]); the owner the rest
        ends, q = [], 0
        for _, n in ranges:
            q += n
            ends.append(q)
        if not f:
            lo, c = mine[g]
            if c and lo < q:  # rank's segment, partly or wholly in the ranges
                out.append((rank, g, _runs(lo, lo + c, ranges, ends, o)))
            continue
        col_W = cols[at]
        at += 1
        sources = stream_sources(col_W, o, plan.holders(g))
        starts = _prefix(col_W, sources)
        for k, s in enumerate(sources):
            lo, hi = starts[k], starts[k + 1]
            if lo >= q:  # this segment and the rest: whole at the owner (the replica rule)
                break
            out.append((s, g, _runs(lo, hi, ranges, ends, o)))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


def _runs(lo: int, hi: int, ranges, ends: list[int], owner: int) -> tuple[Share, ...]:
    """The runs of the segment at stream rows [lo, hi): the ranges' ranks where they cover it
    (``ends``: each range's end), the owner past the last."""
    runs = []
    i = bisect_right(ends, lo)  # the first range ending after lo
    while lo < hi:
        if i < len(ends):
            top = min(hi, ends[i])
            runs.append((ranges[i][0], top - lo))
            i += 1
        else:
            top = hi
            runs.append((owner, top - lo))
        lo = top
    return tuple(runs)


def range_rows_moved(C_WN: torch.Tensor, plan, experts_per_rank: int) -> int:
    """Rows that cross ranks because of ``plan``'s ranges, beyond the replica rule: the owner's
    own rows its helpers take (the other sources' rows cross either way, to the owner or to a
    helper)."""
    E = experts_per_rank
    if not plan.ranges:
        return 0
    cols = C_WN[:, [g for g, _ in plan.ranges]].T.tolist()
    out = 0
    for (g, ranges), col_W in zip(plan.ranges, cols, strict=True):
        o = g // E
        others = sum(col_W) - col_W[o] - sum(col_W[h] for h in plan.holders(g))
        out += max(0, sum(n for _, n in ranges) - others)
    return out


def range_loads(
    C_WN: torch.Tensor,
    plan,
    experts_per_rank: int,
    rows: list,
    local: list,
    remote: list,
) -> None:
    """Add ``plan``'s ranges to per-rank loads priced by the replica rule (``plan_loads``), in
    place: a helper y computes its n rows, received (remote at y); the owner computes them no
    more: the other sources' rows first (it no longer receives them), then its own (it now
    sends them: remote, no longer local). Sources send as before (to another rank)."""
    E = experts_per_rank
    if not plan.ranges:
        return
    gs = [g for g, _ in plan.ranges]
    cols = C_WN[:, gs].T.tolist()
    for (g, ranges), col_W in zip(plan.ranges, cols, strict=True):
        o = g // E
        held = sum(col_W[h] for h in plan.holders(g))
        others = sum(col_W) - col_W[o] - held  # the other sources' rows in the stream
        taken = 0
        for y, n in ranges:
            rows[y] += n
            remote[y] += n
            taken += n
        from_others = min(taken, others)
        own = taken - from_others
        rows[o] -= taken
        remote[o] += own - from_others
        local[o] -= own
