"""Source replicas: the mixed strategy's replica search before helpers (``plan_replicas``).

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g; expert g is owned by rank g // E).

A replicated expert goes to every rank that routes rows to it, and those rows are computed at their
source (their token traffic vanishes); experts are accepted greedily, bottleneck first, while the
predicted step strictly drops. ``plan_mix`` (``mixmoe.placement.planner``) uses this plan as one of
its candidates and balances the ranks from the best one (``mixmoe.placement.balance``).
Deterministic: no randomness, stable sorts, ties by rank then expert id.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator

import torch

from mixmoe.placement import native_search
from mixmoe.placement.cost_model import LayerShape, Prediction, StepModel, step_model
from mixmoe.placement.counts import baseline_loads, counts_as_lists, counts_with_sums
from mixmoe.placement.plan import Plan
from mixmoe.placement.profile import HardwareProfile

__all__ = ["plan_replicas"]

# candidates evaluated in full per round of the search (the top of the bottleneck's list)
SEARCH_WIDTH = 8


def plan_replicas(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    max_replicas: int,
    overlap: bool = True,
    *,
    search_width: int = SEARCH_WIDTH,
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    baseline: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> Plan:
    """Today's mixed-strategy search (before helpers): replicate while the predicted step strictly
    drops. ``plan_mix`` starts from its plan (one candidate) and balances from there.

    ``counts_WN``: an integer CPU tensor [W, N] (the all-gathered counts; int64 is used without a
    copy) or [W][N] nested sequences of ints (converted: slow at scale, pass the tensor).
    ``counted``: ``counts_with_sums(counts_WN, shape)`` when the caller has it (``plan_mix``:
    the counts are then checked and summed once per plan, ~4 ms at [1024, 4096]); ``baseline``:
    ``baseline_loads(C_WN, E, sums)`` of them when the caller has it (read, never changed; the
    tiny problems of ``_plan_mix_lists`` do not use it).

    Placement rule: replicating g gives a replica to every rank s != owner with C[s][g] > 0 (all
    of g's rows are then computed at their sources). Candidates: experts with a remote row.

    Search, bottleneck first. The step is the max over ranks, so an expert can only lower it if
    it lowers the total of the bottleneck b (the lowest rank at the max). b's total depends on
    b's own loads and on two group-wide flags (``StepModel.rank_seconds``): whether the token
    collectives run (any remote row left anywhere) and whether the weight collectives run (any
    replica). A replica only ever turns the weight flag on, so an expert lowers b's total only
    if it touches b: b owns it (b then computes and exchanges fewer rows, and serves the
    replicas) or b sends it rows (b then computes them itself and fetches a replica); or if it
    ends the token phase, which needs it to hold every remote row left: then it is the one
    expert with remote rows, so the last candidate, and b keeps its loads but stops paying the
    token collectives' latency (``TOKEN_COLLECTIVES`` x link latency, less what overlap hid).
    Each round:

    1. b's new total is scored for every candidate: b's own E experts one by one, the others
       as one vector over b's row of C, skipped when a bound proves none of them can lower b
       (``_sources_may_pass``: the usual case, a replica costing more than b's biggest segment
       saves), and the last candidate without b's loads as above; those that lower it, by
       remote rows descending then expert id ascending (the priority of today's greedy), are
       the round's shortlist;
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
    ``counts_with_sums``), then per round a few dozen vector ops over N and [search_width, W]
    (``_MixSearch``). Where per-op overhead is the cost, the same search runs in other forms,
    with the same decisions (a test forces each on the same cases): tiny problems (W x N <=
    ``LIST_LIMIT``) on Python lists from the validated counts, no tensor op after them
    (``_plan_mix_lists``, ``_ListMixSearch``); up to ``HOST_LIMIT`` ranks with the loads on the
    host and the counts in the tensor (``_HostMixSearch``: a column per evaluation, one vector
    over b's row when the bound lets a source pass); above, small ones (open candidates x W <=
    ``BATCH_LIMIT``) score every candidate at once in the rounds after the first acceptance
    (``_BatchedMixSearch``). The host forms hold the GIL while they search (tens to hundreds of
    microseconds); the tensor ops of the large problems release it in their kernels. Where the
    planner's library is built (``native_lib``), the search runs compiled instead, at every size
    (``native_search``: ``_ListMixSearch``'s rounds in C++, the same plans; a test forces it
    against every Python form), the GIL released.
    """
    model = step_model(shape, profile, overlap)
    for name, value, lo in (("max_replicas", max_replicas, 0), ("search_width", search_width, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")
    # compiled: the same plans (test_native_search.py), faster at every size measured (2.2-6x
    # at W = 8..1024, 8192 tokens, GPU_PROFILE: plan_replicas 0.18 -> 0.05 ms at W = 8 zipf:1.2,
    # 1.4 -> 0.57 ms at W = 1024), so no threshold
    if native_search.available(model):
        plan = _plan_compiled(
            counts_WN, shape, model, max_replicas, search_width, counted, baseline
        )
        if plan is not None:
            return plan
    if shape.world_size * shape.num_experts <= LIST_LIMIT:
        return _plan_mix_lists(counts_WN, shape, model, max_replicas, search_width)
    C_WN, *sums = counted if counted is not None else counts_with_sums(counts_WN, shape)
    W, E = shape.world_size, shape.experts_per_rank
    loads_4W, colsum_N, own_N = baseline if baseline is not None else baseline_loads(C_WN, E, sums)
    model.check_exact(max(2 * int(colsum_N.sum()), W * shape.num_experts))
    moved_N = colsum_N - own_N
    total_remote = int(moved_N.sum())
    if W <= HOST_LIMIT:  # the loads on the host: the baseline priced on lists (same floats)
        loads = loads_4W.to(torch.int64).tolist()
        baseline = model.prediction_lists(*loads)
        if max_replicas == 0 or W == 1 or total_remote == 0:
            return Plan((), (), baseline, baseline)
        totals = list(map(operator.add, baseline.compute_s, baseline.comm_s))
        host = _HostMixSearch(
            model, C_WN, E, max_replicas, search_width, loads, totals, moved_N, total_remote
        )
        while host.round():
            pass
        if not host.accepted:
            return Plan((), (), baseline, baseline)
        return _plan_of(host.accepted, model.prediction_lists(*host.loads), baseline)
    compute_W, comm_W = model.seconds_W(loads_4W, total_remote > 0, False)
    baseline = model.pack(compute_W, comm_W, loads_4W)
    if max_replicas == 0 or W == 1 or total_remote == 0:
        return Plan((), (), baseline, baseline)
    search = _MixSearch(model, C_WN, E, max_replicas, search_width)
    search.start(loads_4W, compute_W + comm_W, moved_N, total_remote)
    # the first round shortlists (often the only one: nothing pays); once an expert is accepted,
    # a small problem scores every open candidate per round instead (same decisions)
    if search.round():
        if search.n_open * W <= BATCH_LIMIT:
            search = _BatchedMixSearch.resume(search)
        while search.round():
            pass
    if not search.accepted:
        return Plan((), (), baseline, baseline)
    if search.seconds is None:
        return _plan_of(search.accepted, model.prediction_W(search.loads_4W), baseline)
    # the last acceptance's seconds: the same flags as prediction_W's (remote rows are left
    # iff its expert did not hold the last ones; a replica exists)
    return _plan_of(search.accepted, model.pack(*search.seconds, search.loads_4W), baseline)


def _plan_compiled(
    counts_WN: object,
    shape: LayerShape,
    model: StepModel,
    max_replicas: int,
    width: int,
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    baseline: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> Plan | None:
    """``plan_replicas`` with its search compiled (``native_search``, ``native_lib.available``):
    the counts validated and summed as the Python paths do (the same errors), the search, the
    loads and both predictions in one C++ call; None where ``native_search.searched`` is."""
    C_WN, colsum_N, _ = counted if counted is not None else counts_with_sums(counts_WN, shape)
    W, N = shape.world_size, shape.num_experts
    model.check_exact(max(2 * int(colsum_N.sum()), W * N))
    loads_4W = baseline[0] if baseline is not None else None  # None: built in the C++
    found = native_search.searched(
        C_WN, shape.experts_per_rank, model, max_replicas, width, colsum_N, loads_4W
    )
    if found is None:  # byte counts past int64: the Python paths price them as Python ints
        return None
    replicas, prediction, base = found
    if not replicas:
        return Plan((), (), base, base)
    return _plan_of(dict(replicas), prediction, base)


def _plan_of(
    accepted: dict[int, tuple[int, ...]], prediction: Prediction, baseline: Prediction
) -> Plan:
    """The ``Plan`` of a search that accepted ``accepted`` ({g: holders}, not empty)."""
    assert prediction.step_s < baseline.step_s, (prediction.step_s, baseline.step_s)
    hot = tuple(sorted(accepted))
    return Plan(hot, tuple((g, accepted[g]) for g in hot), prediction, baseline)


# how one replicated expert changes the loads (LOADS order: rows, local, remote, replica) of a
# rank that sends it c rows: c * _PER_ROW + _PER_REPLICA; its owner's change is patched in apart
_PER_ROW_41 = torch.tensor([1.0, 1.0, -1.0, 0.0], dtype=torch.float64).view(4, 1)
_PER_REPLICA_4 = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
_PER_REPLICA_41 = _PER_REPLICA_4.view(4, 1)
# the owner of a replicated expert with m remote rows: m * _OWNER_PER_ROW + holders * _PER_REPLICA
_OWNER_PER_ROW_4 = torch.tensor([-1.0, 0.0, -1.0, 0.0], dtype=torch.float64)


class _MixSearch:
    """``plan_mix``'s search state. loads_4W: the per-rank aggregates with the experts accepted
    so far (float64 [4, W] holding integers, ``LOADS`` order), totals_W their predicted seconds,
    held_W the replicas each rank holds (full_W: at ``max_replicas``), moved_N each expert's
    remote rows, open_N whether it is still a candidate (n_open of them), total_remote the
    remote rows left in the group, accepted {g: holders}.

    Per-op overhead, not arithmetic, is the cost up to a few hundred ranks, so a round does
    what it can on the host: b's own E experts are scored with ``StepModel.rank_total``, and
    the vector over b's row of C (b as a source of every expert) runs only when a bound says a
    source candidate may pass (``_sources_may_pass``). The problems it runs (W > ``HOST_LIMIT``)
    are large enough that a vector over W costs less than W host calls."""

    def __init__(
        self, model: StepModel, C_WN: torch.Tensor, E: int, max_replicas: int, width: int
    ) -> None:
        self.model, self.C_WN, self.E = model, C_WN, E
        self.max_replicas, self.width = max_replicas, width
        self.accepted: dict[int, tuple[int, ...]] = {}
        self.seconds: tuple[torch.Tensor, torch.Tensor] | None = None  # of the last acceptance

    def start(
        self,
        loads_4W: torch.Tensor,
        totals_W: torch.Tensor,
        moved_N: torch.Tensor,
        total_remote: int,
    ) -> None:
        self.loads_4W, self.totals_W, self.total_remote = loads_4W, totals_W, total_remote
        self.held_W = torch.zeros(len(totals_W), dtype=torch.int64)
        self.full_W = torch.zeros(len(totals_W), dtype=torch.bool)
        self.moved_N = moved_N.to(torch.float64)
        self.open_N = moved_N > 0
        self.n_open = int(self.open_N.sum())

    def _totals(self, loads: torch.Tensor, any_remote: bool | torch.Tensor) -> torch.Tensor:
        compute, comm = self.model.seconds_W(loads, any_remote, True)
        return compute + comm

    def shortlist(self, b: int, best: float) -> list[int]:
        """Open candidates that would bring rank b's total below ``best``, in priority order."""
        E, C_WN, total = self.E, self.C_WN, self.model.rank_total
        lo, hi = b * E, (b + 1) * E
        loads_b = self.loads_4W[:, b]
        rows, local, remote, replica = (int(x) for x in loads_b.tolist())
        listed: list[int] = []
        # b as the owner of g: b no longer computes nor exchanges g's m remote rows and serves
        # one replica to each of g's n sources (E candidates: on the host)
        open_E = self.open_N[lo:hi].tolist()
        if any(open_E):
            n_E = (C_WN[:, lo:hi] > 0).sum(0).tolist()
            c_E = C_WN[b, lo:hi].tolist()
            m_E = self.moved_N[lo:hi].tolist()
            for i, is_open in enumerate(open_E):
                if not is_open:
                    continue
                m, n = int(m_E[i]), n_E[i] - (c_E[i] > 0)
                any_remote = m < self.total_remote
                if total(rows - m, local, remote - m, replica + n, any_remote, True) < best:
                    listed.append(lo + i)
        # b as a source of g: b computes its c rows of g itself and fetches one replica
        if self.n_open > sum(open_E):
            c_N = C_WN[b]
            # with two open candidates or more, none holds every remote row left: the token
            # collectives still run after any of them; with one, its own flag
            last = int(self.open_N.nonzero()) if self.n_open == 1 else -1
            any_remote = last < 0 or int(self.moved_N[last]) < self.total_remote
            if not any_remote and not int(c_N[last]):
                # the last candidate ends the token phase and b sends it no row: b keeps its
                # loads and stops paying the token collectives (listed is empty: n_open == 1)
                return [last] if total(rows, local, remote, replica, False, True) < best else []
            cmax = max(
                int(c_N[:lo].max()) if lo else 0, int(c_N[hi:].max()) if hi < len(c_N) else 0
            )
            loads = (rows, local, remote, replica)
            if _sources_may_pass(self.model, loads, cmax, any_remote, best):
                trial_4N = c_N * _PER_ROW_41 + (loads_b + _PER_REPLICA_4).view(4, 1)
                compute_N, comm_N = self.model.seconds_W(trial_4N, any_remote, True)
                listed_N = (compute_N + comm_N < best) & (c_N > 0) & self.open_N
                listed_N[lo:hi] = False  # b's own experts: scored above
                listed += listed_N.nonzero().squeeze(1).tolist()
        if len(listed) < 2:
            return listed
        # priority order: remote rows descending, expert id ascending
        moved = self.moved_N[listed].tolist()
        return [g for _, g in sorted(zip((-m for m in moved), listed, strict=True))]

    def round(self) -> bool:
        """One round of the search (see ``plan_mix``); True if an expert was accepted."""
        b = int(self.totals_W.argmax())  # the first max: the lowest bottleneck rank
        best = float(self.totals_W[b])
        shortlist, budget = self.shortlist(b, best), self.width
        while budget > 0 and shortlist:
            batch, shortlist = shortlist[:budget], shortlist[budget:]
            trial_k4W, compute_kW, comm_kW, src_kW, blocked_k = self._evaluate(batch)
            totals_kW = compute_kW + comm_kW
            passes = (totals_kW.amax(1) < best).tolist()
            blocked = blocked_k.tolist()
            for i, g in enumerate(batch):
                if blocked[i]:
                    self._close(g)  # a holder is full: g can never fit again
                elif passes[i]:
                    self._accept(g, trial_k4W[i], totals_kW[i], src_kW[i])
                    self.seconds = (compute_kW[i], comm_kW[i])
                    return True
            budget -= len(blocked) - sum(blocked)
        return False

    def _evaluate(
        self, g_k: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each candidate of ``g_k`` accepted on its own: the loads [k, 4, W], compute and comm
        seconds [k, W], holders (bool [k, W]) and whether a holder is full (bool [k])."""
        g_t = torch.tensor(g_k)
        ar_k, o_k = torch.arange(len(g_k)), torch.div(g_t, self.E, rounding_mode="floor")
        # a copy (the owners' own rows are zeroed next): rows of C's transpose, ~3x faster
        # than C[:, g] at W = 1024
        c_kW = self.C_WN.t().index_select(0, g_t)
        c_kW[ar_k, o_k] = 0
        src_kW = c_kW > 0
        trial_k4W = self.loads_4W + c_kW.unsqueeze(1) * _PER_ROW_41
        trial_k4W[:, 3] += src_kW
        m_k = self.moved_N[g_t]
        owner_k4 = (
            m_k.unsqueeze(1) * _OWNER_PER_ROW_4 + src_kW.sum(1, keepdim=True) * _PER_REPLICA_4
        )
        trial_k4W[ar_k, :, o_k] += owner_k4
        blocked_k = (src_kW & self.full_W).any(1)
        # every candidate leaves remote rows but possibly the last open one (see shortlist)
        any_remote = True if self.n_open > 1 else (m_k < self.total_remote).view(-1, 1)
        compute_kW, comm_kW = self.model.seconds_W(trial_k4W, any_remote, True)
        return trial_k4W, compute_kW, comm_kW, src_kW, blocked_k

    def _deltas(self, g_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """How accepting each candidate of ``g_k`` on its own changes every rank's loads
        (float64 [k, 4, W]), its holders (bool [k, W]) and its remote rows (float64 [k])."""
        ar = torch.arange(len(g_k))
        o_k = torch.div(g_k, self.E, rounding_mode="floor")
        c_kW = self.C_WN.t().index_select(0, g_k).to(torch.float64)
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
        self.loads_4W, self.totals_W, self.seconds = loads_4W, totals_W, None
        self.held_W += src_W
        self.full_W = self.held_W >= self.max_replicas
        self.total_remote -= int(self.moved_N[g])
        self._close(g)
        self.accepted[g] = tuple(src_W.nonzero().squeeze(1).tolist())

    def _close(self, g: int) -> None:
        self.open_N[g] = False
        self.n_open -= 1


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
    same ``seconds_W``): the shortlist is the open candidates that touch the bottleneck b (or
    end the token phase: see ``plan_mix``) and lower its total; the first ``width`` of them that no full holder blocks are the evaluated
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
        self.ends_remote_P = ~self.any_remote_P1.view(-1)
        self.blocked_P = (self.src_PW & (self.held_W >= self.max_replicas)).any(1)

    def round(self) -> bool:
        b = int(self.totals_W.argmax())  # the first max: the lowest bottleneck rank
        best = float(self.totals_W[b])
        trial_P4W = self.loads_4W + self.delta_P4W
        totals_PW = self._totals(trial_P4W, self.any_remote_P1)
        # a candidate lowers b's total only if it changes b's loads or ends the token phase
        touches_P = self.src_PW[:, b] | (self.o_P == b) | self.ends_remote_P
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
    an exact Python int and every second comes from ``StepModel.total_fn`` / ``seconds_fn``
    (``rank_total`` / ``rank_seconds`` bit for bit), equal to ``seconds_W`` bit for bit on the
    same integer loads, so the
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
    return _plan_of(search.accepted, model.prediction_lists(*search.loads), baseline)


class _ListMixSearch:
    """``_MixSearch`` on the host: loads, totals, replica counts and candidates in Python
    lists, seconds from ``StepModel.total_fn`` (``rank_total``'s floats; see
    ``_plan_mix_lists``); the counts on Python lists too.

    The same search step for step: the bottleneck b, its shortlist (open candidates touching b,
    or the last one when it ends the token phase, whose new total at b drops below the step, by
    remote rows descending then expert id), the
    first ``width`` unblocked ones evaluated on every rank, the first whose step drops accepted.
    Walked lazily: the shortlist is consumed in priority order and each listed candidate is
    evaluated as soon as it is reached, so a round stops at the first acceptance (or the
    width); a listed candidate with a full holder is closed when it is reached, as in
    ``_MixSearch``, and the candidates after the stop are left as they are, so no decision
    differs. An evaluation stops at the first rank whose new total is not below the step; the
    ranks it does not touch keep their loads, so their totals are computed once per acceptance.
    b's row is scored only when ``_sources_may_pass`` says a source candidate may pass.
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
        is_open: list[bool] | None = None,
    ) -> None:
        """``is_open``: whether each expert is a candidate (has remote rows); computed here
        when not given."""
        self.model, self.C, self.E = model, C, E
        self.max_replicas, self.width = max_replicas, width
        self.accepted: dict[int, tuple[int, ...]] = {}
        self.loads, self.totals = loads, totals  # [rows, local, remote, replica] x W ints
        self.moved, self.total_remote = moved, total_remote
        self.held = [0] * len(totals)
        self.open = [m > 0 for m in moved] if is_open is None else is_open
        self.n_open = sum(self.open)
        # any_remote -> each rank's total with its current loads (None: not computed yet)
        self._kept: dict[bool, list[float | None]] = {}
        # any_remote -> ``StepModel.total_fn(any_remote, True)``: ``rank_total`` bit for bit
        self._total_fns: dict[bool, Callable[[int, int, int, int], float]] = {}

    def _total(self, any_remote: bool) -> Callable[[int, int, int, int], float]:
        """A rank's total with a replica somewhere and the token flag ``any_remote``."""
        fn = self._total_fns.get(any_remote)
        if fn is None:
            fn = self._total_fns[any_remote] = self.model.total_fn(any_remote, True)
        return fn

    @functools.cached_property
    def order(self) -> list[int]:
        """The candidates in priority order: remote rows descending, expert id ascending."""
        return sorted((g for g, m in enumerate(self.moved) if m > 0), key=self._priority)

    def _priority(self, g: int) -> tuple[int, int]:
        return -self.moved[g], g

    def _column(self, g: int) -> list[int]:
        """C[s][g] for every rank s."""
        return [row[g] for row in self.C]

    def _listed(self, b: int, best: float) -> Iterator[int]:
        """b's shortlist (see the class doc), lazily, in priority order."""
        rows, local, remote, replica = (load[b] for load in self.loads)
        C, E, row_b, total = self.C, self.E, self.C[b], self._total
        lo, hi = b * E, (b + 1) * E
        cmax = max(max(row_b[:lo], default=0), max(row_b[hi:], default=0))
        # with two open candidates or more none holds every remote row left: the token
        # collectives run after any of them (with one, the weaker bound without them)
        loads_b = (rows, local, remote, replica)
        sources = _sources_may_pass(self.model, loads_b, cmax, self.n_open > 1, best)
        for g in self.order:
            if not self.open[g]:
                continue
            m = self.moved[g]
            if lo <= g < hi:  # b owns g: it computes and exchanges m rows less, serves n replicas
                n = sum(1 for s, row in enumerate(C) if s != b and row[g] > 0)
                new = total(m < self.total_remote)(rows - m, local, remote - m, replica + n)
            elif row_b[g]:  # b computes its c rows of g itself and fetches a replica
                if not sources:
                    continue
                c = row_b[g]
                new = total(m < self.total_remote)(rows + c, local + c, remote - c, replica + 1)
            elif m == self.total_remote:  # g, the last candidate, ends the token phase
                new = total(False)(rows, local, remote, replica)
            else:
                continue
            if new < best:
                yield g

    def _close(self, g: int) -> None:
        self.open[g] = False
        self.n_open -= 1

    def round(self) -> bool:
        """One round of the search (see ``plan_mix``); True if an expert was accepted."""
        totals = self.totals
        best = max(totals)
        b = totals.index(best)  # the first max: the lowest bottleneck rank
        evaluated = 0
        for g in self._listed(b, best):
            if evaluated == self.width:
                return False
            o, col = g // self.E, self._column(g)
            src = [s for s, c in enumerate(col) if c > 0 and s != o]
            if any(self.held[s] >= self.max_replicas for s in src):
                self._close(g)  # a holder is full: g can never fit again
                continue
            evaluated += 1
            if self._try(g, o, col, src, best):
                return True
        return False

    def _try(self, g: int, o: int, col: list[int], src: list[int], best: float) -> bool:
        """Accept g if every rank's total then stays below ``best``; False (nothing changed)
        at the first rank that does not."""
        (rows, local, remote, replica) = self.loads
        m = self.moved[g]
        any_remote = m < self.total_remote
        total = self._total(any_remote)
        changed = {o: (rows[o] - m, local[o], remote[o] - m, replica[o] + len(src))}
        for s in src:
            c = col[s]
            changed[s] = (rows[s] + c, local[s] + c, remote[s] - c, replica[s] + 1)
        new = {}
        for r, ld in changed.items():
            t = total(*ld)
            if not t < best:
                return False
            new[r] = t
        kept = self._kept.get(any_remote)
        if kept is None:  # the other ranks' totals with their loads (each computed once)
            kept = self._kept[any_remote] = [None] * len(rows)
        for r, t in enumerate(kept):
            if t is None and r not in new:
                kept[r] = t = total(rows[r], local[r], remote[r], replica[r])
            if r not in new and not t < best:
                return False
        new_totals = [new.get(r, t) for r, t in enumerate(kept)]
        for r, ld in changed.items():
            rows[r], local[r], remote[r], replica[r] = ld
        for s in src:
            self.held[s] += 1
        self.totals, self._kept = new_totals, {}
        self.total_remote -= m
        self._close(g)
        self.accepted[g] = tuple(src)
        return True


# _HostMixSearch runs where W is at most this: evaluating a candidate on the host costs W calls
# of ``rank_total`` (~0.5 us each), below the ~25 tensor ops of an evaluation up to about here
# (measured: host 2x faster at W = 16, even at W = 64, 1.3x slower at W = 128)
HOST_LIMIT = 64


class _HostMixSearch(_ListMixSearch):
    """``_ListMixSearch`` with the counts left in the tensor ``C_WN`` (W <= ``HOST_LIMIT``, W x N
    too large for lists): a column of C comes to the host when a candidate is evaluated, b's
    own experts are scored on the host, and b's row is scored as one vector (when the bound
    lets a source candidate pass). Same decisions (a test forces every path)."""

    def __init__(
        self,
        model: StepModel,
        C_WN: torch.Tensor,
        E: int,
        max_replicas: int,
        width: int,
        loads: list[list[int]],
        totals: list[float],
        moved_N: torch.Tensor,
        total_remote: int,
    ) -> None:
        """``loads``: the baseline's [rows, local, remote, replica] lists of W ints (kept and
        updated: the search's own), ``totals`` their seconds per rank."""
        self.C_WN, self.open_N = C_WN, moved_N > 0
        super().__init__(
            model,
            [],
            E,
            max_replicas,
            width,
            loads,
            totals,
            moved_N.tolist(),
            total_remote,
            self.open_N.tolist(),
        )

    def _column(self, g: int) -> list[int]:
        return self.C_WN[:, g].tolist()

    def _close(self, g: int) -> None:
        super()._close(g)
        self.open_N[g] = False

    def _listed(self, b: int, best: float) -> Iterator[int]:
        loads_b = tuple(load[b] for load in self.loads)
        rows, local, remote, replica = loads_b
        E, C_WN, total = self.E, self.C_WN, self._total
        lo, hi = b * E, (b + 1) * E
        listed: list[int] = []
        # b as the owner of g: b no longer computes nor exchanges g's m remote rows and serves
        # one replica to each of g's n sources (E candidates)
        open_own = [g for g in range(lo, hi) if self.open[g]]
        if open_own:
            n_E = (C_WN[:, lo:hi] > 0).sum(0).tolist()
            c_E = C_WN[b, lo:hi].tolist()
            for g in open_own:
                m, n = self.moved[g], n_E[g - lo] - (c_E[g - lo] > 0)
                any_remote = m < self.total_remote
                if total(any_remote)(rows - m, local, remote - m, replica + n) < best:
                    listed.append(g)
        # b as a source of g: b computes its c rows of g itself and fetches one replica
        if self.n_open > len(open_own):
            c_N = C_WN[b]
            # with two open candidates or more none holds every remote row left, so the token
            # collectives still run after any of them; with one, its own flag
            last = int(self.open_N.nonzero()) if self.n_open == 1 else -1
            any_remote = last < 0 or self.moved[last] < self.total_remote
            if not any_remote and not int(c_N[last]):
                # the last candidate ends the token phase and b sends it no row: b keeps its
                # loads and stops paying the token collectives (listed is empty: n_open == 1)
                ends = total(False)(rows, local, remote, replica) < best
                return iter([last] if ends else [])
            cmax = max(
                int(c_N[:lo].max()) if lo else 0, int(c_N[hi:].max()) if hi < len(c_N) else 0
            )
            if _sources_may_pass(self.model, loads_b, cmax, any_remote, best):
                base_41 = torch.tensor(
                    [rows, local, remote, replica + 1], dtype=torch.float64
                ).view(4, 1)
                compute_N, comm_N = self.model.seconds_W(
                    c_N * _PER_ROW_41 + base_41, any_remote, True
                )
                listed_N = (compute_N + comm_N < best) & (c_N > 0) & self.open_N
                listed_N[lo:hi] = False  # b's own experts: scored above
                listed += listed_N.nonzero().squeeze(1).tolist()
        return iter(sorted(listed, key=self._priority))


def _sources_may_pass(
    model: StepModel,
    loads_b: tuple[int, int, int, int],
    cmax: int,
    any_remote: bool,
    best: float,
) -> bool:
    """Whether some expert that rank b does not own may bring b's total below ``best``; False
    is a proof that none can, so b's row of C need not be scored.

    b holds ``loads_b`` (rows, local, remote, replica) and sends at most ``cmax`` rows to one
    expert of another rank. Replicating an expert it sends c rows to gives b the loads
    (rows + c, local + c, remote - c, replica + 1), whose seconds are compute(c) + comm(c)
    (``StepModel.rank_seconds``); along that path compute never decreases and comm never
    increases (more rows computed at b, fewer sent: a test checks both on random loads), so
    for every c in [lo, hi], compute(c) + comm(c) >= compute(lo) + comm(hi) (float addition
    is monotone too). Branch and bound over [1, cmax]: an interval whose bound is not
    below ``best`` holds no passing c; the others are halved until the budget of intervals is
    spent (then True: maybe) or a single c passes (True). ``any_remote`` False gives a weaker
    bound that holds for either flag (no token term)."""
    if cmax == 0:
        return False  # b sends no rows to other ranks' experts
    rows, local, remote, replica = loads_b
    seconds = model.seconds_fn(any_remote, True)  # ``rank_seconds`` bit for bit

    def bound(lo: int, hi: int) -> float:
        compute = seconds(rows + lo, local + lo, remote - lo, replica + 1)[0]
        comm = seconds(rows + hi, local + hi, remote - hi, replica + 1)[1]
        return compute + comm

    intervals = [(1, cmax)]
    for _ in range(_BOUND_INTERVALS):
        if not intervals:
            return False
        lo, hi = intervals.pop()
        if not bound(lo, hi) < best:
            continue
        if lo == hi:
            return True  # compute(c) + comm(c) is b's new total at c: it passes
        mid = (lo + hi) // 2
        intervals += [(mid + 1, hi), (lo, mid)]
    return bool(intervals)


# the intervals _sources_may_pass examines at most before it answers "maybe"
_BOUND_INTERVALS = 32
