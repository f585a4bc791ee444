"""A batched water-fill: every rank above the water level sheds rows in the same pass.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g; expert g is owned by rank g // E). T_W: the rank totals (s) of a ``WaterFill`` state;
a = seconds per row computed, t = seconds per row exchanged (``StepModel``'s terms).

``WaterFill``'s move-by-move search prices every candidate (expert, receiver) move in Python: its
steps grow with the helpers a plan needs (~W at W = 1024). ``level_fill`` runs a few passes over
the same state (``WaterFill``'s loads, placement and relay bookkeeping), each:

1. offers: every rank b offers its ``OFFERED`` heaviest experts (rows computed at b, as owner
   or helper; by rows, then id): the other sources' rows of each at b, plus b's own while its
   token exchange is hidden under its local compute (they lower b only then). b saves a per
   row, a + t while its exchange is exposed (it no longer receives them); a receiver pays a + t
   per row and, unless it holds the expert already, a new replica's ~2 copies (scatter +
   all-gather);
2. the level L (``_level``): the rows shed above it (each rank's offers down to L) plus one copy
   per donor whose heaviest expert has no holder yet equal the rows absorbed below it (each
   rank's room under L less a copy; after a pass that gained less than ``MIN_GAIN``, no copy
   for the owners and holders of the experts offered above the mean: their room first). Every
   term is piecewise linear in L: one sort of ~3W breakpoints and a walk (tensor ops above
   ``TENSOR_POINTS``), not a step per move;
3. pieces (``_matched``): each donor above L (total descending) sheds (T_b - L) / save_b rows,
   its heaviest expert first: on the ranks that own or hold it (no copy), then on the ranks
   below L - copy in total order (each new holder pays its copies out of its room and needs a
   free replica slot), the next expert once its rows are out. Pieces are asked to the nearest
   whole block and cut from b's segments at whole blocks (``_takes``: the receiver's own rows
   first, they turn local; then the other sources', largest first; then b's own);
4. new holders added per expert (``WaterFill.grow``: g's relay priced once per pass), then every
   total recomputed (``WaterFill.retotal``).

The passes stop once the max total is within ``stop`` of the mean, after a pass lowering the
max by less than ``MIN_GAIN`` once the level counts no copies for the holders (the first such
pass switches to that level), or after ``passes``. The rates are estimates (each total's kink, where its exchange turns hidden or
exposed, is ignored inside a pass); the loads are exact: ``WaterFill``'s, so the plan the fill
emits prices to them (``cost_model.plan_pricing``; the caller keeps it only when cheaper than its
candidates). Deterministic: ties by rank and expert id.
Python work per pass: O(W) list steps plus one per segment moved (the plan's share entries).
"""

from __future__ import annotations

import operator

import torch

from mixmoe.placement.balance import WaterFill
from mixmoe.placement.cost_model import TOKEN_COLLECTIVES

__all__ = ["MIN_GAIN", "level_fill"]

OFFERED = 4  # experts a rank offers per pass, heaviest first
MIN_GAIN = 0.005  # the passes stop after one lowering the max by less than this fraction
TENSOR_POINTS = 384  # ``_level``: more breakpoints than this are walked as tensor ops


