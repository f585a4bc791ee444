"""``Plan``: where every (source rank, expert) segment of one layer step is computed.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g; expert g is owned by rank g // E).

A plan is a pure value: every rank builds the same one from the same all-gathered counts, and the
dispatcher, the cost model and the simulator all read it through the methods below.

Two ways rows leave their owner's queue:

- **replicas** (``hot`` / ``replicas``): a rank holding a replica of g computes its own rows of g
  where they are (their token traffic vanishes), as ``mix`` and ``shadow`` always did.
- **shares** (the helper plan space): the rows of one segment (s, g) are cut, in their order on the
  source (ascending token, then choice), into consecutive runs, each computed at a named rank: the
  owner, the source, or a *helper* holding a replica of g. A helper takes rows of any source, the
  owner's own rows included; every run but the last is a whole number of ``block_size`` blocks so
  that blocks never straddle two ranks. Segments without an entry follow the replica rule.
- **ranges** (the same plan space, compact: ``mixmoe.placement.ranges``): per expert, helpers take
  consecutive row ranges of its owner's queue (its *stream*); one entry per (expert, helper)
  instead of one per segment. ``expanded`` turns them into share entries for a dispatching rank.
  A holder listed in ``kept`` computes only the first rows of its own segment of g; the rest
  joins g's stream (where the ranges or the owner compute it).
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import dataclass, field

import torch

from mixmoe.placement.cost_model import Prediction
from mixmoe.placement.ranges import check_ranges, range_shares

Share = tuple[int, int]  # (rank computing the run, rows in the run)


@dataclass(frozen=True)
class Plan:
    """hot:        replicated experts, ascending.
    replicas:   ``(g, holder ranks ascending)`` for each hot g, by ascending g; holders never
                include the owner g // E.
    prediction: cost-model prediction of this plan.
    baseline:   prediction for the same counts with nothing replicated (same overlap setting).
    shares:     ``(s, g, ((rank, rows), ...))`` entries, strictly ascending by (s, g): segment
                (s, g)'s rows cut into consecutive runs (see the module doc). Each run's rank is
                the owner of g or a holder of g's replica; ranks within an entry are distinct and
                every run has rows > 0. Whether the rows add up to C[s][g] and the runs are whole
                blocks depends on the counts: ``check_shares`` checks it.
    ranges:     ``(g, ((helper, rows), ...))`` entries, strictly ascending by g: helpers of g
                taking consecutive ranges of g's stream (``mixmoe.placement.ranges``); each
                helper a holder of g's replica, distinct, rows > 0; an expert in ``ranges`` has
                no share entry. ``check_shares`` checks them against the counts.
    kept:       ``(g, ((holder, local_rows), ...))`` entries, strictly ascending by g: holder y
                of g's replica computes only the first ``local_rows`` (>= 0) rows of its own
                segment (y, g) locally; the other C[y][g] - local_rows stay in g's stream at
                y's place (``mixmoe.placement.ranges``). Holders distinct; a holder not listed
                keeps all its rows local (the replica rule); an expert here has no share entry.
                ``check_shares``: each y a holder, local_rows < C[y][g], whole blocks, and
                no range of y's own covering its rest (keep those rows local instead).
    relay:      whether the replica weights travel by the relay (``relay_messages``: scatter +
                all-gather of chunks, split by node across nodes) and are priced so
                (``cost_model.plan_pricing``); False (default, today's plans): the
                owner sends every copy. ``plan_mix``'s balanced plans set it.
    """

    hot: tuple[int, ...]
    replicas: tuple[tuple[int, tuple[int, ...]], ...]
    prediction: Prediction
    baseline: Prediction
    shares: tuple[tuple[int, int, tuple[Share, ...]], ...] = ()
    relay: bool = False
    ranges: tuple[tuple[int, tuple[Share, ...]], ...] = ()
    kept: tuple[tuple[int, tuple[Share, ...]], ...] = ()
    _holders: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _shares: dict[tuple[int, int], tuple[Share, ...]] = field(init=False, repr=False, compare=False)
    # the plan as the compiled step bookkeeping reads it (``dispatch.step_native``), where the
    # compiled planner wrote it; None: packed there from the fields
    packed: array | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if list(self.hot) != sorted(set(self.hot)):
            raise ValueError(f"Plan.hot must be strictly ascending, got {self.hot}")
        if tuple(g for g, _ in self.replicas) != self.hot:
            raise ValueError(f"Plan.replicas {self.replicas} must list exactly hot = {self.hot}")
        for g, holders in self.replicas:
            if list(holders) != sorted(set(holders)):
                raise ValueError(f"holders of expert {g} must be strictly ascending, got {holders}")
        object.__setattr__(self, "_holders", dict(self.replicas))
        keys = [(s, g) for s, g, _ in self.shares]
        # strictly ascending pairwise (no sort: a W = 1024 plan has ~10**4 entries)
        if any(map(operator.ge, keys, keys[1:])):
            raise ValueError(f"Plan.shares must be strictly ascending by (source, expert): {keys}")
        for s, g, runs in self.shares:
            if len(runs) == 1 and runs[0][1] > 0:  # most entries: one run, nothing to compare
                continue
            ranks = [rank for rank, _ in runs]
            if not runs or len(set(ranks)) != len(ranks) or any(n <= 0 for _, n in runs):
                raise ValueError(
                    f"share of segment ({s}, {g}) must name distinct ranks with rows > 0: {runs}"
                )
        object.__setattr__(self, "_shares", {(s, g): runs for s, g, runs in self.shares})
        experts = [g for g, _ in self.ranges]
        if any(map(operator.ge, experts, experts[1:])):
            raise ValueError(f"Plan.ranges must be strictly ascending by expert: {experts}")
        for g, ranges in self.ranges:
            ranks = [y for y, _ in ranges]
            if not ranges or len(set(ranks)) != len(ranks) or any(n <= 0 for _, n in ranges):
                raise ValueError(
                    f"ranges of expert {g} must name distinct ranks with rows > 0: {ranges}"
                )
        kept = [g for g, _ in self.kept]
        if any(map(operator.ge, kept, kept[1:])):
            raise ValueError(f"Plan.kept must be strictly ascending by expert: {kept}")
        for g, entries in self.kept:
            ranks = [y for y, _ in entries]
            if not entries or len(set(ranks)) != len(ranks) or any(n < 0 for _, n in entries):
                raise ValueError(
                    f"kept of expert {g} must name distinct holders with local rows >= 0: {entries}"
                )
        if (self.ranges or self.kept) and self.shares:
            both = {*experts, *kept} & {g for _, g, _ in self.shares}
            if both:
                raise ValueError(
                    f"experts {sorted(both)} have both ranges and share entries (an expert with "
                    "ranges or kept holders has none)"
                )

    @classmethod
    def unchecked(
        cls,
        replicas: tuple[tuple[int, tuple[int, ...]], ...],
        prediction: Prediction,
        baseline: Prediction,
        relay: bool,
        ranges: tuple[tuple[int, tuple[Share, ...]], ...],
        kept: tuple[tuple[int, tuple[Share, ...]], ...],
        packed: array | None = None,
    ) -> Plan:
        """The plan of these fields (no shares; hot: the replicas' experts), equal to ``Plan(...)``
        of them, without ``__post_init__``'s checks: for a producer whose every plan is tested
        to pass them (the compiled planner, ``native_planner``: its twin tests rebuild each plan
        through the checks, and compare ``packed`` with ``step_native``'s packing of the
        fields). At W = 64 the checks are ~10% of the compiled plan's time."""
        out = object.__new__(cls)
        fields = {
            "hot": tuple(g for g, _ in replicas),
            "replicas": replicas,
            "prediction": prediction,
            "baseline": baseline,
            "shares": (),
            "relay": relay,
            "ranges": ranges,
            "kept": kept,
            "_holders": dict(replicas),
            "_shares": {},
            "packed": packed,
        }
        for name, value in fields.items():
            object.__setattr__(out, name, value)
        return out

    def priced(self, prediction: Prediction, baseline: Prediction) -> Plan:
        """This plan with ``prediction`` and ``baseline`` set: equal to ``dataclasses.replace``
        of them, without repeating ``__post_init__``'s checks of fields this plan has passed
        already (a W = 1024 plan has ~10**4 share entries: its checks cost milliseconds)."""
        out = object.__new__(Plan)
        for name in ("hot", "replicas", "shares", "relay", "ranges", "kept", "_holders", "_shares",
                     "packed"):  # fmt: skip
            object.__setattr__(out, name, getattr(self, name))
        object.__setattr__(out, "prediction", prediction)
        object.__setattr__(out, "baseline", baseline)
        return out

    def expanded(self, counts_WN, experts_per_rank: int, rank: int | None = None) -> Plan:
        """This plan with its ranges and kept holders turned into share entries
        (``ranges.range_shares``): the same placement, in the form the dispatcher reads
        (``segment_runs``); itself when it has neither. ``rank``: only the entries that rank's
        dispatch reads (its own segments and those of the experts it owns or holds; a W = 1024
        plan's ranges cover ~10**5 segments)."""
        if not self.ranges and not self.kept:
            return self
        C_WN = torch.as_tensor(counts_WN)
        shares = sorted([*self.shares, *range_shares(C_WN, self, experts_per_rank, rank)])
        return Plan(self.hot, self.replicas, self.prediction, self.baseline, tuple(shares),
                    self.relay)  # fmt: skip

    def holders(self, g: int) -> tuple[int, ...]:
        """Ranks holding a replica of expert g (ascending); () if g is not hot."""
        return self._holders.get(g, ())

    def computed_at(self, s: int, g: int, experts_per_rank: int) -> int:
        """The rank that computes the rows source rank s routes to expert g, for a segment
        without a share entry (``segment_runs`` covers every segment)."""
        if s == g // experts_per_rank or s in self._holders.get(g, ()):
            return s
        return g // experts_per_rank

    def segment_runs(self, s: int, g: int, rows: int, experts_per_rank: int) -> tuple[Share, ...]:
        """Segment (s, g) of ``rows`` rows as consecutive runs ``((rank, rows), ...)``: its share
        entry, or the whole segment at ``computed_at`` (``()`` when ``rows`` is 0). A plan with
        ranges answers this only once ``expanded`` (a range's runs depend on the counts)."""
        runs = self._shares.get((s, g))
        if runs is not None:
            return runs
        if self.ranges or self.kept:
            raise ValueError(
                "a plan with ranges or kept holders must be expanded(counts, E) before segment_runs"
            )
        return ((self.computed_at(s, g, experts_per_rank), rows),) if rows else ()

    def replica_slots(self, rank: int) -> tuple[int, ...]:
        """Hot experts whose replica ``rank`` holds, ascending: the order of its replica slots."""
        return tuple(g for g, holders in self.replicas if rank in holders)

    def check_shares(self, counts_WN, experts_per_rank: int, block_size: int) -> None:
        """ValueError unless every share entry covers exactly C[s][g] rows, names only the owner
        or holders of g's replica, and cuts only at whole blocks (all runs but the last); and
        every range and kept entry likewise (``ranges.check_ranges``)."""
        E = experts_per_rank
        if self.ranges or self.kept:
            check_ranges(torch.as_tensor(counts_WN), self, E, block_size)
        for s, g, runs in self.shares:
            rows = int(counts_WN[s][g])
            if sum(n for _, n in runs) != rows:
                raise ValueError(f"share of segment ({s}, {g}) covers {runs}, not its {rows} rows")
            allowed = {g // E, *self._holders.get(g, ())}
            if not {rank for rank, _ in runs} <= allowed:
                raise ValueError(
                    f"share of segment ({s}, {g}) names ranks {runs} outside owner and holders "
                    f"{sorted(allowed)}"
                )
            if any(n % block_size for _, n in runs[:-1]):
                raise ValueError(
                    f"share of segment ({s}, {g}) cuts inside a {block_size}-row block: {runs}"
                )
