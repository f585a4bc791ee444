"""Per-step, per-layer replica plans: which experts to replicate, where, and what it should cost.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g; expert g is owned by rank g // E).

Every function here is a pure function of its arguments: no randomness, no dependence on dict or
set iteration order, ties broken by expert id. Every rank that computes a plan from the same
all-gathered counts gets the same plan. Costs come from ``mixmoe.placement.cost_model``.

- ``plan_none``   (``a2a``): nothing replicated.
- ``plan_mix``    (``mix``): cost-model greedy, replicas only on the ranks that have rows for them.
- ``plan_shadow`` (``shadow``): FasterMoE's shadowing rule, hot experts broadcast to every rank.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from mixmoe.placement.cost_model import (
    LayerShape,
    Prediction,
    StepModel,
    baseline_loads,
    counts_as_lists,
    counts_with_sums,
    step_model,
)
from mixmoe.placement.profile import HardwareProfile

# candidates evaluated in full per round of plan_mix's search (the top of the bottleneck's list)
SEARCH_WIDTH = 8


@dataclass(frozen=True)
class Plan:
    """Where every (source rank, expert) segment of one layer step is computed.

    hot:        replicated experts, ascending.
    replicas:   ``(g, holder ranks ascending)`` for each hot g, by ascending g; holders never
                include the owner g // E.
    prediction: cost-model prediction of this plan.
    baseline:   prediction for the same counts with nothing replicated (same overlap setting).

    Segment (s, g) is computed at s if s owns g or holds a replica of g, else at the owner.
    """

    hot: tuple[int, ...]
    replicas: tuple[tuple[int, tuple[int, ...]], ...]
    prediction: Prediction
    baseline: Prediction
    _holders: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if list(self.hot) != sorted(set(self.hot)):
            raise ValueError(f"Plan.hot must be strictly ascending, got {self.hot}")
        if tuple(g for g, _ in self.replicas) != self.hot:
            raise ValueError(f"Plan.replicas {self.replicas} must list exactly hot = {self.hot}")
        for g, holders in self.replicas:
            if list(holders) != sorted(set(holders)):
                raise ValueError(f"holders of expert {g} must be strictly ascending, got {holders}")
        object.__setattr__(self, "_holders", dict(self.replicas))

    def holders(self, g: int) -> tuple[int, ...]:
        """Ranks holding a replica of expert g (ascending); () if g is not hot."""
        return self._holders.get(g, ())

    def computed_at(self, s: int, g: int, experts_per_rank: int) -> int:
        """The rank that computes the rows source rank s routes to expert g."""
        if s == g // experts_per_rank or s in self._holders.get(g, ()):
            return s
        return g // experts_per_rank

    def replica_slots(self, rank: int) -> tuple[int, ...]:
        """Hot experts whose replica ``rank`` holds, ascending: the order of its replica slots."""
        return tuple(g for g, holders in self.replicas if rank in holders)


def plan_none(
    counts_WN: object, shape: LayerShape, profile: HardwareProfile, *, overlap: bool = False
) -> Plan:
    """The ``a2a`` plan: nothing replicated; every remote segment goes to its owner.

    ``overlap`` is the cost model's overlap setting (default False: the classic all-to-all
    dispatcher does not overlap the exchange with local compute). prediction == baseline.
    """
    model = step_model(shape, profile, overlap)
    # vectorised: no W x N Python lists at scale; one pass over C
    C_WN, *sums = counts_with_sums(counts_WN, shape)
    loads_4W, colsum_N, _ = baseline_loads(C_WN, shape.experts_per_rank, sums)
    model.check_exact(max(2 * int(colsum_N.sum()), shape.world_size * shape.num_experts))
    baseline = model.prediction_W(loads_4W)
    return Plan((), (), baseline, baseline)


def plan_mix(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    max_replicas: int,
    overlap: bool = True,
    *,
    search_width: int = SEARCH_WIDTH,
) -> Plan:
    """The mixed strategy's plan: replicate while the predicted step time strictly drops.

    ``counts_WN``: an integer CPU tensor [W, N] (the all-gathered counts; int64 is used without a
    copy) or [W][N] nested sequences of ints (converted: slow at scale, pass the tensor).

    Placement rule: replicating g gives a replica to every rank s != owner with C[s][g] > 0 (all
    of g's rows are then computed at their sources). Candidates: experts with a remote row.

    Search, bottleneck first. The step is the max over ranks, so an expert can only lower it if
    it touches the bottleneck b (the lowest rank at the max) and lowers b's total: b owns it (b
    then computes and exchanges fewer rows, and serves the replicas) or b sends it rows (b then
    computes them itself and fetches a replica). Each round:

    1. b's new total is scored for all candidates at once (one vector over b's row of C, b's own
       experts patched in); those that lower it, by remote rows descending then expert id
       ascending (the priority of today's greedy), are the round's shortlist;
    2. the first ``search_width`` of them are evaluated at once on every rank (holders, owner,
       and the others under the collectives that would then run); the first with a strictly
       lower predicted step is accepted and the next round starts from the new bottleneck. A
       candidate with a holder already at ``max_replicas`` replicas is dropped for good (replica
       counts only grow) and does not count against the width;
    3. a round that accepts nothing ends the search.

    Guarantees: every acceptance strictly lowers the step, so ``prediction.step_s <=
    baseline.step_s`` with equality only when nothing is replicated; no rank holds more than
    ``max_replicas`` replicas; deterministic (no randomness, stable sorts, exact integer
    aggregates, ties by rank then expert id): the same counts give the same plan on every rank.
    A round whose shortlist fits in ``search_width`` stops only where an exhaustive greedy would
    (no single further candidate lowers the step); a longer one may stop earlier.

    Cost: one pass over C in cached row blocks (sign check, column and row sums:
    ``counts_with_sums``), then per round a few dozen vector ops over N and [search_width, W].
    Where per-op overhead is the cost, the same search runs in other forms, with the same
    decisions (a test forces each on the same cases): tiny problems (W x N <= ``LIST_LIMIT``)
    on Python lists (``_ListMixSearch``); small ones (open candidates x W <= ``BATCH_LIMIT``)
    score every candidate at once in the rounds after the first acceptance
    (``_BatchedMixSearch``).
    Everything is torch ops on tensors (their kernels release the GIL): fit to run on a
    background thread.
    """
    model = step_model(shape, profile, overlap)
    for name, value, lo in (("max_replicas", max_replicas, 0), ("search_width", search_width, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")
    if shape.world_size * shape.num_experts <= LIST_LIMIT:
        return _plan_mix_lists(counts_WN, shape, model, max_replicas, search_width)
    C_WN, *sums = counts_with_sums(counts_WN, shape)
    W, E = shape.world_size, shape.experts_per_rank
    loads_4W, colsum_N, own_N = baseline_loads(C_WN, E, sums)
    model.check_exact(max(2 * int(colsum_N.sum()), W * shape.num_experts))
    moved_N = colsum_N - own_N
    total_remote = int(moved_N.sum())
    compute_W, comm_W = model.seconds_W(loads_4W, total_remote > 0, False)
    baseline = model.pack(compute_W, comm_W, loads_4W)
    if max_replicas == 0 or W == 1 or total_remote == 0:
        return Plan((), (), baseline, baseline)
    search = _MixSearch(model, C_WN, E, max_replicas, search_width)
    search.start(loads_4W, compute_W + comm_W, moved_N, total_remote)
    # the first round shortlists (often the only one: nothing pays); once an expert is accepted,
    # a small problem scores every open candidate per round instead (same decisions)
    if search.round():
        if int(search.open_N.sum()) * W <= BATCH_LIMIT:
            search = _BatchedMixSearch.resume(search)
        while search.round():
            pass
    if not search.accepted:
        return Plan((), (), baseline, baseline)
    prediction = model.prediction_W(search.loads_4W)
    assert prediction.step_s < baseline.step_s, (prediction.step_s, baseline.step_s)
    hot = tuple(sorted(search.accepted))
    return Plan(hot, tuple((g, search.accepted[g]) for g in hot), prediction, baseline)


# how one replicated expert changes the loads (LOADS order: rows, local, remote, replica) of a
# rank that sends it c rows: c * _PER_ROW + _PER_REPLICA; its owner's change is patched in apart
_PER_ROW_41 = torch.tensor([1.0, 1.0, -1.0, 0.0], dtype=torch.float64).view(4, 1)
_PER_REPLICA_41 = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64).view(4, 1)


class _MixSearch:
    """``plan_mix``'s search state. loads_4W: the per-rank aggregates with the experts accepted
    so far (float64 [4, W] holding integers, ``LOADS`` order), totals_W their predicted seconds,
    held_W the replicas each rank holds, moved_N each expert's remote rows, open_N whether it is
    still a candidate, total_remote the remote rows left in the group, accepted {g: holders}."""

    def __init__(
        self, model: StepModel, C_WN: torch.Tensor, E: int, max_replicas: int, width: int
    ) -> None:
        self.model, self.C_WN, self.E = model, C_WN, E
        self.max_replicas, self.width = max_replicas, width
        self.accepted: dict[int, tuple[int, ...]] = {}

    def start(
        self,
        loads_4W: torch.Tensor,
        totals_W: torch.Tensor,
        moved_N: torch.Tensor,
        total_remote: int,
    ) -> None:
        self.loads_4W, self.totals_W, self.total_remote = loads_4W, totals_W, total_remote
        self.held_W = torch.zeros(len(totals_W), dtype=torch.int64)
        self.moved_N = moved_N.to(torch.float64)
        self.open_N = moved_N > 0

    def _totals(self, loads: torch.Tensor, any_remote: torch.Tensor) -> torch.Tensor:
        compute, comm = self.model.seconds_W(loads, any_remote, True)
        return compute + comm

    def shortlist(self, b: int, best: float) -> torch.Tensor:
        """Open candidates that would bring rank b's total below ``best``, in priority order."""
        C_WN, E, moved_N = self.C_WN, self.E, self.moved_N
        own = slice(b * E, (b + 1) * E)
        # b as a source of g: b computes its c rows of g itself and fetches one replica
        c_N = C_WN[b].to(torch.float64)
        delta_4N = c_N * _PER_ROW_41 + _PER_REPLICA_41
        # b as the owner of g: b no longer computes nor exchanges g's m remote rows and serves
        # one replica to each of g's n sources
        n_E = (C_WN[:, own] > 0).sum(0) - (C_WN[b, own] > 0).to(torch.int64)
        m_E = moved_N[own]
        delta_4N[:, own] = torch.stack([-m_E, torch.zeros_like(m_E), -m_E, n_E.to(m_E.dtype)])
        new_N = self._totals(self.loads_4W[:, b : b + 1] + delta_4N, moved_N < self.total_remote)
        touches_N = c_N > 0
        touches_N[own] = True
        g = (self.open_N & touches_N & (new_N < best)).nonzero().squeeze(1)
        # expert id ascending (nonzero), then (stable) remote rows descending
        return g[torch.sort(moved_N[g], descending=True, stable=True).indices]

    def round(self) -> bool:
        """One round of the search (see ``plan_mix``); True if an expert was accepted."""
        b = int(self.totals_W.argmax())  # the first max: the lowest bottleneck rank
        best = float(self.totals_W[b])
        shortlist, budget = self.shortlist(b, best), self.width
        while budget > 0 and len(shortlist):
            batch, shortlist = shortlist[:budget], shortlist[budget:]
            trial_k4W, totals_kW, src_kW, blocked_k = self._evaluate(batch)
            passes = (totals_kW.amax(1) < best).tolist()
            blocked = blocked_k.tolist()
            for i, g in enumerate(batch.tolist()):
                if blocked[i]:
                    self.open_N[g] = False  # a holder is full: g can never fit again
                elif passes[i]:
                    self._accept(g, trial_k4W[i], totals_kW[i], src_kW[i])
                    return True
            budget -= len(blocked) - sum(blocked)
        return False

    def _evaluate(
        self, g_k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each candidate of ``g_k`` accepted on its own: the loads [k, 4, W], totals [k, W],
        holders (bool [k, W]) and whether a holder is full (bool [k])."""
        delta_k4W, src_kW, m_k = self._deltas(g_k)
        blocked_k = (src_kW & (self.held_W >= self.max_replicas)).any(1)
        trial_k4W = self.loads_4W + delta_k4W
        totals_kW = self._totals(trial_k4W, (m_k < self.total_remote).view(len(g_k), 1))
        return trial_k4W, totals_kW, src_kW, blocked_k

    def _deltas(self, g_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """How accepting each candidate of ``g_k`` on its own changes every rank's loads
        (float64 [k, 4, W]), its holders (bool [k, W]) and its remote rows (float64 [k])."""
        ar = torch.arange(len(g_k))
        o_k = torch.div(g_k, self.E, rounding_mode="floor")
        c_kW = self.C_WN[:, g_k].t().to(torch.float64)
        src_kW = c_kW > 0
        src_kW[ar, o_k] = False
        delta_k4W = (c_kW * src_kW).unsqueeze(1) * _PER_ROW_41 + src_kW.unsqueeze(
            1
        ) * _PER_REPLICA_41
        m_k = self.moved_N[g_k]
        n_k = src_kW.sum(1).to(torch.float64)
        delta_k4W[ar, :, o_k] += torch.stack([-m_k, torch.zeros_like(m_k), -m_k, n_k], dim=1)
        return delta_k4W, src_kW, m_k

    def _accept(
        self, g: int, loads_4W: torch.Tensor, totals_W: torch.Tensor, src_W: torch.Tensor
    ) -> None:
        self.loads_4W, self.totals_W = loads_4W, totals_W
        self.held_W += src_W
        self.total_remote -= int(self.moved_N[g])
        self.open_N[g] = False
        self.accepted[g] = tuple(src_W.nonzero().squeeze(1).tolist())


# _BatchedMixSearch runs where candidates x ranks is at most this: its [P, 4, W] tensors then stay
# tiny, and a fixed handful of ops per round beats the shortlist's two passes
BATCH_LIMIT = 2048


class _BatchedMixSearch(_MixSearch):
    """``_MixSearch`` for small problems, where per-op overhead and not arithmetic is the cost,
    from the second round on (``resume``): every open candidate's effect (``_deltas``) is built
    once, in priority order (remote rows
    descending, expert id ascending), and each round scores all open candidates at once with a
    fixed number of vector ops, instead of a shortlist pass and then an evaluation pass.

    Same decisions as ``_MixSearch.round``, value for value (the same integer loads through the
    same ``seconds_W``): the shortlist is the open candidates that touch the bottleneck b and
    lower its total; the first ``width`` of them that no full holder blocks are the evaluated
    ones; the first of those whose step drops is accepted. Blocked candidates are closed as soon
    as they are listed (the sequential search closes them when it reaches them: they can never
    be accepted, and they never count against the width, so no decision differs).
    """

    @classmethod
    def resume(cls, search: _MixSearch) -> _BatchedMixSearch:
        """Go on from ``search``'s state (its accepted experts, loads and open candidates)."""
        batched = cls.__new__(cls)
        batched.__dict__.update(search.__dict__)
        g = batched.open_N.nonzero().squeeze(1)
        batched.g_P = g[torch.sort(batched.moved_N[g], descending=True, stable=True).indices]
        batched.delta_P4W, batched.src_PW, m_P = batched._deltas(batched.g_P)
        batched.m_P1 = m_P.view(-1, 1)
        batched.o_P = torch.div(batched.g_P, batched.E, rounding_mode="floor")
        batched.open_P = torch.ones(len(batched.g_P), dtype=torch.bool)
        batched._update()
        return batched

    def _update(self) -> None:
        """What changes only when an expert is accepted: which candidates leave remote rows in
        the group (the token collectives still run), and which have a full holder."""
        self.any_remote_P1 = self.m_P1 < self.total_remote
        self.blocked_P = (self.src_PW & (self.held_W >= self.max_replicas)).any(1)

    def round(self) -> bool:
        b = int(self.totals_W.argmax())  # the first max: the lowest bottleneck rank
        best = float(self.totals_W[b])
        trial_P4W = self.loads_4W + self.delta_P4W
        totals_PW = self._totals(trial_P4W, self.any_remote_P1)
        touches_P = self.src_PW[:, b] | (self.o_P == b)
        listed_P = self.open_P & touches_P & (totals_PW[:, b] < best)
        usable_P = listed_P & ~self.blocked_P
        evaluated_P = usable_P & (usable_P.cumsum(0) <= self.width)
        accepted = (evaluated_P & (totals_PW.amax(1) < best)).nonzero()
        self.open_P &= ~(listed_P & self.blocked_P)
        if not len(accepted):
            return False
        i = int(accepted[0])
        self.open_P[i] = False
        self._accept(int(self.g_P[i]), trial_P4W[i], totals_PW[i], self.src_PW[i])
        self._update()
        return True


# plan_mix runs on Python lists (``_plan_mix_lists``) where W x N is at most this: the counts fit
# in a few small lists, and scalar arithmetic beats tensor ops that would each cost more than the
# work they do
LIST_LIMIT = 1024


def _plan_mix_lists(
    counts_WN: object, shape: LayerShape, model: StepModel, max_replicas: int, width: int
) -> Plan:
    """``plan_mix`` on Python lists and floats, for tiny problems (W x N <= ``LIST_LIMIT``): the
    counts are validated and brought to the host once (``counts_as_lists``); every aggregate is
    an exact Python int and every second comes from ``StepModel.rank_total`` /
    ``rank_seconds``, equal to ``seconds_W`` bit for bit on the same integer loads, so the
    decisions, loads and predictions are those of the tensor paths (a test forces each path on
    the same cases)."""
    C = counts_as_lists(counts_WN, shape)
    W, E, N = shape.world_size, shape.experts_per_rank, shape.num_experts
    colsum = [sum(col) for col in zip(*C, strict=True)]
    model.check_exact(max(2 * sum(colsum), W * N))
    rows = [sum(colsum[r * E : (r + 1) * E]) for r in range(W)]
    local = [sum(C[r][r * E : (r + 1) * E]) for r in range(W)]
    remote = [sum(C[r]) - local[r] + rows[r] - local[r] for r in range(W)]
    moved = [colsum[g] - C[g // E][g] for g in range(N)]
    total_remote = sum(moved)
    loads = [rows, local, remote, [0] * W]
    baseline = model.prediction_lists(*loads)
    if max_replicas == 0 or W == 1 or total_remote == 0:
        return Plan((), (), baseline, baseline)
    totals = list(map(operator.add, baseline.compute_s, baseline.comm_s))
    search = _ListMixSearch(model, C, E, max_replicas, width, loads, totals, moved, total_remote)
    while search.round():
        pass
    if not search.accepted:
        return Plan((), (), baseline, baseline)
    prediction = model.prediction_lists(*search.loads)
    assert prediction.step_s < baseline.step_s, (prediction.step_s, baseline.step_s)
    hot = tuple(sorted(search.accepted))
    return Plan(hot, tuple((g, search.accepted[g]) for g in hot), prediction, baseline)


class _ListMixSearch:
    """``_MixSearch`` on Python lists and floats (see ``_plan_mix_lists``).

    The same search step for step: the bottleneck b, its shortlist (open candidates touching b
    whose new total at b drops below the step, by remote rows descending then expert id), the
    first ``width`` unblocked ones evaluated on every rank, the first whose step drops accepted.
    Walked lazily: candidates are scored in priority order and evaluated as soon as they are
    listed, so a round stops at the first acceptance (or the width) without scoring the rest;
    a listed candidate with a full holder is closed when it is reached, as in ``_MixSearch``,
    and the candidates after the stop are left as they are, so no decision differs. An
    evaluation stops at the first rank whose new total is not below the step; the ranks it
    does not touch keep their loads, so their totals are computed once per acceptance.
    """

    def __init__(
        self,
        model: StepModel,
        C: list[list[int]],
        E: int,
        max_replicas: int,
        width: int,
        loads: list[list[int]],
        totals: list[float],
        moved: list[int],
        total_remote: int,
    ) -> None:
        self.model, self.C, self.E = model, C, E
        self.max_replicas, self.width = max_replicas, width
        self.accepted: dict[int, tuple[int, ...]] = {}
        self.loads, self.totals = loads, totals  # [rows, local, remote, replica] x W ints
        self.moved, self.total_remote = moved, total_remote
        self.held = [0] * len(totals)
        self.open = [m > 0 for m in moved]
        # candidates in priority order: remote rows descending, expert id ascending
        self.order = sorted((g for g, m in enumerate(moved) if m > 0), key=lambda g: (-moved[g], g))
        self._kept: dict[bool, list[float]] = {}  # any_remote -> every rank's total, loads kept

    def _kept_totals(self, any_remote: bool) -> list[float]:
        """Every rank's total with its current loads once a replica exists (any_hot)."""
        kept = self._kept.get(any_remote)
        if kept is None:
            total = self.model.rank_total
            kept = [total(*ld, any_remote, True) for ld in zip(*self.loads, strict=True)]
            self._kept[any_remote] = kept
        return kept

    def round(self) -> bool:
        """One round of the search (see ``plan_mix``); True if an expert was accepted."""
        totals = self.totals
        best = max(totals)
        b = totals.index(best)  # the first max: the lowest bottleneck rank
        rows, local, remote, replica = (load[b] for load in self.loads)
        C, E, row_b, total = self.C, self.E, self.C[b], self.model.rank_total
        is_open, moved, total_remote = self.open, self.moved, self.total_remote
        evaluated = 0
        for g in self.order:
            if not is_open[g]:
                continue
            m = moved[g]
            if g // E == b:  # b owns g: it computes and exchanges m rows less, serves n replicas
                n = sum(1 for s, row in enumerate(C) if s != b and row[g] > 0)
                new = total(rows - m, local, remote - m, replica + n, m < total_remote, True)
            else:  # b computes its c rows of g itself and fetches a replica
                c = row_b[g]
                if c == 0:
                    continue
                new = total(rows + c, local + c, remote - c, replica + 1, m < total_remote, True)
            if not new < best:
                continue
            # listed: evaluate it on every rank unless a holder is full
            if evaluated == self.width:
                return False
            o = g // E
            src = [s for s, row in enumerate(C) if s != o and row[g] > 0]
            if any(self.held[s] >= self.max_replicas for s in src):
                is_open[g] = False  # a holder is full: g can never fit again
                continue
            evaluated += 1
            if self._try(g, o, src, best):
                return True
        return False

    def _try(self, g: int, o: int, src: list[int], best: float) -> bool:
        """Accept g if every rank's total then stays below ``best``; False (nothing changed)
        at the first rank that does not."""
        C, (rows, local, remote, replica), total = self.C, self.loads, self.model.rank_total
        m = self.moved[g]
        any_remote = m < self.total_remote
        changed = {o: (rows[o] - m, local[o], remote[o] - m, replica[o] + len(src))}
        for s in src:
            c = C[s][g]
            changed[s] = (rows[s] + c, local[s] + c, remote[s] - c, replica[s] + 1)
        new_totals = list(self._kept_totals(any_remote))
        for r, ld in changed.items():
            t = total(*ld, any_remote, True)
            if not t < best:
                return False
            new_totals[r] = t
        if not max(new_totals) < best:
            return False
        for r, ld in changed.items():
            rows[r], local[r], remote[r], replica[r] = ld
        for s in src:
            self.held[s] += 1
        self.totals, self._kept = new_totals, {}
        self.total_remote -= m
        self.open[g] = False
        self.accepted[g] = tuple(src)
        return True


def plan_shadow(
    counts_WN: object, shape: LayerShape, profile: HardwareProfile, *, overlap: bool = False
) -> Plan:
    """FasterMoE's shadowing rule (He et al., "FasterMoE: Modeling and Optimizing Training of
    Large-Scale Dynamic Pre-Trained Models", PPoPP'22, Sec. 4 "Dynamic Shadowing"; the authors'
    implementation is ``global_policy`` in FastMoE's ``fmoe/fastermoe/shadow_policy.py``).

    A shadowed expert is broadcast to every other rank (holders = all ranks but the owner) and
    every rank computes its own rows for it. With

        t_row   = flops_per_row / gemm_flops       (FasterMoE: 3 * comp_time; fwd + bwd compute)
        t_feat  = 4 * row_bytes / link_bandwidth   (FasterMoE: 4 * send_feature_time; a row goes
                                                    out and back, in forward and in backward)
        t_model = params_bytes_per_expert / link_bandwidth   (FasterMoE: send_model_time)
        B_r(S)  = rows computed at rank r when the experts in S are shadowed
                = sum_{g owned by r, g not in S} sum_s C[s][g]  +  sum_{g in S} C[r][g]
        lat(S)  = max_r B_r(S) * (t_row + t_feat) + |S| * t_model

    experts are sorted by global load L_g = sum_s C[s][g] descending (ties: lower id first);
    S starts empty and, in that order, g joins S while lat(S + {g}) < lat(S) (strictly); the
    first g that does not lower the estimate ends the search.

    Generalisation of the published rule, which assumes one expert per worker and scores a
    shadowing by the next-heaviest expert's load B_k: here the heaviest *rank* is recomputed with
    the shadowed rows counted where they are actually computed (at their sources), which coincides
    with it when E = 1 and shadowed rows are negligible next to B_k. Latency terms are not part
    of FasterMoE's estimate and are left out of the decision; ``prediction`` (full cost model,
    ``overlap`` default False) is reported for comparison.
    """
    model = step_model(shape, profile, overlap)
    C_WN, *sums = counts_with_sums(counts_WN, shape)
    W, E = shape.world_size, shape.experts_per_rank
    loads_4W, load_N, own_N = baseline_loads(C_WN, E, sums)
    model.check_exact(max(2 * int(load_N.sum()), W * shape.num_experts))
    baseline = model.prediction_W(loads_4W)
    if W == 1:
        return Plan((), (), baseline, baseline)
    t_row_feat = (
        shape.flops_per_row / profile.gemm_flops + 4 * shape.row_bytes / profile.link_bandwidth
    )
    t_model = shape.params_bytes_per_expert / profile.link_bandwidth
    load_W = load_N.view(W, E).sum(1)  # rows computed at each rank (int64)
    best = int(load_W.max()) * t_row_feat
    # load descending, ties by expert id ascending (a stable sort of the ascending ids)
    order = torch.sort(load_N, descending=True, stable=True).indices.tolist()
    load, own = load_N.tolist(), own_N.tolist()
    shadowed: list[int] = []
    for g in order:
        o = g // E
        trial_W = load_W + C_WN[:, g]
        trial_W[o] = int(load_W[o]) - load[g] + own[g]
        lat = int(trial_W.max()) * t_row_feat + (len(shadowed) + 1) * t_model
        if not lat < best:
            break
        best, load_W = lat, trial_W
        shadowed.append(g)
    hot = tuple(sorted(shadowed))
    replicas = tuple((g, tuple(r for r in range(W) if r != g // E)) for g in hot)
    if not hot:
        return Plan((), (), baseline, baseline)
    return Plan(hot, replicas, model.prediction_W(_shadow_loads(C_WN, loads_4W, hot, E)), baseline)


def _shadow_loads(
    C_WN: torch.Tensor, loads_4W: torch.Tensor, hot: tuple[int, ...], E: int
) -> torch.Tensor:
    """The aggregates (``LOADS`` order, float64 [4, W]) with every g of ``hot`` replicated on
    every rank but its owner: each source computes its own rows of g (they turn local, and stop
    being remote at the source and at the owner); the owner serves W - 1 replicas per g, every
    other rank holds one. Integer arithmetic on the baseline's exact aggregates."""
    W = C_WN.shape[0]
    g_S = torch.tensor(hot, dtype=torch.int64)
    o_S = torch.div(g_S, E, rounding_mode="floor")
    at_source_WS = C_WN[:, g_S].clone()
    at_source_WS[o_S, torch.arange(len(hot))] = 0  # the owner's own rows were local already
    moved_S = at_source_WS.sum(0)  # rows of g that travelled to its owner, now computed at home
    gained_W = at_source_WS.sum(1)
    lost_W = torch.zeros(W, dtype=torch.int64).index_add_(0, o_S, moved_S)
    owned_W = torch.bincount(o_S, minlength=W)
    delta_4W = torch.stack(
        [
            gained_W - lost_W,
            gained_W,
            -gained_W - lost_W,
            (len(hot) - owned_W) + owned_W * (W - 1),
        ]
    )
    return loads_4W + delta_4W.to(torch.float64)