def level_fill(fill: WaterFill, passes: int, stop: float) -> int:
    """Run up to ``passes`` batched passes (module doc) on ``fill``'s state, after its
    ``set_loads``; returns the pieces moved (0: the state is unchanged). ``stop``: no pass once
    max(T) <= stop * mean(T)."""
    model = fill.model
    a = model.flops_per_row / model.gemm_flops + model.row_s  # seconds per row computed
    t = model.token_bytes_per_row / model.bw if fill.any_remote else 0.0  # per row exchanged
    hide = a if model.overlap else 0.0  # a local row hides this much of the token exchange
    copy = 2.0 * (model.params_bytes / model.bw + model.replica_s)  # a new holder's ~2 copies
    lat = TOKEN_COLLECTIVES * model.lat
    W, E, blk, slots = fill.W, fill.E, fill.block, fill.slots
    # C[o][g] of each expert g's owner o = g // E (the [W, W, E] view's diagonal, as [W, E])
    own_N = fill.C_WN.view(W, W, E).diagonal(0, 0, 1).T.reshape(-1).tolist()
    cost_W = [a + t] * W  # a receiver's rate: its hidden slack (if any) is left as a margin
    pieces = 0
    free = False  # whether the level counts no copy for the ranks holding an offered expert
    for _ in range(passes):
        T_W = fill.totals
        top, mean = max(T_W), sum(T_W) / W
        if top <= stop * mean:
            break
        # each rank's token exchange before the max(0, .): > 0 when exposed
        token_W = [lat + t * rm - hide * lc for rm, lc in zip(fill.remote, fill.local, strict=True)]
        # only a rank above the mean offers (the level is above the mean but where the offers
        # run out: shed rows cost a receiver at least what they save their donor)
        offers = [
            _offer(fill, b, token_W[b], t, hide, own_N) if T_W[b] > mean else [] for b in range(W)
        ]
        save_W = [a + t if token_W[b] > 0 and t else a for b in range(W)]
        avail_W = [sum(other + own for _, other, own in o) for o in offers]
        start_W = [T_W[r] + copy if fill.held[r] < slots else float("inf") for r in range(W)]
        if free:  # the owners and holders of the experts offered (above the mean): no copy
            for b in range(W):
                for g, _, _ in offers[b]:
                    for r in (g // E, *fill.holders.get(g, ())):
                        start_W[r] = T_W[r]
        # a donor whose heaviest expert has a holder (or an owner) besides itself needs no
        # new copy to start shedding
        fresh_W = [
            bool(o) and not any(r != b for r in (o[0][0] // E, *fill.holders.get(o[0][0], ())))
            for b, o in enumerate(offers)
        ]
        L = _level(T_W, avail_W, save_W, start_W, cost_W, fresh_W, copy)
        shed = []  # (donor, rows): by total descending, then rank
        for b in sorted(range(W), key=lambda r: (-T_W[r], r)):
            if T_W[b] <= L:
                break
            n = min(avail_W[b], (T_W[b] - L) / save_W[b])
            if n >= 0.5 * blk:  # to the nearest whole block (at least one)
                shed.append((b, max(blk, int(n / blk + 0.5) * blk)))
        room_W = [max(0.0, L - x) for x in T_W]  # seconds each rank may take on
        order = sorted((r for r in range(W) if start_W[r] < L), key=lambda r: (T_W[r], r))
        new, moved = _matched(fill, offers, shed, room_W, order, cost_W, copy)
        for g in sorted(new):
            fill.grow(g, new[g])
        if moved:
            fill.retotal()
        pieces += moved
        if max(fill.totals) > (1.0 - MIN_GAIN) * top:  # this pass gained little
            if free or not (moved or any(fill.holders.values())):
                break  # (no holder anywhere: the level without their copies is the same)
            free = True  # the level without copies for the holders: their room first
    return pieces


def _offer(fill: WaterFill, b: int, token: float, t: float, hide: float, own_N: list) -> list:
    """[[g, other rows, own rows], ...] rank b offers: its ``OFFERED`` heaviest experts (rows
    computed at b, as owner or helper; by rows descending, then id), each with the rows of g at
    b from other sources and b's own rows of g that lower b when moved (while its token
    exchange stays hidden: up to -token / (t + hide) rows in all, heaviest expert first).
    ``own_N``: C[g // E][g] per expert."""
    E = fill.E
    rows = [(-n, g) for g in range(b * E, (b + 1) * E) if (n := fill.owner_rows[g]) > 0]
    rows += [(-n, g) for g, n in fill.helped.get(b, {}).items() if n > 0]
    rows.sort()  # heaviest first, then by id
    # hidden: b's own rows lower it until its exchange shows
    headroom = int(-token / (t + hide)) if token < 0 and t + hide > 0 else 0
    out = []
    for n, g in rows[:OFFERED]:
        placed = fill.where.get(g)
        # an expert no move touched: its owner computes its own rows (the replica rule)
        own = own_N[g] if placed is None else placed.get(b, {}).get(b, 0)
        mine = min(own, headroom)
        headroom -= mine
        out.append([g, -n - own, mine])
    return out


def _level(
    T_W: list,
    avail_W: list,
    save_W: list,
    start_W: list,
    cost_W: list,
    fresh_W: list,
    copy: float,
) -> float:
    """The level L (s) where the rows shed above it (plus the copies they cost) equal the rows
    absorbed below it: d(L) = sum_r clamp((T_r - L) / save_r, 0, avail_r) + J * #{r fresh:
    T_r > L} - sum_r max(0, (L - start_r) / cost_r) = 0, J = ``copy`` in rows at the mean cost
    (a fresh donor's expert has no other holder: its rows reach one more receiver than the
    receivers counted, one more copy). d decreases; its breakpoints: T_r - avail_r * save_r
    and T_r (slope changes; at T_r a drop of J when fresh), start_r (slope change)."""
    jump = copy * len(cost_W) / sum(cost_W)
    points = []  # (L, change of d's slope there, drop of d there), by rank
    d0 = 0.0  # d left of every breakpoint: every offer shed in full, every fresh copy counted
    for r, (T, avail, save, start, cost) in enumerate(
        zip(T_W, avail_W, save_W, start_W, cost_W, strict=True)
    ):
        if avail > 0:
            drop = jump if fresh_W[r] else 0.0
            points.append((T - avail * save, -1.0 / save, 0.0))
            points.append((T, 1.0 / save, -drop))
            d0 += avail + drop
        if start != float("inf"):
            points.append((start, -1.0 / cost, 0.0))
    if not points:
        return max(T_W)
    if len(points) > TENSOR_POINTS:
        return _crossing_tensor(points, d0)
    points.sort(key=operator.itemgetter(0))  # stable: equal L stay by rank
    d, slope, prev = d0, 0.0, points[0][0]
    for x, dslope, drop in points:
        left = d + slope * (x - prev)  # d just left of x
        if left <= 0:  # d crosses 0 between prev and x
            break
        d, prev = left + drop, x
        if d <= 0:  # in the drop at x
            return x
        slope += dslope
    return prev + (d / -slope if slope < 0 else 0.0)


def _crossing_tensor(points: list, d0: float) -> float:
    """``_level``'s walk along its sorted breakpoints as tensor ops (one sort, cumulative sums):
    the same crossing, up to float rounding."""
    x, dslope, drop = torch.tensor(points, dtype=torch.float64).unbind(1)
    x, order = torch.sort(x, stable=True)
    dslope, drop = dslope[order], drop[order]
    slope = dslope.cumsum(0)  # the slope right of each breakpoint
    ramp = torch.cat([x.new_zeros(1), (slope[:-1] * x.diff()).cumsum(0)])
    right = d0 + ramp + drop.cumsum(0)  # d just right of each breakpoint
    left = right - drop  # and just left of it
    at_left, at_right = (left <= 0).nonzero(), (right <= 0).nonzero()
    if at_right.numel() == 0:  # beyond the last breakpoint: the last slope carries d to 0
        k = x.numel() - 1
    else:
        k2 = int(at_right[0])
        k1 = int(at_left[0]) if at_left.numel() else x.numel()
        if k2 < k1:  # d crosses 0 in a drop
            return float(x[k2])
        k = k1 - 1
        if k < 0:
            return float(x[0])
    s = float(slope[k])
    return float(x[k]) + (float(right[k]) / -s if s < 0 else 0.0)


def _matched(
    fill: WaterFill, offers: list, shed: list, room_W: list, order: list, cost_W: list, copy: float
) -> tuple[dict[int, list[int]], int]:
    """Place each donor's shed rows (``shed``: (donor, rows), in order) and move them
    (``WaterFill.shift``): first on the ranks that hold its expert g already or own it (no
    copy: up to their room), then on the receivers in ``order`` (total ascending), each new
    holder paying ``copy`` seconds of its room and a free replica slot. ``room_W``: seconds
    below the level per rank (used up as rows are placed, at ``cost_W`` per row). Returns
    ({g: new holders}, pieces moved)."""
    E, blk, slots = fill.E, fill.block, fill.slots
    new: dict[int, list[int]] = {}  # g -> its new holders this pass
    taken = [0] * fill.W  # replica slots taken this pass, per rank
    moved = j = 0
    cursors: dict[tuple[int, int], list] = {}  # (g, donor) -> its sources' order, first unused

    def place(offer: list, b: int, y: int, n: float, fresh: bool) -> float:
        """Move up to n rows of the offered expert from b to y; returns the rows moved."""
        nonlocal moved
        g, _, own = offer
        takes = _takes(fill, g, b, y, int(n), own, cursors)
        if not takes:
            return 0.0
        offer[2] = own - sum(m for s, m in takes if s == b)
        fill.shift(g, b, y, takes)
        moved += 1
        if fresh:
            new.setdefault(g, []).append(y)
            taken[y] += 1
        return float(sum(m for _, m in takes))

    def ask(rows: float) -> int:
        """Rows to ask a receiver to take: its room rounded to the nearest whole block (at
        least one: room for half a block or more takes a block, overshooting the level by at
        most half a block, so that the last few blocks of an excess still move)."""
        return max(blk, int(rows / blk + 0.5) * blk)

    for b, left in shed:
        for offer in offers[b]:  # the heaviest expert first, the next once its rows are out
            g = offer[0]
            o = g // E
            for y in [o, *fill.holders.get(g, ()), *new.get(g, ())]:  # no copy to pay
                if left < blk:
                    break
                if y == b or room_W[y] < 0.5 * blk * cost_W[y]:
                    continue
                n = place(offer, b, y, min(left, ask(room_W[y] / cost_W[y])), False)
                if not n:  # b's rows of g are used up
                    break
                left -= n
                room_W[y] -= n * cost_W[y]
            while left >= blk and j < len(order):
                y = order[j]
                room = room_W[y] - copy
                held = y == o or y in fill.holders.get(g, ()) or y in new.get(g, ())
                if held or fill.held[y] + taken[y] >= slots or room < 0.5 * blk * cost_W[y]:
                    j += 1  # full, or holds g already (placed above): the next receiver
                    continue
                n = place(offer, b, y, min(left, ask(room / cost_W[y])), True)
                if not n:  # b's rows of g are used up
                    break
                left -= n
                room_W[y] = room - n * cost_W[y]
                if room_W[y] < 0.5 * blk * cost_W[y]:
                    j += 1
            if left < blk:
                break
    return new, moved


def _takes(
    fill: WaterFill, g: int, b: int, y: int, need: int, own: int, cursors: dict
) -> list[tuple[int, int]]:
    """Up to ``need`` rows of g's segments at b for y, at whole blocks (a segment's rows left
    at b whole, which may end in its partial run, else whole blocks of them): y's own first
    (they turn local), the other sources' (by rows at b descending at the pass's start, then
    by rank: ``cursors[g, b]`` = [that order, the first one not used up]), then up to ``own`` of
    b's own rows."""
    blk = fill.block
    at_b = fill._where(g).get(b, {})
    out = []

    def cut(n: int) -> int:
        """Rows to take of a segment with n rows at b: all if they fit, else whole blocks."""
        return n if n <= need else need // blk * blk

    own_y = 0  # y's own rows taken first
    if y != b and at_b.get(y, 0):
        own_y = cut(at_b[y])
        if own_y:
            out.append((y, own_y))
            need -= own_y
    cursor = cursors.get((g, b))
    if cursor is None:
        # largest first, then by rank (two sorts in C: stable, so equal rows stay by rank)
        order = sorted(sorted(at_b), key=at_b.__getitem__, reverse=True)
        cursor = cursors[g, b] = [[s for s in order if s != b], 0]
    order, i = cursor
    while need >= blk and i < len(order):  # every segment before i is used up
        s = order[i]
        n = at_b.get(s, 0) - (own_y if s == y else 0)  # (y's own: all of it taken above)
        m = cut(n)
        if m:
            out.append((s, m))
            need -= m
        if m < n:  # this segment has rows left at b: the next piece starts here
            break
        i += 1
    cursor[1] = i
    whole = at_b.get(b, 0)
    own = min(own, whole)
    if own < whole:  # part of b's own segment: whole blocks only (its partial run stays)
        own = own // blk * blk
    if need >= blk and own:
        n = cut(own)
        if n:
            out.append((b, n))
    return out
