"""Row ranges: a balanced plan's helper rows, one entry per (expert, helper) instead of one per
moved segment.

Legend: W ranks, E experts per rank, C = counts_WN (C[s][g] = rows rank s routes to expert g;
expert g is owned by o = g // E), H_g the ranks holding a replica of g (never o).

The **stream** of expert g is the rows its owner would compute under the replica rule, in a
fixed order: the segments (s, g) of the sources that neither own g nor hold its replica, by
ascending s, then the owner's own segment last. A *kept* holder y (``Plan.kept``: ``(y, local)``)
computes only the first ``local`` rows of its own segment (y, g); the other C[y][g] - local rows
stay in the stream at y's place (ascending source order, as a non-holder's segment would). A range entry ``(g, ((y1, n1), (y2, n2), ...))``
cuts the stream from its start: y1 computes its first n1 rows, y2 the next n2, ..., the owner the
rest (so helpers take the other sources' rows first and the owner's own rows last). Each yi holds
g's replica (and computes its own rows of g, the replica rule). A cut strictly inside a segment
sits a whole number of ``block_size`` blocks from that segment's start (for a kept holder: from
the start of its segment's part in the stream, itself whole blocks in), so expanded into share
entries (``range_shares``) every run but a segment's last is whole blocks (``Plan.check_shares``).

Why: a W = 1024 plan with zipf routing moves ~10**5 segments; its ranges are a few thousand
(helpers per hot expert), and their loads follow in closed form (``range_loads``): planning
builds and prices the ranges, only a dispatching rank expands them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

import torch

from mixmoe.placement.loads_tensor import int_tensor

__all__ = [
    "check_ranges",
    "cut_ranges",
    "cut_ranges_many",
    "range_experts",
    "range_loads",
    "range_rows_moved",
    "range_shares",
    "stream_sources",
]

Share = tuple[int, int]  # (rank computing the run, rows in the run)
Kept = dict[int, int]  # {kept holder y: rows of its own segment it computes locally}
LIST_CUT_W = 64  # ranks up to which ``cut_ranges_many`` cuts on Python lists


def stream_sources(
    col_W: Sequence[int], owner: int, holders: Iterable[int], kept: Kept | None = None
) -> list[int]:
    """Sources of expert g's stream in order (module doc): the sources with rows that are
    neither ``owner`` nor in ``holders`` (a holder in ``kept`` stays: it keeps only part of
    its segment), ascending, then ``owner`` (when it has rows). ``col_W``: C[s][g] for every
    rank s; ``kept``: {y: local rows}, each local < C[y][g]."""
    held = set(holders).difference(kept or ())
    out = [s for s, c in enumerate(col_W) if c and s != owner and s not in held]
    if col_W[owner]:
        out.append(owner)
    return out


def _prefix(col_W: Sequence[int], sources: list[int], kept: Kept | None = None) -> list[int]:
    """Stream positions where each source's segment starts, plus the stream's length (a kept
    holder's segment: its rows past the local ones)."""
    out = [0]
    kept = kept or {}
    for s in sources:
        out.append(out[-1] + col_W[s] - kept.get(s, 0))
    return out


def cut_ranges(
    col_W: Sequence[int],
    owner: int,
    holders: Iterable[int],
    amounts: Sequence[Share],
    block_size: int,
    kept: Kept | None = None,
) -> tuple[Share, ...]:
    """``amounts`` [(helper, rows), ...] (in stream order) as valid ranges: each cumulative cut
    moved to the nearest allowed position (a segment's start or end, or a whole number of
    blocks into it; ties: the lower one) and capped at the stream's end; ranges left with 0
    rows dropped. ``kept``: the expert's kept holders (module doc). Deterministic: a pure
    function of its arguments."""
    sources = stream_sources(col_W, owner, holders, kept)
    return _cut(_prefix(col_W, sources, kept), amounts, block_size)


def cut_ranges_many(
    C_WN: torch.Tensor, items: Sequence[tuple[int, Iterable[int], Sequence[Share]]], E: int,
    block_size: int, kept: dict[int, Kept] | None = None,
) -> list[tuple[Share, ...]]:  # fmt: skip
    """``cut_ranges`` of many experts at once: ``items`` [(g, holders, amounts), ...], ``kept``
    {g: its kept holders}; the streams' segment starts from one gather and one cumulative sum
    (a stream's segments as W slots, the excluded sources' empty) instead of a Python pass over
    W ranks per expert: the same cuts."""
    if not items:
        return []
    kept = kept or {}
    W = C_WN.shape[0]
    gs = [g for g, _, _ in items]
    if W <= LIST_CUT_W:  # a few columns: Python lists cost less than the tensor ops
        cols = C_WN[:, gs].T.tolist()
        return [
            cut_ranges(col, g // E, holders, amounts, block_size, kept.get(g))
            for col, (g, holders, amounts) in zip(cols, items, strict=True)
        ]
    return _cut_many_tensor(C_WN, items, E, block_size, kept)


def _cut_many_tensor(
    C_WN: torch.Tensor, items: Sequence[tuple[int, Iterable[int], Sequence[Share]]], E: int,
    block_size: int, kept: dict[int, Kept],
) -> list[tuple[Share, ...]]:  # fmt: skip
    """``cut_ranges_many`` above ``LIST_CUT_W`` ranks: the streams' segment starts [G, W + 2]
    (one gather of the G columns from the transposed view, one cumulative sum) and every cut
    of every expert in a few flat tensor ops (Q cuts in all): ``_cut``'s arithmetic, the same
    integers. Item i's starts are offset by i * BIG (BIG > every stream's end), so one sorted
    vector holds every stream and one ``searchsorted`` finds every cut's segment, and the
    running max of ``_cut`` (a cut never goes back) is one ``cummax``."""
    W, N = C_WN.shape
    G = len(items)
    S = W + 2
    g_G = int_tensor(g for g, _, _ in items)
    cols_GW = C_WN.t().index_select(0, g_G)  # a copy: rows of the transposed view
    own_G = cols_GW[torch.arange(G), g_G // E]  # the owner's segment comes last
    # the owner and the holders leave the stream (flat indices into cols_GW)
    out_X = int_tensor(chain.from_iterable((g // E, *h) for g, h, _ in items))
    out_sizes = int_tensor(len(h) + 1 for _, h, _ in items)
    cols_GW.view(-1)[torch.arange(G).repeat_interleave(out_sizes) * W + out_X] = 0
    rest = [(i, y, n) for i, (g, _, _) in enumerate(items) for y, n in kept.get(g, {}).items()]
    if rest:  # a kept holder's rest stays in it: C[y][g] - local
        i_K = int_tensor(i for i, _, _ in rest)
        y_K = int_tensor(y for _, y, _ in rest)
        c_K = C_WN.reshape(-1)[y_K * N + g_G[i_K]]
        cols_GW.view(-1)[i_K * W + y_K] = c_K - int_tensor(n for _, _, n in rest)
    starts_GS = torch.zeros(G, S, dtype=torch.int64)
    starts_GS[:, 1 : W + 1] = cols_GW.cumsum(1)
    starts_GS[:, W + 1] = starts_GS[:, W] + own_G
    end_G = starts_GS[:, W + 1]
    # every cut: its item i, its helper, its cumulative want (``_cut``'s want: the item's
    # amounts summed so far = the running sum over all items less the earlier items' totals)
    sizes = [len(amounts) for _, _, amounts in items]
    y_Q = [y for _, _, amounts in items for y, _ in amounts]
    if not y_Q:
        return [() for _ in items]
    n_Q = int_tensor(n for _, _, amounts in items for _, n in amounts)
    i_t = torch.arange(G).repeat_interleave(int_tensor(sizes))
    total_G = torch.zeros(G, dtype=torch.int64).index_add_(0, i_t, n_Q)
    earlier_G = total_G.cumsum(0) - total_G
    q_Q = torch.minimum(n_Q.cumsum(0) - earlier_G[i_t], end_G[i_t])
    big = int(end_G.max()) + 1
    flat_S = (starts_GS + torch.arange(G).view(G, 1) * big).view(-1)  # ascending overall
    at_Q = torch.searchsorted(flat_S, q_Q + i_t * big, right=True) - 1  # bisect_right - 1
    inside_Q = at_Q - i_t * S < S - 1  # q inside the stream (before its end): rounded
    lo_Q = starts_GS.view(-1)[at_Q]
    hi_Q = starts_GS.view(-1)[torch.where(inside_Q, at_Q + 1, at_Q)]
    off_Q = q_Q - lo_Q
    down_Q = off_Q // block_size * block_size  # the whole block below, or the segment's
    up_Q = torch.minimum(hi_Q - lo_Q, down_Q + block_size)  # next cut: block or end
    near_Q = lo_Q + torch.where(off_Q - down_Q <= up_Q - off_Q, down_Q, up_Q)
    q_Q = torch.where(inside_Q, near_Q, q_Q)
    # a cut never goes back (q = max(q, at)): the running max within each item, by offsets
    q_Q = torch.cummax(q_Q + i_t * big, 0).values - i_t * big
    first_Q = torch.ones(len(y_Q), dtype=torch.bool)
    first_Q[1:] = i_t[1:] != i_t[:-1]
    rows_Q = (q_Q - torch.where(first_Q, 0, q_Q.roll(1))).tolist()
    out, at = [], 0
    for size in sizes:
        cut = zip(y_Q[at : at + size], rows_Q[at : at + size], strict=True)
        out.append(tuple((y, n) for y, n in cut if n > 0))
        at += size
    return out


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


def range_experts(plan) -> list[tuple[int, tuple[Share, ...], Kept]]:
    """(g, ranges, kept) of every expert with ranges or kept holders, ascending g."""
    ranges = dict(plan.ranges)
    kept = {g: dict(k) for g, k in plan.kept}
    return [(g, ranges.get(g, ()), kept.get(g, {})) for g in sorted(ranges.keys() | kept.keys())]


def _with_columns(C_WN: torch.Tensor, plan) -> Iterator[tuple[int, tuple[Share, ...], Kept, list]]:
    """``_experts`` each with its column C[:, g] as a list (one gather for all of them)."""
    experts = range_experts(plan)
    if not experts:
        return
    # rows of C's transpose: ~3x faster than C[:, gs] (one stride per column, not per row)
    cols = C_WN.T[[g for g, _, _ in experts]].tolist()
    for (g, ranges, kept), col_W in zip(experts, cols, strict=True):
        yield g, ranges, kept, col_W


def check_ranges(C_WN: torch.Tensor, plan, experts_per_rank: int, block_size: int) -> None:
    """ValueError unless every kept entry of ``plan`` names holders of its expert keeping a
    whole number of blocks, fewer than their segment's rows, and every range entry names only
    holders of its expert (never the owner), fits in the expert's stream, cuts inside a
    segment only at whole blocks, and gives no kept holder rows of its own rest."""
    E = experts_per_rank
    for g, ranges, kept, col_W in _with_columns(C_WN, plan):
        o, holders = g // E, plan.holders(g)
        outside = [y for y in [*(y for y, _ in ranges), *kept] if y not in holders]
        if outside:
            raise ValueError(
                f"ranges/kept of expert {g} name ranks {outside} that hold no replica of it "
                f"(holders {list(holders)})"
            )
        for y, local in kept.items():
            if local >= col_W[y]:
                raise ValueError(
                    f"kept of expert {g}: holder {y} keeps {local} local rows of its "
                    f"{col_W[y]}; keep fewer, or leave {y} out of kept (all its rows local)"
                )
            if local % block_size:
                raise ValueError(
                    f"kept of expert {g}: holder {y} keeps {local} local rows, not a whole "
                    f"number of {block_size}-row blocks"
                )
        sources = stream_sources(col_W, o, holders, kept)
        starts = _prefix(col_W, sources, kept)
        q = 0
        for y, n in ranges:
            if y in kept:  # y's range [q, q + n) against its own rest in the stream
                k = sources.index(y)
                if q < starts[k + 1] and starts[k] < q + n:
                    raise ValueError(
                        f"ranges of expert {g} {ranges} give kept holder {y} rows of its own "
                        f"rest (stream rows {starts[k]}..{starts[k + 1]}): keep them local "
                        "(raise its kept local rows) instead"
                    )
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
    ranges and kept holders: every segment a range covers, cut into its runs in stream order
    (helpers' runs, then the owner's rest), and every kept holder's segment (its local rows
    first, when any, then its stream part's runs); other segments have none (the replica rule). Sorted by (s, g). ``rank``: only
    the entries that rank's dispatch reads (``Plan.expanded``): its own segments (s == rank),
    and every segment of the experts it owns or holds a replica of."""
    E = experts_per_rank
    experts = range_experts(plan)
    if not experts:
        return []
    gs = [g for g, _, _ in experts]
    full = [rank is None or g // E == rank or rank in plan.holders(g) for g in gs]
    mine = {}  # g -> where rank's segment starts in g's stream (the experts not expanded)
    if not all(full):
        part = [i for i, f in enumerate(full) if not f]
        # a copy: rows of C's transpose (fast), of the sources up to rank only (rank's segment
        # starts after the sources below it: the rows above are never read; W = 1024: ~0.9 ms
        # for all of them)
        cols_GW = C_WN[: rank + 1].T[[gs[i] for i in part]]
        # the owner and the holders leave the stream, a kept holder's rest stays in it: one
        # scatter each over (row of cols_GW, rank) index lists
        out_k, out_y, kept_k, kept_y, kept_local = [], [], [], [], []
        for k, i in enumerate(part):
            g = gs[i]
            # the ranks below rank (rank neither owns nor holds g here: never y == rank)
            leave = [y for y in (g // E, *plan.holders(g)) if y < rank]
            out_k += [k] * len(leave)
            out_y += leave
            for y, local in experts[i][2].items():
                if y < rank:  # a kept holder holds g: never rank
                    kept_k.append(k)
                    kept_y.append(y)
                    kept_local.append(local)
        rest = cols_GW[kept_k, kept_y] - torch.tensor(kept_local, dtype=cols_GW.dtype)
        cols_GW[out_k, out_y] = 0
        cols_GW[kept_k, kept_y] = rest
        # rank's segment starts after the stream's sources below it (the owner comes last)
        starts = cols_GW[:, :rank].sum(1).tolist() if rank else [0] * len(part)
        rows = cols_GW[:, rank].tolist()
        for k, i in enumerate(part):
            mine[gs[i]] = (starts[k], rows[k])
    cols = C_WN.T[[g for g, f in zip(gs, full, strict=True) if f]].tolist()
    out = []
    at = 0
    for (g, ranges, kept), f in zip(experts, full, strict=True):
        o = g // E
        # range i covers stream rows [ends[i - 1], ends[i]); the owner the rest
        ends, q = [], 0
        for _, n in ranges:
            q += n
            ends.append(q)
        if not f:  # rank holds no replica of g: its segment is no kept one
            lo, c = mine[g]
            if c and lo < q:  # rank's segment, partly or wholly in the ranges
                out.append((rank, g, _runs(lo, lo + c, ranges, ends, o)))
            continue
        col_W = cols[at]
        at += 1
        sources = stream_sources(col_W, o, plan.holders(g), kept)
        starts = _prefix(col_W, sources, kept)
        out += _stream_entries(g, o, sources, starts, ranges, ends, kept)
    out.sort()  # by (s, g): unique pairs, so the runs are never compared
    return out


def _stream_entries(
    g: int, o: int, sources: list[int], starts: list[int], ranges, ends: list[int], kept: Kept
) -> list:
    """The share entries ``(s, g, runs)`` of every segment of g's stream (``sources`` in stream
    order, segment k at rows [starts[k], starts[k + 1])): ``_runs`` of each, the first range
    ending after a segment's start found by one walk (the segments ascend, so it only moves
    forward: no search per segment; W = 1024: ~10**3 segments an expert). A segment wholly past
    the ranges has no entry (the replica rule: at the owner) unless it is a kept holder's rest,
    which follows the holder's local rows."""
    out = []
    q = ends[-1] if ends else 0
    i = 0  # the first range ending after the segment's start (bisect_right(ends, lo))
    for k, s in enumerate(sources):
        lo, hi = starts[k], starts[k + 1]
        local = kept.get(s)
        if local is None and lo >= q:  # whole at the owner (the replica rule): no entry
            continue
        while i < len(ends) and ends[i] <= lo:
            i += 1
        runs = _runs(lo, hi, ranges, ends, o, i)
        # a kept holder's runs are never at s (``check_ranges``): its local rows come first
        out.append((s, g, ((s, local), *runs) if local else runs))
    return out


def _runs(
    lo: int, hi: int, ranges, ends: list[int], owner: int, i: int | None = None
) -> tuple[Share, ...]:
    """The runs of the segment at stream rows [lo, hi): the ranges' ranks where they cover it
    (``ends``: each range's end), the owner past the last. ``i``: the first range ending after
    lo (``bisect_right(ends, lo)``) when the caller knows it."""
    runs = []
    if i is None:
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


def _stream_terms(col_W: list[int], o: int, holders, kept: Kept) -> tuple[int, int]:
    """(others, rest): the stream's rows from sources other than the owner ``o``, and the kept
    holders' rests in it (C[y][g] - local, summed)."""
    held = sum(col_W[h] for h in holders)
    rest = sum(col_W[y] - local for y, local in kept.items())
    return sum(col_W) - col_W[o] - held + rest, rest


LIST_MOVED_W = 64  # ranks up to which range_rows_moved adds the experts' columns as lists


def range_rows_moved(C_WN: torch.Tensor, plan, experts_per_rank: int) -> int:
    """Rows that cross ranks because of ``plan``'s ranges and kept holders, beyond the replica
    rule: the owner's own rows its helpers take (the other sources' rows cross either way, to
    the owner or to a helper), and each kept holder's rest (it crosses: no range of the
    holder's own covers it, ``check_ranges``). Every rank computes it each step: above
    ``LIST_MOVED_W`` ranks in tensor ops over the ranged experts (W = 1024: ~100 of them,
    columns of 1024), below on their columns as lists (fewer fixed costs)."""
    E = experts_per_rank
    if C_WN.shape[0] <= LIST_MOVED_W:
        out = 0
        for g, ranges, kept, col_W in _with_columns(C_WN, plan):
            others, rest = _stream_terms(col_W, g // E, plan.holders(g), kept)
            out += max(0, sum(n for _, n in ranges) - others) + rest
        return out
    experts = range_experts(plan)
    if not experts:
        return 0
    g_G = torch.tensor([g for g, _, _ in experts])
    pairs = [(i, h) for i, (g, _, _) in enumerate(experts) for h in plan.holders(g)]
    kept = [(i, y, local) for i, (_, _, k) in enumerate(experts) for y, local in k.items()]
    i_P, h_P = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).unbind(1)
    held_G = torch.zeros(len(experts), dtype=C_WN.dtype)
    held_G.index_add_(0, i_P, C_WN[h_P, g_G[i_P]])  # the holders' own rows: not in the stream
    rest_G = torch.zeros(len(experts), dtype=C_WN.dtype)
    if kept:  # a kept holder's rest (its rows less its local ones) is in the stream
        i_K, y_K, local_K = torch.tensor(kept, dtype=torch.int64).unbind(1)
        rest_G.index_add_(0, i_K, C_WN[y_K, g_G[i_K]] - local_K)
    # the stream's rows from sources other than the owner (``_stream_terms``)
    others_G = C_WN.T[g_G].sum(1) - C_WN[g_G // E, g_G] - held_G + rest_G
    taken_G = torch.tensor([sum(n for _, n in ranges) for _, ranges, _ in experts])
    return int((taken_G - others_G).clamp(min=0).sum() + rest_G.sum())


def range_loads(
    C_WN: torch.Tensor,
    plan,
    experts_per_rank: int,
    rows: list,
    local: list,
    remote: list,
) -> None:
    """Add ``plan``'s ranges and kept holders to per-rank loads priced by the replica rule
    (``plan_loads``), in place. A kept holder y's rest d = C[y][g] - local first goes back to
    the stream: y computes d rows less (local no more: it sends them), the owner d more
    (received). Then the ranges: a helper y computes its n rows, received (remote at y); the
    owner computes them no more: the other sources' rows first (it no longer receives them),
    then its own (it now sends them: remote, no longer local). Sources send as before (to
    another rank: a kept holder's rest is never in its own range, ``check_ranges``)."""
    E = experts_per_rank
    for g, ranges, kept, col_W in _with_columns(C_WN, plan):
        o = g // E
        # the other sources' rows in the stream (kept holders' rests included)
        others, _ = _stream_terms(col_W, o, plan.holders(g), kept)
        for y, local_y in kept.items():  # the replica rule undone for y's rest d
            d = col_W[y] - local_y
            rows[y] -= d
            local[y] -= d
            remote[y] += d
            rows[o] += d
            remote[o] += d
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
