"""Water-filling: move 64-row blocks off the predicted bottleneck rank to helpers until balanced.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g; expert g is owned by rank o(g) = g // E). A segment (s, g) is the C[s][g] rows s routes
to g; ``at`` a rank r means r computes them.

``WaterFill`` starts from a candidate placement (replicas computing their own rows at the
source, the rest at the owner: ``Plan``'s replica rule) and, one ``step`` per move, repeats:

1. b = the predicted bottleneck (the first rank at the max total, ``StepModel.rank_total``);
2. b's heaviest expert g (the rows of g computed at b: as owner, or as a helper; by rows
   descending then id; the next one only when g cannot move); receivers y: the least-loaded
   rank (with the profile's topology the least-loaded one inside g's owner's node as well), the
   least-loaded holder of g's replica, and the source sending b the most rows of g (its rows
   would turn local);
3. for each (g, y) the block count is found where b's and y's totals cross (guessed from the
   totals' lines, checked at the guess and the next block, bisected when the guess misses),
   or y reaches the water level (the mean rank total; so b's rows spread over several helpers);
   rows are taken first from y's own segment (they turn local at y), then from other sources,
   largest first (b stops receiving them), then b's own rows (only while that lowers b: b must
   then send them); every cut is a whole number of ``block_size`` rows but a segment's last run;
4. a new holder gets the replica by the relay (``relay_degrees``: every holder's copies of the
   expert change, its rounds (at most 3) maybe for all) and needs a free replica slot
   (``slots`` per rank: the replica budget);
5. the (g, y) move with the lowest new max over the ranks it changes is accepted if every rank
   it changes stays strictly below b's total, else the search ends (nothing relieves b). A
   relay with more rounds adds their latency to every rank; that is not charged to the ranks
   a move does not change (the first replica would never pay where ranks tie at the max).

Speed (the plan runs every step): totals come from ``StepModel.total_fn`` (``rank_total`` with
the group flags bound, the same floats), probes on tuples and memoised per crossing search, each
(g, rank) segment order cached with its row sum and sort keys and updated by bisection when a
move changes it, a new holder's relay (``relay_degrees``) and the copies it changes cached per
(g, y) until g's holders change; a move costs ~0.07 ms
of Python at W = 64, ~0.15 ms at W = 256, ~0.3 ms at W = 1024 (every cache is checked
against a fresh computation: ``tests/placement/test_placement_planner_speed.py``).

Deterministic: ties by rank and expert id, no set or dict iteration order used for decisions.
The caller (``plan_mix``) bounds the moves, prices the result with the cost model
(``cost_model.plan_pricing``) and keeps it only if it beats the candidates it started from: the
guarantees (never worse than a2a or shadow) are the caller's, the search is a heuristic.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

import torch

from mixmoe.placement.cost_model import StepModel
from mixmoe.placement.relay import relay_degrees

__all__ = ["WaterFill"]


def _reorder(cached: list, s: int, old: int, new: int) -> None:
    """Source s's segment in a cached order (``WaterFill._ordered``: segments largest first then
    by source, beside their sort keys (-rows, source)) goes from ``old`` to ``new`` rows (0: not
    listed): one bisection of the keys out, one in, instead of sorting again (at W = 1024 a hot
    expert's owner holds ~W segments and every move changes a few)."""
    order, keys = cached[0], cached[2]
    if old:
        i = bisect_left(keys, (-old, s))
        del order[i], keys[i]
    if new:
        i = bisect_left(keys, (-new, s))
        order.insert(i, (s, new))
        keys.insert(i, (-new, s))


def _crossing(
    gap_end: float, gap_now: float, room_now: float, room_end: float, amount: int, blk: int
) -> int:
    """A guess at the last whole block of a group that fits, from its lines: b's lead over y
    falls from ``gap_now`` (no rows moved) to ``gap_end`` (all ``amount`` rows moved), y's room
    under the cap from ``room_now`` to ``room_end``; the block where the first one reaches 0,
    rounded down (0 when neither crosses)."""
    n = float(amount)
    if gap_end < 0.0 <= gap_now:
        n = min(n, amount * gap_now / (gap_now - gap_end))
    if room_end < 0.0 <= room_now:
        n = min(n, amount * room_now / (room_now - room_end))
    return int(n) // blk


class WaterFill:
    """The search state (see the module doc). rows/local/remote/replica: per-rank aggregates
    (``LOADS``; replica = relay copies, floats under the scatter) as lists, totals their seconds (with the
    group-wide flags any_remote and rounds); holders {g: ranks ascending}; held[r] replicas r
    holds; where {g: {r: {s: rows}}}: the rows of g computed at r by source, for the experts a
    move touched (built from the replica rule on first touch); owner_rows[g] rows of g at its
    owner; helped {r: {g: rows}} rows r computes for experts it does not own, as a helper."""

    def __init__(
        self,
        model: StepModel,
        C_WN: torch.Tensor,
        E: int,
        start_holders: dict[int, tuple[int, ...]],
        slots: int,
        block_size: int,
        distance: Callable[[int, int], int] | None,
        colsum_N: torch.Tensor,
        any_remote: bool,
    ) -> None:
        self.model, self.C_WN, self.E = model, C_WN, E
        self.W = C_WN.shape[0]
        self.slots, self.block = slots, block_size
        self.distance = distance
        self.any_remote = any_remote
        self.start = {g: frozenset(h) for g, h in start_holders.items()}
        self.holders = {g: sorted(h) for g, h in start_holders.items()}
        self.held = [0] * self.W
        for h in start_holders.values():
            for r in h:
                self.held[r] += 1
        self.where: dict[int, dict[int, dict[int, int]]] = {}
        self.runs: dict[tuple[int, int], dict[int, int]] = {}  # touched segments: {rank: rows}
        # (g, r): [g's segments at r, largest first then by source, their rows, sort keys],
        # kept up to date by each move
        self._order: dict[tuple[int, int], list] = {}
        self.helped: dict[int, dict[int, int]] = {}
        # rows each expert's owner computes: all of them but its start holders' own
        owner_rows = colsum_N.clone()
        for g, h in start_holders.items():
            owner_rows[g] -= int(C_WN[list(h), g].sum())
        self.owner_rows = owner_rows.tolist()
        self.degrees: dict[int, dict[int, int]] = {}
        self._totals_by_rounds: dict[int, Callable[[int, int, int, int], float]] = {}
        self._grow: dict[int, dict[int, tuple]] = {}  # g -> {y: _grown(g, y)}
        self.moves = 0

    def set_loads(self, loads: list[list[int]], loads_4W: torch.Tensor | None = None) -> None:
        """Per-rank (rows, local, remote, replica) of the start plan under relay pricing;
        ``loads_4W``: the same loads as a float64 [4, W] tensor, when the caller has it (the
        start totals are then ``StepModel.seconds_W``'s, the same floats as ``total_fn``'s, in
        a few tensor ops instead of W calls)."""
        self.rows, self.local, self.remote, self.replica = (list(x) for x in loads)
        depth = 0
        for g, h in self.holders.items():
            self.degrees[g], d = relay_degrees(g // self.E, h, self.distance)
            depth = max(depth, d)
        self.rounds = depth
        if loads_4W is not None:
            compute_W, comm_W = self.model.seconds_W(loads_4W, self.any_remote, depth)
            self.totals = (compute_W + comm_W).tolist()
            return
        total = self._total_fn(depth)
        self.totals = list(map(total, self.rows, self.local, self.remote, self.replica))

    def _total(self, r: int) -> float:
        return self._total_fn(self.rounds)(
            self.rows[r], self.local[r], self.remote[r], self.replica[r]
        )

    def _total_fn(self, rounds: int) -> Callable[[int, int, int, int], float]:
        """``StepModel.total_fn`` for this search's any_remote and ``rounds``, built once each."""
        fn = self._totals_by_rounds.get(rounds)
        if fn is None:
            fn = self._totals_by_rounds[rounds] = self.model.total_fn(self.any_remote, rounds)
        return fn

    def _where(self, g: int) -> dict[int, dict[int, int]]:
        """g's placement by rank and source, from the replica rule on first use."""
        placed = self.where.get(g)
        if placed is None:
            placed = self.where[g] = {}
            o, held = g // self.E, self.start.get(g, ())
            col = self.C_WN[:, g].tolist()
            for s, c in enumerate(col):
                if c:
                    home = s if (s == o or s in held) else o
                    placed.setdefault(home, {})[s] = c
        return placed

    # ---- one move -----------------------------------------------------------------------------

    def _ordered(self, g: int, b: int) -> list:
        """[g's segments (source, rows) at b, largest first then by source; their rows in all;
        their sort keys (-rows, source)]: sorted on first use, then updated by each move that
        changes g's rows at b (``apply``)."""
        cached = self._order.get((g, b))
        if cached is None:
            at_b = self._where(g).get(b, {})
            keys = sorted([(-n, s) for s, n in at_b.items()])  # largest first, then by source
            order = [(s, -k) for k, s in keys]
            cached = self._order[g, b] = [order, sum(at_b.values()), keys]
        return cached

    def _groups(self, g: int, b: int, y: int) -> list[tuple[int, list[tuple[int, int]], int]]:
        """g's rows at b as (source kind, [(source, rows), ...], rows) groups in the order they
        go: y's own (kind y: they turn local at y), the other sources (kind -1, largest first,
        then by rank: b stops receiving them; the list is b's whole order, in which ``_take``
        skips b and y), b's own (kind b: b must then send them)."""
        at_b = self._where(g).get(b, {})
        groups = []
        own_y, own_b = at_b.get(y, 0), at_b.get(b, 0) if b != y else 0
        if own_y:
            groups.append((y, [(y, own_y)], own_y))
        order, rows, _ = self._ordered(g, b)
        mid = rows - own_y - own_b  # the other sources' rows
        if mid:
            groups.append((-1, order, mid))
        if own_b:
            groups.append((b, [(b, own_b)], own_b))
        return groups

    def _take(
        self, segments: list[tuple[int, int]], need: int, skip: tuple[int, ...] = ()
    ) -> list[tuple[int, int]]:
        """Up to ``need`` rows from ``segments`` (in order, sources in ``skip`` left out): whole
        segments while they fit, then whole blocks of the next one. A whole segment at b may
        end in a partial block: b then holds that segment's only partial run (every other
        rank's share of a segment is whole blocks), which the receiver takes over."""
        out, blk = [], self.block
        for s, n in segments:
            if s in skip:
                continue
            if n <= need:
                out.append((s, n))
                need -= n
                continue
            part = need // blk * blk
            if part:
                out.append((s, part))
            break
        return out

    def evaluate(self, g: int, b: int, y: int, best: float, level: float = float("inf")):
        """The best move of g's rows from b to y (module doc, step 3-5): (new max over the
        changed ranks, takes [(source, rows)], changed {rank: loads}, g's tree grown by y
        (``_grown``) or None, rounds)
        or None when no move keeps every changed rank below ``best``."""
        E, blk = self.E, self.block
        o = g // E
        tree = None
        extra: dict[int, int] = {}  # tree edges gained (or lost) per rank
        rounds = self.rounds
        if y != o and y not in self.holders.get(g, ()):
            if self.held[y] >= self.slots:
                return None
            tree = self._grown(g, y)
            rounds, extra = max(self.rounds, tree[0]), tree[1]
        groups = self._groups(g, b, y)
        if not groups:
            return None
        total = self._total_fn(rounds)
        lb = (self.rows[b], self.local[b], self.remote[b], self.replica[b] + extra.get(b, 0))
        ly = (self.rows[y], self.local[y], self.remote[y], self.replica[y] + extra.get(y, 0))

        def moved(s: int, n: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
            """b's and y's loads after n more rows of source s move from b to y: b computes n
            fewer (b's own: it now sends them, else it no longer receives them), y n more (y's
            own turn local, else y receives them)."""
            b0, b1, b2, b3 = lb
            y0, y1, y2, y3 = ly
            t_lb = (b0 - n, b1 - n, b2 + n, b3) if s == b else (b0 - n, b1, b2 - n, b3)
            t_ly = (y0 + n, y1 + n, y2 - n, y3) if s == y else (y0 + n, y1, y2 + n, y3)
            return t_lb, t_ly

        takes: list[tuple[int, int]] = []
        tb_now, ty_now = total(*lb), total(*ly)  # b's and y's totals with ``takes`` moved
        ty0 = ty_now
        best_pair, best_takes, best_loads = max(tb_now, ty0), [], None
        # y fills up to the water level (the mean total; a rank above it only takes rows that
        # do not raise it), so that b's rows spread over several helpers instead of the first
        # one matching b
        cap = max(level, ty0)
        for s, segments, amount in groups:  # s: the source kind (y, b, or -1: another rank)
            skip = (b, y) if s == -1 else ()  # the other sources' group lists b's whole order
            t_lb, t_ly = moved(s, amount)
            tb, ty = total(*t_lb), total(*t_ly)
            if tb >= ty and ty <= cap:  # all of it moves and b is still the heavier one
                if max(tb, ty) < best_pair:
                    lb, ly, tb_now, ty_now = t_lb, t_ly, tb, ty
                    takes += [(src, n) for src, n in segments if src not in skip]
                    best_pair, best_takes, best_loads = max(tb, ty), list(takes), (lb, ly)
                    continue
                break  # rows of this kind do not relieve b (its own rows, when token-bound)
            # the totals cross inside this group: the last whole block k where b stays the
            # heavier one and y under the cap (``fits``), guessed where the totals' lines
            # cross, checked at k and k + 1, and bisected in what is left when the guess misses
            # (the totals bend where overlap hides all of a rank's traffic)
            hi = -(-amount // blk)
            probed: dict[int, tuple[float, float]] = {}  # rows moved -> (b's, y's totals)

            def totals_at(n: int, s: int = s, probed: dict = probed) -> tuple[float, float]:
                hit = probed.get(n)
                if hit is None:
                    t_lb, t_ly = moved(s, n)
                    hit = probed[n] = (total(*t_lb), total(*t_ly))
                return hit

            def fits(k: int, amount: int = amount) -> bool:
                tb_k, ty_k = totals_at(min(k * blk, amount))
                return tb_k >= ty_k and ty_k <= cap

            lo, k = 0, _crossing(tb - ty, tb_now - ty_now, cap - ty_now, cap - ty, amount, blk)
            if k < hi:  # a guess inside: one probe each side settles most searches
                if k == 0 or fits(k):  # (no block moved is the search's floor: no probe)
                    lo = k
                    if not fits(k + 1):
                        hi = k
                else:
                    hi = k - 1
            while lo < hi:  # bisection: lo fits (or is 0), the answer is in [lo, hi]
                mid = (lo + hi + 1) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid - 1
            for k in (lo, lo + 1):
                part = self._take(segments, min(k * blk, amount), skip)
                n = sum(m for _, m in part)
                if n <= 0:
                    continue
                m = max(totals_at(n))  # mostly probed already: a cut at k whole blocks
                if m < best_pair:
                    best_pair, best_takes, best_loads = m, takes + part, moved(s, n)
            break
        if not best_takes:
            return None
        changed = {b: tuple(best_loads[0]), y: tuple(best_loads[1])}
        new_max = best_pair
        for r, d in extra.items():
            if r not in changed:
                ld = (self.rows[r], self.local[r], self.remote[r], self.replica[r] + d)
                changed[r] = ld
                new_max = max(new_max, total(*ld))
        # a deeper tree adds its rounds' latency to every rank: not charged here (the first
        # replica would otherwise never pay where several ranks tie at the max); the caller's
        # final pricing of the whole plan decides whether the balanced plan is kept
        if not new_max < best:
            return None
        return new_max, best_takes, changed, tree, rounds

    def _grown(self, g: int, y: int) -> tuple[int, dict[int, float], list[int], dict]:
        """g's relay with y added as a holder: (its rounds, the copies each rank gains or loses
        {rank: copies}, the holders ascending, {rank: copies}: ``relay_degrees``), cached until
        g's holders change (the same (g, y) is tried again in many moves while b sheds g's
        rows)."""
        grown = self._grow.get(g)
        if grown is None:
            grown = self._grow[g] = {}
        hit = grown.get(y)
        if hit is None:
            holders, old = self.holders.get(g, ()), self.degrees.get(g, {})
            h = sorted([*holders, y])
            degrees, depth = relay_degrees(g // self.E, h, self.distance)
            extra = {}
            for r in sorted(set(degrees) | set(old)):
                if degrees.get(r, 0) != old.get(r, 0):
                    extra[r] = degrees.get(r, 0) - old.get(r, 0)
            hit = grown[y] = (depth, extra, h, degrees)
        return hit

    def apply(self, g: int, b: int, y: int, move) -> None:
        """Commit a move ``evaluate`` returned."""
        _, takes, changed, tree, rounds = move
        for r, ld in changed.items():
            self.rows[r], self.local[r], self.remote[r], self.replica[r] = ld
        if tree is not None:
            _, _, h, degrees = tree
            self.holders[g], self.degrees[g] = h, degrees
            self.held[y] += 1
            self._grow.pop(g, None)  # trees grown from g's old holders
        self._move_rows(g, b, y, takes)
        if rounds != self.rounds:  # a deeper tree: every rank pays the new rounds' latency
            self.rounds = rounds
            self.retotal()
        else:
            for r in changed:
                self.totals[r] = self._total(r)
        self.moves += 1

    def _move_rows(
        self, g: int, b: int, y: int, takes: list[tuple[int, int]], reorder: bool = True
    ) -> None:
        """g's segment runs (``takes``: [(source, rows)]) from b to y in the placement: runs,
        by-source rows, owner and helper rows (not the loads), and the cached orders of g at b
        and y: updated segment by segment (``reorder``), else dropped (a batched move takes
        hundreds of segments: sorting once on next use costs less)."""
        placed = self._where(g)
        at_b, at_y = placed[b], placed.setdefault(y, {})
        moved = 0
        if not reorder:  # sorted again on next use (``_ordered``)
            self._order.pop((g, b), None)
            self._order.pop((g, y), None)
        order_b, order_y = self._order.get((g, b)), self._order.get((g, y))
        for s, n in takes:
            runs = self.runs.get((s, g))
            if runs is None:  # first touch: the whole segment is at b, where the rule put it
                runs = self.runs[s, g] = {b: at_b[s]}
            runs[b] -= n
            if not runs[b]:
                del runs[b]
            runs[y] = runs.get(y, 0) + n
            old_b, old_y = at_b[s], at_y.get(s, 0)
            at_b[s] = old_b - n
            if not at_b[s]:
                del at_b[s]
            at_y[s] = old_y + n
            moved += n
            if order_b is not None:
                _reorder(order_b, s, old_b, old_b - n)
            if order_y is not None:
                _reorder(order_y, s, old_y, old_y + n)
        if order_b is not None:
            order_b[1] -= moved
        if order_y is not None:
            order_y[1] += moved
        o = g // self.E
        for r, n in ((b, -moved), (y, moved)):
            if r == o:
                self.owner_rows[g] += n
            else:
                helped = self.helped.setdefault(r, {})
                helped[g] = helped.get(g, 0) + n
                if not helped[g]:
                    del helped[g]

    # ---- batched moves (``mixmoe.placement.level_fill``) --------------------------------------

    def shift(self, g: int, b: int, y: int, takes: list[tuple[int, int]]) -> None:
        """Move ``takes`` [(source, rows)] of g's rows at b to y, loads included (as ``evaluate``
        counts them); the totals and the relay are left to ``grow`` and ``retotal``. y must own
        g or hold its replica (``grow``) by the time the plan is built."""
        rows, local, remote = self.rows, self.local, self.remote
        for s, n in takes:
            rows[b] -= n
            if s == b:  # b's own rows: it now sends them
                local[b] -= n
                remote[b] += n
            else:  # another source's: b no longer receives them
                remote[b] -= n
            rows[y] += n
            if s == y:  # y's own rows turn local at y
                local[y] += n
                remote[y] -= n
            else:
                remote[y] += n
        self._move_rows(g, b, y, takes, reorder=False)

    def grow(self, g: int, new: list[int]) -> None:
        """Ranks ``new`` (neither g's owner nor its holders; each with a free replica slot)
        become holders of g: g's relay (``relay_degrees``) priced once for all of them, the
        copies it changes on every rank, the slots and the rounds."""
        old = self.degrees.get(g, {})
        holders = sorted([*self.holders.get(g, ()), *new])
        degrees, depth = relay_degrees(g // self.E, holders, self.distance)
        for r in sorted(set(degrees) | set(old)):  # copies on the relay's grid: exact sums
            self.replica[r] += degrees.get(r, 0) - old.get(r, 0)
        self.holders[g], self.degrees[g] = holders, degrees
        for y in new:
            self.held[y] += 1
        self._grow.pop(g, None)  # trees grown from g's old holders
        self.rounds = max(self.rounds, depth)

    def retotal(self) -> None:
        """Every rank's total from its loads (after batched moves or deeper rounds)."""
        total = self._total_fn(self.rounds)
        self.totals = list(map(total, self.rows, self.local, self.remote, self.replica))

    # ---- the search ---------------------------------------------------------------------------

    def run(self, moves: int, beat: float, stop: float) -> None:
        """Up to ``moves`` moves (``step``), stopping once the water level (the mean rank
        total) reaches ``beat``, once the max is within ``stop`` times the level, or once the
        bottleneck cannot be relieved."""
        W = self.W
        for _ in range(moves):
            totals = self.totals
            level, best = sum(totals) / W, max(totals)
            if level >= beat or best <= stop * level or not self._step(best, level):
                break

    def step(self) -> bool:
        """One move (module doc); False when the bottleneck cannot be relieved."""
        totals = self.totals
        return self._step(max(totals), sum(totals) / len(totals))

    def _step(self, best: float, level: float) -> bool:
        """``step`` given the max rank total ``best`` and the level (the mean total)."""
        totals = self.totals
        b = totals.index(best)  # the first max: the lowest bottleneck rank
        E = self.E
        mine = [(self.owner_rows[g], g) for g in range(b * E, (b + 1) * E)]
        mine += [(n, g) for g, n in self.helped.get(b, {}).items()]
        heavy = sorted((p for p in mine if p[0] > 0), key=lambda p: (-p[0], p[1]))[:2]
        chosen = None
        low = min(totals)
        least = totals.index(low)  # the first rank at the min: not b unless all ranks tie
        if least == b:
            least = min((r for r in range(self.W) if r != b), key=totals.__getitem__, default=None)
        for _, g in heavy:  # the heaviest expert first; the next only if it cannot move
            for y in self._receivers(g, b, least):
                move = self.evaluate(g, b, y, best, level)
                if move is not None and (chosen is None or move[0] < chosen[0][0]):
                    chosen = (move, g, y)
            if chosen is not None:
                break
        if chosen is None:
            return False
        move, g, y = chosen
        self.apply(g, b, y, move)
        return True

    def _receivers(self, g: int, b: int, least_all: int | None) -> list[int]:
        """Receivers tried for g's rows at b (module doc, step 2), without repeats;
        ``least_all``: the least-loaded rank but b (the first by rank among equals)."""
        totals, o = self.totals, g // self.E

        def least(ranks) -> int | None:
            return min((r for r in ranks if r != b), key=lambda r: (totals[r], r), default=None)

        out = [least_all]
        if self.distance is not None:  # inside the owner's node
            out.append(least(r for r in range(self.W) if self.distance(o, r) == 0))
        out.append(least([*self.holders.get(g, ()), o]))
        # the source sending b the most rows of g (ties: the lowest rank): b's order's first
        for s, _ in self._ordered(g, b)[0]:
            if s != b:
                out.append(s)
                break
        seen: list[int] = []
        for y in out:
            if y is not None and y not in seen:
                seen.append(y)
        return seen

    def shares(self) -> tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]:
        """Share entries of the segments whose placement differs from the replica rule of the
        final holders: whole-block runs first (by rank), the partial run last."""
        E, blk = self.E, self.block
        segs = dict(self.runs)
        # a new holder's own rows left where they were: the replica rule would move them to it
        for g, holders in self.holders.items():
            new = set(holders) - self.start.get(g, frozenset())
            col = self.C_WN[:, g].tolist() if new else ()
            for h in sorted(new):
                if col[h] and (h, g) not in segs:
                    segs[h, g] = {self._home(h, g): col[h]}
        out = []
        held = {g: set(h) for g, h in self.holders.items()}
        for key in sorted(segs):  # the (s, g) keys alone: ~3x faster than sorting the items
            s, g = key
            placed = segs[key]
            o = g // E
            rule = s if (s == o or s in held.get(g, ())) else o
            if 0 in placed.values():  # (a move never leaves an empty run: defensive)
                placed = {r: n for r, n in placed.items() if n}
            if len(placed) == 1:
                if rule in placed:
                    continue
                out.append((s, g, tuple(placed.items())))
                continue
            runs = sorted(placed.items(), key=lambda p: (p[1] % blk != 0, p[0]))
            out.append((s, g, tuple(runs)))
        return tuple(out)

    def _home(self, s: int, g: int) -> int:
        """Where the start plan's replica rule computes segment (s, g)."""
        o = g // self.E
        return s if (s == o or s in self.start.get(g, ())) else o
