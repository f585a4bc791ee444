"""The bookkeeping of a fill over row ranges: per-rank loads from rows moved in bulk.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g; o = g // E its owner), H_g the holders of g's replica; ``StepModel``'s loads per rank
(rows, local, remote, replica) and totals (seconds).

A fill (``mixmoe.placement.level_fill``) decides how many rows of g each helper takes from g's
stream (``mixmoe.placement.ranges``); which segments they are follows from the counts when the
plan is built. So the state needs no segments: per expert, its holders, each helper's rows and
each kept holder's local rows.
Each rank's loads are the sum over experts of its part in each (one expert's part, absolute):

- a holder y:               (C[y][g] + n_y, C[y][g], n_y)   its own rows local, n_y received;
- a kept holder y (local k): (k + n_y, k, n_y + C[y][g] - k) its first k own rows local, the
                             rest sent (they are in the stream; a fill gives a kept holder no
                             amount, n_y = 0, so no range of its own covers them);
- another source s:          (0, 0, C[s][g])                 it sends its rows;
- the owner, taken = sum n:  (others + own - taken, own - max(0, taken - others),
                              |others - taken|)              others: the stream's other rows;

so a move changes the parts of the ranks it touches, and their loads by the difference (exact
integers; the replica column: each expert's relay copies, ``relay_degrees``). The loads equal
``cost_model.plan_pricing`` of the plan with these amounts as ranges (before ``cut_ranges``
rounds them to whole blocks): ``tests/placement/test_placement_ranges.py``.

Across nodes (a model from ``StepModel.fill_link`` with ``bw_far``, and a ``distance``) the
state also keeps the copies that cross nodes (``replica_inter``: each expert's
``relay_inter_copies``, as ``plan_pricing``'s sixth row) and prices them at the inter-node link
(``StepModel.split_total_fn``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mixmoe.placement.cost_model import StepModel
from mixmoe.placement.ranges import cut_ranges_many
from mixmoe.placement.relay import relay_degrees, relay_inter_copies

__all__ = ["RangeState", "start_inter", "start_relay", "start_totals", "stream_rows"]


def stream_rows(
    C_WN: torch.Tensor, E: int, holders: dict[int, list[int]], colsum_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(owner_rows_N, own_N, others_N) with ``holders`` holding replicas (their own rows
    local): rows of each expert its owner computes, C[o][g], and the stream's rows from sources
    other than the owner (int64 [N] each; all experts at once: no column read but the holders')."""
    W = C_WN.shape[0]
    # C[o][g] of each expert g's owner o (the [W, W, E] view's diagonal, as [W, E])
    own_N = C_WN.view(W, W, E).diagonal(0, 0, 1).T.reshape(-1)
    owner_rows = colsum_N.clone()
    for g, h in holders.items():
        owner_rows[g] -= int(C_WN[h, g].sum())
    return owner_rows, own_N, owner_rows - own_N


