"""A batched water-fill: every rank above the water level sheds rows in the same pass.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g; expert g is owned by rank g // E). T_W: the rank totals (s) of a ``RangeState``;
a = seconds per row computed, t = seconds per row exchanged (``StepModel``'s terms).

``WaterFill``'s move-by-move search prices every candidate (expert, receiver) move in Python: its
steps grow with the helpers a plan needs (~W at W = 1024). ``level_fill`` runs a few passes over
a ``RangeState`` (rows per (expert, helper), no segments: ``mixmoe.placement.range_state``), each:

1. offers: every rank b offers its ``OFFERED`` heaviest experts (rows computed at b, as owner
   or helper; by rows, then id), and the next ones, up to ``OFFERED_MAX``, while the rows
   offered fall short of b's excess over the mean ((T_b - mean) / save_b: a rank owning many
   hot experts of about equal load, e.g. 32 of them holding half of all rows, needs more of
   them moving than 4 a pass over a few passes would let go): as owner, the other sources'
   rows of each, plus b's own while its token exchange is hidden under its local compute (they
   lower b only then); as a helper, its rows. b saves a per row, a + t while its exchange is
   exposed (it no longer receives them); a receiver pays a + t per row and, unless it holds
   the expert already, a new replica's ~2 copies (scatter + all-gather);
2. the level L (``_level``): the rows shed above it (each rank's offers down to L) plus one copy
   per donor whose heaviest expert has no holder yet equal the rows absorbed below it (each
   rank's room under L less a copy; after a pass that gained less than ``MIN_GAIN``, no copy
   for the owners and holders of the experts offered above the mean: their room first). Every
   term is piecewise linear in L: one sort of ~3W breakpoints and a walk (tensor ops above
   ``TENSOR_POINTS``), not a step per move;
3. pieces (``_matched``): each donor above L (total descending) sheds (T_b - L) / save_b rows,
   its heaviest expert first: on the ranks that own or hold it (no copy), then on the ranks
   below L - copy in total order (each new holder pays its copies out of its room, computes
   its own rows of the expert from then on (with ``kept``: as many whole blocks of them as
   its room takes, the rest stay in the stream, ``Plan.kept``), and needs a free replica
   slot), the next expert
   once its rows are out. Pieces are asked to the nearest whole block; which segments they
   are is left to the plan (``RangeState.plan_fields``: ranges of each expert's stream);
4. each expert's relay priced once for its new holders (``RangeState.relay``), then every
   total recomputed (``RangeState.retotal``).

The passes stop once the max total is within ``stop`` of the mean, after a pass lowering the
max by less than ``MIN_GAIN`` once the level counts no copies for the holders (the first such
pass switches to that level), or after ``passes``; and once the mean reaches ``beat``, the step
the caller's fill must beat (its max, the fill's step, is never below its mean, and moves add
copies and exchanged rows: the mean only rises in practice). Such a fill is *beaten*
(``RangeState.beaten``): the planner drops it unpriced (in ``bench balance``'s 240 plans, a
third of the fills under nodes and a tenth on one link stopped so, every plan the same). The
rates are estimates (each total's kink,
where its exchange turns hidden or exposed, is ignored inside a pass); the loads are exact for
the amounts moved, and the plan (amounts cut at whole blocks) is priced again by the caller
(``cost_model.plan_pricing``), who keeps it only when cheaper than its candidates.
Deterministic: ties by rank and expert id. Python work per pass: O(W) list steps plus one per
piece (an (expert, helper) pair), not one per segment.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import torch

from mixmoe.placement.cost_model import TOKEN_COLLECTIVES
from mixmoe.placement.range_state import RangeState

__all__ = ["MIN_GAIN", "is_level", "level_fill"]

OFFERED = 4  # experts a rank offers per pass, heaviest first, at least (those its rows hold)
OFFERED_MAX = 16  # and at most, more only while the rows offered fall short of its excess
MIN_GAIN = 0.005  # the passes stop after one lowering the max by less than this fraction
TENSOR_POINTS = 384  # ``_level``: more breakpoints than this are walked as tensor ops


def level_fill(
    fill: RangeState, passes: int, stop: float, kept: bool = False, beat: float = float("inf")
) -> int:
    """Run up to ``passes`` batched passes (module doc) on ``fill``'s state; returns the
    pieces moved (0: the state is unchanged). ``stop``: no pass once max(T) <= stop * mean(T).
    ``kept``: a new holder whose own rows of the expert would take it past the level keeps
    only the whole blocks that fit (``Plan.kept``); False: all of them (past the level).
    ``beat``: no pass once mean(T) >= beat, the fill then ``beaten`` (module doc)."""
    model = fill.model
    a = model.flops_per_row / model.gemm_flops + model.row_s  # seconds per row computed
    t = model.token_bytes_per_row / model.bw if fill.any_remote else 0.0  # per row exchanged
    hide = a if model.overlap else 0.0  # a local row hides this much of the token exchange
    copy = 2.0 * (model.params_bytes / model.bw + model.replica_s)  # a new holder's ~2 copies
    lat = TOKEN_COLLECTIVES * model.lat
    W, E, slots = fill.W, fill.E, fill.slots
    cost_W = [a + t] * W  # a receiver's rate: its hidden slack (if any) is left as a margin
    pieces = 0
    free = False  # whether the level counts no copy for the ranks holding an offered expert
    for _ in range(passes):
        T_W = fill.totals
        top, mean = max(T_W), fold_sum(T_W) / W
        if is_level(T_W, stop):
            break
        # each rank's token exchange before the max(0, .): > 0 when exposed
        token_W = [lat + t * rm - hide * lc for rm, lc in zip(fill.remote, fill.local, strict=True)]
        # only a rank above the mean offers (the level is above the mean but where the offers
        # run out: shed rows cost a receiver at least what they save their donor)
        save_W = [a + t if token_W[b] > 0 and t else a for b in range(W)]
        offers, avail_W = [], []  # each rank's offers, and the rows they hold in all
        for b in range(W):
            if T_W[b] > mean:  # the rows b sheds to come down to the mean: its offers' goal
                need = (T_W[b] - mean) / save_W[b] if save_W[b] > 0 else float("inf")
                offer, avail = _offer(fill, b, token_W[b], t, hide, need)
            else:
                offer, avail = [], 0
            offers.append(offer)
            avail_W.append(avail)
        start_W = [T_W[r] + copy if fill.held[r] < slots else float("inf") for r in range(W)]
        if free:  # the owners and holders of the experts offered (above the mean): no copy
            for b in range(W):
                for o in offers[b]:
                    g = o[0]
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
        blk = fill.block
        for b in sorted(range(W), key=lambda r: (-T_W[r], r)):
            if T_W[b] <= L:
                break
            n = min(avail_W[b], (T_W[b] - L) / save_W[b])
            if n >= 0.5 * blk:  # to the nearest whole block (at least one)
                shed.append((b, max(blk, int(n / blk + 0.5) * blk)))
        room_W = [max(0.0, L - x) for x in T_W]  # seconds each rank may take on
        order = sorted((r for r in range(W) if start_W[r] < L), key=lambda r: (T_W[r], r))
        new, moved = _matched(fill, offers, shed, room_W, order, cost_W, copy, a, kept)
        for g in sorted(new):
            fill.relay(g)
        if moved:
            fill.retotal()
        pieces += moved
        if fold_sum(fill.totals) / W >= beat:  # its max cannot come below beat (module doc)
            fill.beaten = True
            break
        if max(fill.totals) > (1.0 - MIN_GAIN) * top:  # this pass gained little
            if free or not (moved or any(fill.holders.values())):
                break  # (no holder anywhere: the level without their copies is the same)
            free = True  # the level without copies for the holders: their room first
    return pieces


def is_level(T_W: list[float], stop: float) -> bool:
    """Whether totals ``T_W`` are level for a fill: max <= ``stop`` * mean (the mean added left
    to right, ``fold_sum``); a pass starts only from totals that are not."""
    return max(T_W) <= stop * (fold_sum(T_W) / len(T_W))


def fold_sum(xs: Iterable[float]) -> float:
    """The floats added left to right from 0.0: Python 3.11's ``sum``, which Python >= 3.12
    replaced by a compensated sum; the compiled fill (``native/level_fill.cpp``) adds the same
    way, so the two agree bit for bit on every Python."""
    return functools.reduce(operator.add, xs, 0.0)


def _offer(
    fill: RangeState, b: int, token: float, t: float, hide: float, need: float
) -> tuple[list, int]:
    """([[g, own rows allowed, own rows given at the offer], ...], the rows they hold in all
    (``_cap``)) rank b offers: its ``OFFERED`` heaviest experts (rows computed at b, as owner
    or helper; by rows descending, then id), then the next ones while the rows they hold are
    below ``need``, up to ``OFFERED_MAX`` in all. As g's owner b may shed the other sources'
    rows of g it computes and up to the allowed of its own: those that lower b when moved
    (while its token exchange stays hidden: up to -token / (t + hide) rows in all, heaviest
    expert first); as a helper, its amount."""
    E = fill.E
    rows = [(-n, g) for g in range(b * E, (b + 1) * E) if (n := fill.owner_rows[g]) > 0]
    rows += [(-n, g) for g, n in fill.helped.get(b, {}).items() if n > 0]
    rows.sort()  # heaviest first, then by id
    # hidden: b's own rows lower it until its exchange shows
    headroom = int(-token / (t + hide)) if token < 0 and t + hide > 0 else 0
    out, avail = [], 0
    for i, (n, g) in enumerate(rows[:OFFERED_MAX]):
        if i >= OFFERED and avail >= need:  # the heaviest hold the rows b sheds at most
            break
        if g // E != b:  # as a helper: all its rows of g
            out.append([g, 0, 0])
            avail -= n
            continue
        others, taken = fill.others[g], fill.taken[g]
        given = max(0, taken - others)
        mine = min(fill.own[g] - given, headroom)  # of b's own rows of g it still computes
        headroom -= mine
        out.append([g, mine, given])
        avail += max(0, others - taken) + mine
    return out, avail


def _cap(fill: RangeState, b: int, offer: list) -> int:
    """Rows of the offered expert b may still shed (``_offer``)."""
    g, mine, given = offer
    if g // fill.E != b:  # a helper: its amount
        return fill.amounts.get(g, {}).get(b, 0)
    now = max(0, fill.taken[g] - fill.others[g])  # own rows given by now
    return max(0, fill.others[g] - fill.taken[g]) + max(0, given + mine - now)


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
    jump = copy * len(cost_W) / fold_sum(cost_W)
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
    fill: RangeState,
    offers: list,
    shed: list,
    room_W: list,
    order: list,
    cost_W: list,
    copy: float,
    a: float,
    kept: bool,
) -> tuple[dict[int, list[int]], int]:
    """Place each donor's shed rows (``shed``: (donor, rows), in order) and move them
    (``RangeState.move``): first on the ranks that hold its expert g already or own it (no
    copy: up to their room), then on the receivers in ``order`` (total ascending; with the
    profile's topology those in g's owner's node first: its replica crosses no slow link), each
    new holder paying ``copy`` seconds of its room, its own rows of g (they turn local: ``a``
    per row, the sends they save left as a margin; with ``kept``, when they do not all fit,
    only the whole blocks that do: a *kept* holder, the rest of its rows staying in g's
    stream, none when not one block fits) and a free replica slot. A kept holder among g's holders takes back
    its own rows first (from the owner only; ``RangeState.keep_more``), none of the stream's. ``room_W``: seconds
    below the level per rank (used up as rows are placed, at ``cost_W`` per row). Returns
    ({g: new holders}, pieces moved)."""
    E, blk, slots = fill.E, fill.block, fill.slots
    new: dict[int, list[int]] = {}  # g -> its new holders this pass
    moved = 0
    # receiver queues, each [ranks in total order, the first one not used up]: every rank's,
    # and with a topology each node's (``order`` split by node)
    queues: dict[int, list] = {-1: [order, 0]}
    per_node = getattr(fill.distance, "ranks_per_node", None)
    if per_node:
        for y in order:
            queues.setdefault(y // per_node, [[], 0])[0].append(y)

    def ask(rows: float) -> int:
        """Rows to ask a receiver to take: its room rounded to the nearest whole block (at
        least one: room for half a block or more takes a block, overshooting the level by at
        most half a block, so that the last few blocks of an excess still move)."""
        return max(blk, int(rows / blk + 0.5) * blk)

    for b, left in shed:
        for offer in offers[b]:  # the heaviest expert first, the next once its rows are out
            g = offer[0]
            o = g // E
            for y in [o, *fill.holders.get(g, ())]:  # no copy to pay
                if left < blk:
                    break
                if y == b or room_W[y] < 0.5 * blk * cost_W[y]:
                    continue
                rest = fill.kept_rest(g, y)
                if rest:  # a kept holder takes back its own rows (local: a per row), no others
                    if b == o and room_W[y] >= 0.5 * blk * a:
                        k = min(rest, left, ask(room_W[y] / a), _cap(fill, b, offer))
                        if k > 0:
                            fill.keep_more(g, y, k)
                            moved += 1
                            left -= k
                            room_W[y] -= k * a
                    continue
                n = min(left, ask(room_W[y] / cost_W[y]), _cap(fill, b, offer))
                if n <= 0:  # b's rows of g are used up
                    break
                fill.move(g, b, y, n)
                moved += 1
                left -= n
                room_W[y] -= n * cost_W[y]
            near = [queues[o // per_node]] if per_node and o // per_node in queues else []
            for queue in [*near, queues[-1]]:
                ranks = queue[0]
                while left >= blk and queue[1] < len(ranks):
                    y = ranks[queue[1]]
                    room = room_W[y] - copy
                    held = y == o or y in fill.holders.get(g, ())
                    if held or fill.held[y] >= slots or room < 0.5 * blk * cost_W[y]:
                        queue[1] += 1  # full, or holds g already (placed above): the next one
                        continue
                    if _cap(fill, b, offer) <= 0:  # b's rows of g are used up
                        break
                    own = fill.rows_of(y, g)  # y's own rows of g: local at y once it holds g
                    if own * a > room:  # all of them would take y past the level
                        fill.overshot.add(y)
                    if kept and own * a > room:  # the whole blocks that fit
                        own = int(room / a) // blk * blk
                        if own == 0:
                            queue[1] += 1
                            continue
                        fill.add_holder(g, y, own)  # y kept: its other rows stay in the stream
                    else:
                        fill.add_holder(g, y)
                    new.setdefault(g, []).append(y)
                    room -= own * a
                    if b == o:  # the owner computes y's own rows no more
                        left -= own
                    n = min(left, ask(room / cost_W[y]), _cap(fill, b, offer))
                    if n > 0 and not fill.kept_rest(g, y):
                        fill.move(g, b, y, n)
                        left -= n
                        room -= n * cost_W[y]
                    moved += 1
                    room_W[y] = room
                    if room_W[y] < 0.5 * blk * cost_W[y]:
                        queue[1] += 1
            if left < blk:
                break
    return new, moved
