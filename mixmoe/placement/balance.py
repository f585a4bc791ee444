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
3. for each (g, y) the block count is found by bisection: up to where b's and y's totals cross,
   or y reaches the water level (the mean rank total; so b's rows spread over several helpers);
   rows are taken first from y's own segment (they turn local at y), then from other sources,
   largest first (b stops receiving them), then b's own rows (only while that lowers b: b must
   then send them); every cut is a whole number of ``block_size`` rows but a segment's last run;
4. a new holder gets the replica by the relay tree (``relay_degrees``: the tree's edges change
   for a few ranks, maybe its rounds for all) and needs a free replica slot (``slots`` per
   rank: the replica budget);
5. the (g, y) move with the lowest new max over the ranks it changes is accepted if every rank
   it changes stays strictly below b's total, else the search ends (nothing relieves b). A
   deeper relay tree adds its rounds' latency to every rank; that is not charged to the ranks
   a move does not change (the first replica would never pay where ranks tie at the max).

Deterministic: ties by rank and expert id, no set or dict iteration order used for decisions.
The caller (``plan_mix``) bounds the moves, prices the result with the cost model
(``cost_model.plan_pricing``) and keeps it only if it beats the candidates it started from: the
guarantees (never worse than a2a or shadow) are the caller's, the search is a heuristic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mixmoe.placement.cost_model import StepModel
from mixmoe.placement.relay import relay_degrees

__all__ = ["WaterFill"]


def _larger_first(segment: tuple[int, int]) -> tuple[int, int]:
    return -segment[1], segment[0]