def start_relay(
    holders: dict[int, list[int]], E: int, distance: Callable[[int, int], int] | None
) -> tuple[dict[int, dict[int, float]], int]:
    """Each replicated expert's relay copies per rank (``relay_degrees``), and the most rounds."""
    degrees, rounds = {}, 0
    for g, h in holders.items():
        degrees[g], depth = relay_degrees(g // E, h, distance)
        rounds = max(rounds, depth)
    return degrees, rounds


def start_totals(
    model: StepModel,
    loads_4W: torch.Tensor,
    any_remote: bool,
    rounds: int,
    replica_inter: list[float] | None = None,
) -> list[float]:
    """Each rank's total at the start of a fill (``RangeState.totals``): ``model.seconds_W`` of
    the start loads, or across nodes (``replica_inter`` given: ``start_inter``'s)
    ``split_total_fn``'s of each rank."""
    if replica_inter is None:
        compute_W, comm_W = model.seconds_W(loads_4W, any_remote, rounds)
        return (compute_W + comm_W).tolist()
    rows, local, remote = loads_4W[:3].to(torch.int64).tolist()
    fn = model.split_total_fn(any_remote, rounds)
    return list(map(fn, rows, local, remote, loads_4W[3].tolist(), replica_inter))


def start_inter(
    holders: dict[int, list[int]], E: int, W: int, distance: Callable[[int, int], int]
) -> tuple[dict[int, dict[int, float]], list[float]]:
    """Each replicated expert's relay copies that cross nodes per rank (``relay_inter_copies``),
    and their sum per rank (grid values: exact in any order)."""
    inter = {g: relay_inter_copies(g // E, h, distance) for g, h in holders.items()}
    replica_inter = [0.0] * W
    for copies in inter.values():
        for r, x in copies.items():
            replica_inter[r] += x
    return inter, replica_inter


class RangeState:
    """rows/local/remote/replica: per-rank loads (lists); totals their seconds; holders {g:
    ranks ascending}; held[r]: replicas r holds; amounts {g: {helper: rows}}; taken[g]: their
    sum; others[g]: the stream's rows from sources other than the owner; own[g]: C[o][g];
    owner_rows[g]: rows of g its owner computes; helped {r: {g: rows}}: r's amounts; kept
    {g: {y: local rows}}: the holders computing only part of their own rows of g (local <
    C[y][g]; ``plan_fields`` rounds it down to whole blocks); overshot: the ranks a fill made
    holders whose own rows took them past its level (all kept local: ``level_fill``); beaten:
    whether its fill stopped once its mean reached the step to beat (``level_fill``); across
    nodes (module doc) replica_inter, and inter {g: {rank: copies}} per expert."""

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
        loads_4W: torch.Tensor,
    ) -> None:
        """``loads_4W``: the start plan's ``plan_pricing`` under relay (float64 [4, W])."""
        self.model, self.C_WN, self.E = model, C_WN, E
        self.W = C_WN.shape[0]
        self.slots, self.block, self.distance = slots, block_size, distance
        self.any_remote = any_remote
        self.holders = {g: sorted(h) for g, h in start_holders.items() if h}
        self.held = [0] * self.W
        for h in self.holders.values():
            for r in h:
                self.held[r] += 1
        owner_rows, own_N, others = stream_rows(C_WN, E, self.holders, colsum_N)
        self.owner_rows, self.own, self.others = (
            owner_rows.tolist(),
            own_N.tolist(),
            others.tolist(),
        )
        self.amounts: dict[int, dict[int, int]] = {}
        self.taken = [0] * len(self.own)
        self.helped: dict[int, dict[int, int]] = {}
        self.kept: dict[int, dict[int, int]] = {}
        self.rows, self.local, self.remote = loads_4W[:3].to(torch.int64).tolist()
        self.replica = loads_4W[3].tolist()
        self.degrees, self.rounds = start_relay(self.holders, E, distance)
        self._total_fns: dict[int, Callable] = {}
        self.split = distance is not None and model.bw_far is not None  # module doc
        inter_W = None
        if self.split:
            self.inter, self.replica_inter = start_inter(self.holders, E, self.W, distance)
            inter_W = self.replica_inter
        self.totals = start_totals(model, loads_4W, any_remote, self.rounds, inter_W)
        self.moves = 0
        self.overshot: set[int] = set()  # new holders whose own rows took them past the level
        self.beaten = False  # a fill stopped at its mean reaching the step to beat (level_fill)

    def rows_of(self, y: int, g: int) -> int:
        """C[y][g]: one element (a column's ``tolist`` costs ~W elements; a fill reads a few
        sources of each expert)."""
        return int(self.C_WN[y, g])

    def _owner_part(self, g: int) -> tuple[int, int, int]:
        """The owner's (rows, local, remote) part in g (module doc)."""
        others, own, taken = self.others[g], self.own[g], self.taken[g]
        return others + own - taken, own - max(0, taken - others), abs(others - taken)

    def _add(self, r: int, part: tuple[int, int, int], sign: int) -> None:
        self.rows[r] += sign * part[0]
        self.local[r] += sign * part[1]
        self.remote[r] += sign * part[2]

    def add_holder(self, g: int, y: int, local: int | None = None) -> None:
        """y (neither g's owner nor a holder; with a free slot) holds g's replica from now on:
        ``local`` of its own rows of g (default all) turn local (they leave g's stream; when
        the helpers' amounts then exceed the stream, the excess comes off the largest amounts
        first, ties by rank: those rows were y's); the rest stays in the stream (y is *kept*:
        module doc). The relay is priced by ``relay`` once per pass."""
        c = self.rows_of(y, g)
        k = c if local is None else min(local, c)
        # y's part as another source, (0, 0, c), is that of a holder keeping 0 rows
        if k < c:
            self.kept.setdefault(g, {})[y] = 0
        self._keep(g, y, k)
        self.holders[g] = sorted([*self.holders.get(g, ()), y])
        self.held[y] += 1

    def keep_more(self, g: int, y: int, k: int) -> None:
        """k more of kept holder y's own rows of g turn local (at most its rest; y is no longer
        kept once all are)."""
        self._keep(g, y, min(k, self.rows_of(y, g) - self.kept[g][y]))

    def _keep(self, g: int, y: int, k: int) -> None:
        """k of y's own rows of g leave g's stream and turn local at y (a holder, or becoming
        one): y's part (module doc) and the owner's updated."""
        o, c = g // self.E, self.rows_of(y, g)
        old = self._owner_part(g)
        self._add(o, old, -1)
        self._add(y, (k, k, -k), 1)  # y computes k more, sends k fewer
        self.others[g] -= k
        kept = self.kept.get(g, {})
        if y in kept:
            kept[y] += k
            if kept[y] >= c:  # all local: y is an ordinary holder
                del kept[y]
                if not kept:
                    del self.kept[g]
        excess = self.taken[g] - self.others[g] - self.own[g]
        if excess > 0:
            amounts = self.amounts[g]
            for _, r in sorted((-n, r) for r, n in amounts.items() if n):
                d = min(excess, amounts[r])
                amounts[r] -= d
                self.rows[r] -= d
                self.remote[r] -= d
                self.helped[r][g] -= d
                self.taken[g] -= d
                excess -= d
                if not excess:
                    break
        new = self._owner_part(g)
        self._add(o, new, 1)
        self.owner_rows[g] = new[0]

    def kept_rest(self, g: int, y: int) -> int:
        """Rows of y's own segment of g still in g's stream (0 unless y is kept)."""
        local = self.kept.get(g, {}).get(y)
        return 0 if local is None else self.rows_of(y, g) - local

    def move(self, g: int, b: int, y: int, n: int) -> None:
        """n rows of g from b to y (each g's owner or a holder, y not kept: ``keep_more``; b
        has them): loads updated."""
        o = g // self.E
        assert not self.kept_rest(g, y), "a kept holder takes its own rows first (keep_more)"
        old = self._owner_part(g)
        self._add(o, old, -1)
        amounts = self.amounts.setdefault(g, {})
        for r, d in ((b, -n), (y, n)):
            if r == o:
                self.taken[g] -= d
            else:
                amounts[r] = amounts.get(r, 0) + d
                self.rows[r] += d
                self.remote[r] += d
                helped = self.helped.setdefault(r, {})
                helped[g] = helped.get(g, 0) + d
        new = self._owner_part(g)
        self._add(o, new, 1)
        self.owner_rows[g] = new[0]

    def relay(self, g: int) -> None:
        """g's relay priced for its current holders: the copies it changes on every rank and
        the rounds."""
        old = self.degrees.get(g, {})
        degrees, depth = relay_degrees(g // self.E, self.holders[g], self.distance)
        for r in sorted(set(degrees) | set(old)):  # copies on the relay's grid: exact sums
            self.replica[r] += degrees.get(r, 0) - old.get(r, 0)
        self.degrees[g] = degrees
        self.rounds = max(self.rounds, depth)
        if self.split:  # the copies that cross nodes (module doc), as the copies above
            old = self.inter.get(g, {})
            inter = relay_inter_copies(g // self.E, self.holders[g], self.distance)
            for r in sorted(set(inter) | set(old)):
                self.replica_inter[r] += inter.get(r, 0) - old.get(r, 0)
            self.inter[g] = inter

    def retotal(self) -> None:
        """Every rank's total from its loads."""
        fn = self._total_fns.get(self.rounds)
        if fn is None:
            make = self.model.split_total_fn if self.split else self.model.total_fn
            fn = self._total_fns[self.rounds] = make(self.any_remote, self.rounds)
        loads = [self.rows, self.local, self.remote, self.replica]
        self.totals = list(map(fn, *loads, *([self.replica_inter] if self.split else [])))

    def plan_fields(self) -> tuple[tuple, tuple, tuple, tuple]:
        """(hot, replicas, ranges, kept) of the plan this state stands for: each kept holder's
        local rows rounded down to whole blocks, each expert's amounts as ranges by helper
        rank, cut at whole blocks (``cut_ranges``)."""
        hot = tuple(sorted(g for g, h in self.holders.items() if h))
        replicas = tuple((g, tuple(self.holders[g])) for g in hot)
        blk = self.block
        kept_g = {g: {y: n // blk * blk for y, n in k.items()} for g, k in self.kept.items() if k}
        items = []
        for g in sorted(self.amounts):
            amounts = sorted((y, n) for y, n in self.amounts[g].items() if n > 0)
            if amounts:
                items.append((g, self.holders[g], amounts))
        cuts = cut_ranges_many(self.C_WN, items, self.E, blk, kept_g)
        ranges = tuple((g, cut) for (g, _, _), cut in zip(items, cuts, strict=True) if cut)
        kept = tuple((g, tuple(sorted(kept_g[g].items()))) for g in sorted(kept_g))
        return hot, replicas, ranges, kept