class WaterFill:
    """The search state (see the module doc). rows/local/remote/replica: per-rank aggregates
    (``LOADS``; replica = relay tree edges) as lists of ints, totals their seconds (with the
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
        self._order: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (g, r): sorted at r
        self.helped: dict[int, dict[int, int]] = {}
        # rows each expert's owner computes: all of them but its start holders' own
        owner_rows = colsum_N.clone()
        for g, h in start_holders.items():
            owner_rows[g] -= int(C_WN[list(h), g].sum())
        self.owner_rows = owner_rows.tolist()
        self.degrees: dict[int, dict[int, int]] = {}
        self.moves = 0

    def set_loads(self, loads: list[list[int]]) -> None:
        """Per-rank (rows, local, remote, replica) of the start plan under relay pricing."""
        self.rows, self.local, self.remote, self.replica = (list(x) for x in loads)
        depth = 0
        for g, h in self.holders.items():
            self.degrees[g], d = relay_degrees(g // self.E, h, self.distance)
            depth = max(depth, d)
        self.rounds = depth
        self.totals = [self._total(r) for r in range(self.W)]

    def _total(self, r: int) -> float:
        return self.model.rank_total(
            self.rows[r],
            self.local[r],
            self.remote[r],
            self.replica[r],
            self.any_remote,
            self.rounds,
        )

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

    def _groups(self, g: int, b: int, y: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """g's rows at b as (source kind, [(source, rows), ...]) groups in the order they go:
        y's own (kind y: they turn local at y), the other sources (kind -1, largest first, then
        by rank: b stops receiving them), b's own (kind b: b must then send them)."""
        at_b = self._where(g).get(b, {})
        groups = []
        if at_b.get(y):
            groups.append((y, [(y, at_b[y])]))
        order = self._order.get((g, b))
        if order is None:  # cached until a move changes g's rows at b
            order = self._order[g, b] = sorted(at_b.items(), key=_larger_first)
        mid = [(s, n) for s, n in order if s != b and s != y]
        if mid:
            groups.append((-1, mid))
        if at_b.get(b) and b != y:
            groups.append((b, [(b, at_b[b])]))
        return groups

    def _take(self, segments: list[tuple[int, int]], need: int) -> list[tuple[int, int]]:
        """Up to ``need`` rows from ``segments`` (in order): whole segments while they fit,
        then whole blocks of the next one. A whole segment at b may end in a partial block: b
        then holds that segment's only partial run (every other rank's share of a segment is
        whole blocks), which the receiver takes over."""
        out, blk = [], self.block
        for s, n in segments:
            if n <= need:
                out.append((s, n))
                need -= n
                continue
            part = need // blk * blk
            if part:
                out.append((s, part))
            break
        return out

    @staticmethod
    def _delta(b: int, y: int, s: int, n: int, lb: list[int], ly: list[int]) -> None:
        """Moving n rows of source s from b to y, on the loads lb of b and ly of y."""
        lb[0] -= n
        ly[0] += n
        if s == b:  # b's own rows: b now sends them
            lb[1] -= n
            lb[2] += n
        else:  # b no longer receives (and returns) them
            lb[2] -= n
        if s == y:  # y's own rows: local at y, no longer sent
            ly[1] += n
            ly[2] -= n
        else:  # y receives them from s
            ly[2] += n

    def evaluate(self, g: int, b: int, y: int, best: float, level: float = float("inf")):
        """The best move of g's rows from b to y (module doc, step 3-5): (new max over the
        changed ranks, takes [(source, rows)], changed {rank: loads}, new tree or None, rounds)
        or None when no move keeps every changed rank below ``best``."""
        E, blk = self.E, self.block
        o = g // E
        tree = None
        extra: dict[int, int] = {}  # tree edges gained (or lost) per rank
        rounds = self.rounds
        if y != o and y not in self.holders.get(g, ()):
            if self.held[y] >= self.slots:
                return None
            h = sorted([*self.holders.get(g, ()), y])
            degrees, depth = relay_degrees(o, h, self.distance)
            old = self.degrees.get(g, {})
            tree, rounds = (h, degrees, depth), max(self.rounds, depth)
            for r in sorted(set(degrees) | set(old)):
                if degrees.get(r, 0) != old.get(r, 0):
                    extra[r] = degrees.get(r, 0) - old.get(r, 0)
        groups = self._groups(g, b, y)
        if not groups:
            return None
        total, any_remote = self.model.rank_total, self.any_remote
        lb = [self.rows[b], self.local[b], self.remote[b], self.replica[b] + extra.get(b, 0)]
        ly = [self.rows[y], self.local[y], self.remote[y], self.replica[y] + extra.get(y, 0)]

        def pair(lb: list[int], ly: list[int]) -> tuple[float, float]:
            return total(*lb, any_remote, rounds), total(*ly, any_remote, rounds)

        def moved(s: int, n: int) -> tuple[list[int], list[int]]:
            t_lb, t_ly = list(lb), list(ly)
            self._delta(b, y, s, n, t_lb, t_ly)
            return t_lb, t_ly

        takes: list[tuple[int, int]] = []
        best_pair, best_takes, best_loads = max(pair(lb, ly)), [], None
        # y fills up to the water level (the mean total; a rank above it only takes rows that
        # do not raise it), so that b's rows spread over several helpers instead of the first
        # one matching b
        cap = max(level, total(*ly, any_remote, rounds))
        for s, segments in groups:  # s: the group's source kind (y, b, or -1: another rank)
            amount = sum(n for _, n in segments)
            t_lb, t_ly = moved(s, amount)
            tb, ty = pair(t_lb, t_ly)
            if tb >= ty and ty <= cap:  # all of it moves and b is still the heavier one
                if max(tb, ty) < best_pair:
                    lb, ly = t_lb, t_ly
                    takes += segments
                    best_pair, best_takes, best_loads = max(tb, ty), list(takes), (lb, ly)
                    continue
                break  # rows of this kind do not relieve b (its own rows, when token-bound)
            # the totals cross inside this group: bisect over whole blocks (lo keeps tb >= ty)
            lo, hi = 0, -(-amount // blk)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                a, c = pair(*moved(s, min(mid * blk, amount)))
                if a >= c and c <= cap:
                    lo = mid
                else:
                    hi = mid - 1
            for k in (lo, lo + 1):
                part = self._take(segments, min(k * blk, amount))
                n = sum(m for _, m in part)
                if n <= 0:
                    continue
                t_lb, t_ly = moved(s, n)
                m = max(pair(t_lb, t_ly))
                if m < best_pair:
                    best_pair, best_takes, best_loads = m, takes + part, (t_lb, t_ly)
            break
        if not best_takes:
            return None
        changed = {b: tuple(best_loads[0]), y: tuple(best_loads[1])}
        new_max = best_pair
        for r, d in extra.items():
            if r not in changed:
                ld = (self.rows[r], self.local[r], self.remote[r], self.replica[r] + d)
                changed[r] = ld
                new_max = max(new_max, total(*ld, any_remote, rounds))
        # a deeper tree adds its rounds' latency to every rank: not charged here (the first
        # replica would otherwise never pay where several ranks tie at the max); the caller's
        # final pricing of the whole plan decides whether the balanced plan is kept
        if not new_max < best:
            return None
        return new_max, best_takes, changed, tree, rounds

    def apply(self, g: int, b: int, y: int, move) -> None:
        """Commit a move ``evaluate`` returned."""
        _, takes, changed, tree, rounds = move
        for r, ld in changed.items():
            self.rows[r], self.local[r], self.remote[r], self.replica[r] = ld
        if tree is not None:
            h, degrees, _ = tree
            self.holders[g], self.degrees[g] = h, degrees
            self.held[y] += 1
        placed = self._where(g)
        at_b, at_y = placed[b], placed.setdefault(y, {})
        moved = 0
        self._order.pop((g, b), None)
        self._order.pop((g, y), None)
        for s, n in takes:
            runs = self.runs.get((s, g))
            if runs is None:  # first touch: the whole segment is at b, where the rule put it
                runs = self.runs[s, g] = {b: at_b[s]}
            runs[b] -= n
            if not runs[b]:
                del runs[b]
            runs[y] = runs.get(y, 0) + n
            at_b[s] -= n
            if not at_b[s]:
                del at_b[s]
            at_y[s] = at_y.get(s, 0) + n
            moved += n
        o = g // self.E
        for r, n in ((b, -moved), (y, moved)):
            if r == o:
                self.owner_rows[g] += n
            else:
                helped = self.helped.setdefault(r, {})
                helped[g] = helped.get(g, 0) + n
                if not helped[g]:
                    del helped[g]
        if rounds != self.rounds:
            self.rounds = rounds
            self.totals = [self._total(r) for r in range(self.W)]
        else:
            for r in changed:
                self.totals[r] = self._total(r)
        self.moves += 1

    # ---- the search ---------------------------------------------------------------------------

    def step(self) -> bool:
        """One move (module doc); False when the bottleneck cannot be relieved."""
        totals = self.totals
        best = max(totals)
        b = totals.index(best)  # the first max: the lowest bottleneck rank
        E = self.E
        mine = [(self.owner_rows[g], g) for g in range(b * E, (b + 1) * E)]
        mine += [(n, g) for g, n in self.helped.get(b, {}).items()]
        level = sum(totals) / len(totals)
        heavy = sorted((p for p in mine if p[0] > 0), key=lambda p: (-p[0], p[1]))[:2]
        chosen = None
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
        at_b = self._where(g).get(b, {})
        out.append(min((s for s in at_b if s != b), key=lambda s: (-at_b[s], s), default=None))
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
        for (s, g), placed in sorted(segs.items()):
            o = g // E
            rule = s if (s == o or s in held.get(g, ())) else o
            placed = {r: n for r, n in placed.items() if n}
            if list(placed) == [rule]:
                continue
            runs = sorted(placed.items(), key=lambda p: (p[1] % blk != 0, p[0]))
            out.append((s, g, tuple(runs)))
        return tuple(out)

    def _home(self, s: int, g: int) -> int:
        """Where the start plan's replica rule computes segment (s, g)."""
        o = g // self.E
        return s if (s == o or s in self.start.get(g, ())) else o
