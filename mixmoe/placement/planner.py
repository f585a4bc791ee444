"""Per-step, per-layer plans: where every expert's rows are computed, and what it should cost.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g; expert g is owned by rank g // E).

Every function here is a pure function of its arguments: no randomness, no dependence on dict or
set iteration order, ties broken by rank and expert id. Every rank that computes a plan from the
same all-gathered counts gets the same plan. Costs come from ``mixmoe.placement.cost_model``.

- ``plan_none``   (``a2a``): nothing replicated.
- ``plan_shadow`` (``shadow``): FasterMoE's shadowing rule (``mixmoe.placement.shadow``).
- ``plan_mix``    (``mix``): the best of the a2a, shadow and source-replica plans
  (``mixmoe.placement.replica_search``), then balanced by water-filling with helper ranks
  (``mixmoe.placement.level_fill``'s batched passes over ``mixmoe.placement.balance``'s state;
  ``fill="moves"``: its move-by-move search).
"""

from __future__ import annotations

import torch

from mixmoe.placement.balance import WaterFill
from mixmoe.placement.collector import collector_paused
from mixmoe.placement.cost_model import (
    LayerShape,
    Prediction,
    StepModel,
    plan_pricing,
    prediction_of,
    reprice,
    step_model,
)
from mixmoe.placement.counts import CountSums, baseline_loads, counts_with_sums
from mixmoe.placement.level_fill import fold_sum, is_level, level_fill
from mixmoe.placement.native_fill import BEATEN, filled
from mixmoe.placement.native_planner import planned
from mixmoe.placement.native_pricing import counted_baseline
from mixmoe.placement.native_pricing import prediction as compiled_prediction
from mixmoe.placement.plan import Plan
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.range_state import RangeState, start_inter, start_relay, start_totals
from mixmoe.placement.relay import node_distance
from mixmoe.placement.replica_search import LIST_LIMIT, SEARCH_WIDTH, plan_replicas
from mixmoe.placement.shadow import plan_shadow, shadow_hot
from mixmoe.placement.spread import spread_start
from mixmoe.placement.thinned import thinned_starts

__all__ = ["BLOCK_SIZE", "plan_mix", "plan_none", "plan_replicas", "plan_shadow", "replica_slots"]

BLOCK_SIZE = 64  # rows per block: shares cut segments only at whole blocks
MOVES_PER_RANK = 4  # water-filling moves at most MOVES_PER_RANK * W + 16 per plan,
MAX_MOVES = 512  # and at most MAX_MOVES (planning time at W >= 128: ~1 ms of Python per move)
BALANCED = (
    1.02  # no water-filling when the best candidate's max rank total is within 2% of the mean
)
FILL_STOP = BALANCED  # a fill stops once its max rank total is within 2% of its mean
SPREAD_WHEN = 1.05  # the spread start is filled when the best fill ends > 5% above its mean
LEVEL_PASSES = 6  # batched passes per fill (``level_fill``; most fills stop after 2-5)
# the fills from a candidate in shadow's form thinned (``thinned_starts``) run when the fill from
# it ended below THIN_WHEN of its step (in ``bench balance`` the thinned fills lowered the step
# only where it had: 33-97% below; where it had moved little, by < 1%, they lost 2-39%), and
# go on while each is the best fill so far and ends THIN_GAIN below the one before (W = 1024
# zipf:1.2 under nodes: the first gained 0.04%, and the next fill, ~1.5 ms of planning, nothing)
THIN_WHEN = 0.9
THIN_GAIN = 0.005
# ... and always where C has at most THIN_ALWAYS counts (W = 8 with 256 experts): a fill there
# is tens of microseconds, and the DeepSeek-like W = 8 walks gained up to 5.7% past the gate
THIN_ALWAYS = 2048
FILLS = ("level", "moves")  # plan_mix's fill: batched passes, or the move-by-move search
_EXP_STARTS = None
_EXP_SPREAD = True  # the spread start is filled when the best fill ends > 5% above its mean


def plan_none(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    *,
    overlap: bool = False,
    sums: CountSums | None = None,
) -> Plan:
    """The ``a2a`` plan: nothing replicated; every remote segment goes to its owner.

    ``overlap`` is the cost model's overlap setting (default False: the classic all-to-all
    dispatcher does not overlap the exchange with local compute). prediction == baseline.
    ``sums``: C's ``CountSums`` (``counts.CountSums``: no pass over C where compiled).
    """
    model = step_model(shape, profile, overlap)
    # vectorised: no W x N Python lists at scale; one pass over C (compiled where it can run)
    both = counted_baseline(counts_WN, shape, sums)
    if both is not None:
        (C_WN, *_), (loads_4W, colsum_N, _) = both
    else:
        C_WN, *sums = counts_with_sums(counts_WN, shape)
        loads_4W, colsum_N, _ = baseline_loads(C_WN, shape.experts_per_rank, sums)
    model.check_exact(max(2 * int(colsum_N.sum()), shape.world_size * shape.num_experts))
    rounds = None
    if node_distance(profile) is not None:  # topology: inter-node rows at their own link
        none = Plan((), (), _NO_PREDICTION, _NO_PREDICTION)
        loads_4W, rounds = plan_pricing(C_WN, none, shape.experts_per_rank, profile)
    baseline = prediction_of(model, loads_4W, rounds)
    return Plan((), (), baseline, baseline)


MIN_REPLICA_SLOTS = 8  # the replica budget's floor (replica_slots)


def replica_slots(max_replicas: int, experts_per_rank: int) -> int:
    """Replica slots per rank the mixed plan may fill: max(``max_replicas``, E,
    ``MIN_REPLICA_SLOTS``), 0 when ``max_replicas`` is 0 (replication off).

    Why: a helper takes rows of a few hot experts and a source replica saves a hot expert's
    traffic; the budget must let a rank hold as many replicas as it owns experts (replica memory
    at most the rank's own expert memory: 32 slots for 256 experts on 8 ranks) and at least 8
    (8 x 12.6 MB at the DeepSeek-like shape, 8 x 16.8 MB at the seeds' shape: small next to a
    GPU's memory), enough for shadow's plans in the issue-26 workloads."""
    if max_replicas == 0:
        return 0
    return max(max_replicas, experts_per_rank, MIN_REPLICA_SLOTS)


def plan_mix(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    max_replicas: int,
    overlap: bool = True,
    *,
    search_width: int = SEARCH_WIDTH,
    block_size: int = BLOCK_SIZE,
    balance: bool = True,
    fill: str = "level",
    sums: CountSums | None = None,
) -> Plan:
    """The mixed strategy's plan: the best candidate, then balanced with helper ranks.

    Candidates, each priced by the cost model with ``overlap``: ``plan_none`` (a2a),
    ``plan_shadow`` (when its replicas fit the budget) and ``plan_replicas`` (today's
    source-replica search, ``search_width``). From the best, a fill moves 64-row blocks of the
    loaded ranks' heaviest experts to helper ranks (any source's rows, the owner's own
    included), the replicas reaching their new holders by the relay (``relay_degrees``:
    scatter + all-gather, split by node with a topology): ``fill="level"`` (default) by batched passes,
    every rank above the water level at once (``mixmoe.placement.level_fill``, at most
    ``LEVEL_PASSES``), ``fill="moves"`` one move at a time off the bottleneck while the
    predicted step drops (``mixmoe.placement.balance``; slower at scale, kept for
    comparison). When the fills end more than ``SPREAD_WHEN`` above their mean, one more
    starts from ``spread_start``'s replicas (experts too heavy for one helper). When
    the step is above the baseline's mean and a fill stalled at a new holder its own rows of an expert
    took past the level (or none started from nothing replicated), the *kept* fill starts from
    nothing replicated, its new holders keeping only the whole blocks of their own rows that
    fit (``Plan.kept``; ``level_fill(kept=True)``). Last, when the best candidate holds each
    of its experts at every rank (shadow's form) and the fill from it ended below
    ``THIN_WHEN`` of its step (or C has at most ``THIN_ALWAYS`` counts), fills start from it
    thinned, its coldest experts dropped one at a
    time while each is the best fill so far and ends ``THIN_GAIN`` below the one before (``thinned_starts``: the slots it
    fills and its warm experts' copies are out of a fill's reach otherwise). With a topology the fills search on one
    link, the blend of both (``StepModel.fill_link``), and each fill's plan is priced in full
    by the 6-row pricing (``_fill_step``). The balanced
    plan is kept only if its prediction (``cost_model.plan_pricing``: shares, relay) is strictly below the
    best candidate's, so ``plan_mix`` is never predicted worse than a2a or shadow (same
    overlap) nor than the source-replica plan.

    Replica budget: ``replica_slots(max_replicas, E)`` replicas held per rank (at least E, the
    rank's own experts, and 8: ``replica_slots``); 0 turns replication off. No water-filling
    when the best candidate is balanced already (its slowest rank within ``BALANCED`` of the
    mean) or ``balance=False`` (the best candidate only, for comparison). A fill stops once its
    max rank total is within ``FILL_STOP`` of its mean; the move-by-move one also at
    ``MOVES_PER_RANK * W + 16`` moves (at most ``MAX_MOVES``) or once its mean reaches the step
    it must beat; each fill is judged by its own loads and only the winner's shares are built
    and priced. ``sums``: C's ``CountSums`` where they are known (the layer reduces C on the
    device): the compiled plan then skips its pass over C (~1.4 ms at [1024, 4096]).
    Guarantees: deterministic (same counts, same plan on every rank: ties by rank then expert
    id), every share entry passes ``Plan.check_shares(counts, E, block_size)``, no rank holds
    more than the budget's replicas, prediction.step_s <= baseline.step_s.
    """
    for name, value, lo in (
        ("max_replicas", max_replicas, 0),
        ("search_width", search_width, 1),
        ("block_size", block_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    W, E = shape.world_size, shape.experts_per_rank
    slots = replica_slots(max_replicas, E)
    if fill == "level":  # compiled whole where it can run (a topology included)
        constants = (BALANCED, FILL_STOP, SPREAD_WHEN, LEVEL_PASSES, THIN_WHEN, THIN_GAIN,
                     THIN_ALWAYS)  # fmt: skip
        plan = planned(counts_WN, shape, profile, slots, overlap, search_width, block_size,
                       balance, constants, sums)  # fmt: skip
        if plan is not None:
            return plan
    # checked and summed once for every candidate, with the aggregates with nothing replicated:
    # the replica search (but on its tiny-problem lists) and every pricing below start from
    # them; one compiled pass over C where it can run (``native_pricing.counted_baseline``:
    # measured ~3x faster at W = 8, ~1.5x at W = 1024, where C's 32 MiB cross the memory bus)
    both = counted_baseline(counts_WN, shape, sums)
    if both is not None:
        counted, base = both
        C_WN, *sums = counted
    else:
        counted = counts_with_sums(counts_WN, shape)
        C_WN, *sums = counted
        base = baseline_loads(C_WN, E, sums) if W * shape.num_experts > LIST_LIMIT else None
    best = plan_replicas(
        C_WN,
        shape,
        profile,
        slots,
        overlap,
        search_width=search_width,
        counted=counted,
        baseline=base,
    )
    model = step_model(shape, profile, overlap)
    if node_distance(profile) is not None:  # topology: the search saw one link; price it
        best = reprice(C_WN, best, model, profile)
    if W == 1 or slots == 0:
        return best
    base_4W, colsum_N, own_N = base if base is not None else baseline_loads(C_WN, E, sums)
    hot = shadow_hot(C_WN, shape, profile, colsum_N, own_N)  # plan_shadow's experts
    if hot and len(hot) <= slots:  # fits the budget: price it under mix's overlap
        replicas = tuple((g, tuple(r for r in range(W) if r != g // E)) for g in hot)
        shadow = Plan(hot, replicas, _NO_PREDICTION, _NO_PREDICTION)
        loads_4W, rounds = plan_pricing(C_WN, shadow, E, profile, base_4W=base_4W,
                                        colsum_N=colsum_N)  # fmt: skip
        pred = _prediction(model, loads_4W, rounds)
        if pred.step_s < best.prediction.step_s:
            best = shadow.priced(pred, best.baseline)
    totals = list(map(float.__add__, best.prediction.compute_s, best.prediction.comm_s))
    if not balance or max(totals) <= BALANCED * fold_sum(totals) / W:
        return _no_worse(best)  # balanced already: water-filling has little to win (planning time)
    with collector_paused():  # the search allocates ~10**4-10**5 short-lived containers
        start_loads = {}  # the fills' start loads under relay pricing, by start (key: its hot)
        if (
            best.hot
        ):  # the best candidate relayed: kept when cheaper than the owner sending every copy
            relayed = Plan(best.hot, best.replicas, best.prediction, best.baseline, relay=True)
            loads_4W, rounds = plan_pricing(C_WN, relayed, E, profile, base_4W=base_4W,
                                            colsum_N=colsum_N)  # fmt: skip
            start_loads[best.hot] = loads_4W
            pred = _prediction(model, loads_4W, rounds)
            if pred.step_s < best.prediction.step_s:
                best = relayed.priced(pred, best.baseline)
        best = _no_worse(best)
        # water-fill from the best candidate and from nothing replicated (the candidate may have
        # filled the replica slots that helpers need); the lower prediction wins, ties: the first
        # (the second only when the first stays unbalanced). Each fill is judged by its own
        # loads (equal to plan_pricing's of the plan it would emit: test_placement_balance); only
        # the winner's plan (shares) is built and priced, once
        starts = [dict(best.replicas)] + ([{}] if best.hot else [])
        # the fills search on one link: with nodes, the blend of both (StepModel.fill_link);
        # each fill's plan is then priced in full (_fill_step)
        search = model.fill_link(W, getattr(profile, "ranks_per_node", None))
        won, won_step = None, best.prediction.step_s
        from_best = best.prediction.step_s  # the step of the fill from the best candidate
        stalled = False  # a fill's max: a new holder its own rows took past the level
        from_none = False  # whether a fill started from nothing replicated
        for start in starts:
            from_none = from_none or not start
            loads_4W = start_loads.get(tuple(sorted(start)))
            state = _water_fill(C_WN, colsum_N, shape, search, start, slots, block_size,
                                profile, won_step, fill, loads_4W, base_4W)  # fmt: skip
            if state is not None:
                stalled = stalled or _stalled(state)
                step = _fill_step(state, model, C_WN, E, profile, base_4W, colsum_N)
                if start is starts[0]:
                    from_best = step
                if step < won_step:
                    won, won_step = state, step
            if won_step <= BALANCED * _fill_mean(won, best):
                break
        # still unbalanced: experts too heavy for one helper at a time (``spread_start``); the
        # spread fill runs only then (planning time) and wins only with a lower prediction
        if won_step > SPREAD_WHEN * _fill_mean(won, best):
            spread = spread_start(C_WN, colsum_N, E, slots)
            state = _water_fill(C_WN, colsum_N, shape, search, spread, slots, block_size,
                                profile, won_step, fill, None, base_4W) if spread else None  # fmt: skip
            if state is not None:
                stalled = stalled or _stalled(state)
                step = _fill_step(state, model, C_WN, E, profile, base_4W, colsum_N)
                if step < won_step:
                    won, won_step = state, step
        # the step above the level of nothing replicated (the mean of the baseline's totals; a
        # fill's own mean counts its start's copies) and a fill ended with its max at a new
        # holder whose own rows of a hot expert took it past the level (seeds W = 8 zipf:2.0:
        # ~30% of its rows), or no fill started from nothing replicated (zipf:1.2: the
        # candidate's fill looked level against its own mean): the kept fill, from nothing
        # replicated, its new holders keeping only the whole blocks of their own rows that fit
        # (``Plan.kept``); it wins only with a lower prediction
        base_mean = fold_sum(map(float.__add__, best.baseline.compute_s, best.baseline.comm_s)) / W
        if fill == "level" and (stalled or not from_none) and won_step > FILL_STOP * base_mean:
            state = _water_fill(C_WN, colsum_N, shape, search, {}, slots, block_size, profile,
                                won_step, fill, None, base_4W, kept=True)  # fmt: skip
            if state is not None:
                step = _fill_step(state, model, C_WN, E, profile, base_4W, colsum_N)
                if step < won_step:
                    won, won_step = state, step
        # the best candidate in shadow's form (each of its experts at every rank): the fill
        # from it could neither free the slots it fills nor drop a warm expert's copies. When
        # that fill had much to do (its step below THIN_WHEN of the candidate's) or C is small
        # (THIN_ALWAYS counts at most), fills from
        # the candidate thinned, its coldest experts dropped one by one (``thinned_starts``),
        # while each is the best fill so far and ends THIN_GAIN below the one before (the
        # first: the fill from the candidate); last, so that they change no other fill's test
        last = from_best
        small = W * shape.num_experts <= THIN_ALWAYS
        thinned = (
            thinned_starts(best.replicas, colsum_N, W)
            if small or from_best < THIN_WHEN * best.prediction.step_s
            else []
        )
        for start in thinned:
            state = _water_fill(C_WN, colsum_N, shape, search, start, slots, block_size,
                                profile, won_step, fill, None, base_4W)  # fmt: skip
            if state is None:
                break
            step = _fill_step(state, model, C_WN, E, profile, base_4W, colsum_N)
            if not step < won_step:  # not the best fill: the walk ends
                break
            won, won_step = state, step
            if not step < (1.0 - THIN_GAIN) * last:
                break
            last = step
        if won is None:
            return best
        plan = _fill_plan(won)
        priced = plan_pricing(C_WN, plan, E, profile, base_4W=base_4W, colsum_N=colsum_N)
        prediction = _prediction(model, *priced)
        if not prediction.step_s < best.prediction.step_s:  # the guarantee holds on the price
            return best
        return plan.priced(prediction, best.baseline)


def _no_worse(best: Plan) -> Plan:
    """``best``, or nothing replicated where ``best`` is predicted slower: with a topology the
    candidates searched on one link and repriced on both (``reprice``) may cost more than they
    save (the owner's copies crossing nodes: W = 3 in nodes of 2, 0.46 ms against 0.36 ms of
    a2a). On one link the candidates are never above it (identity)."""
    if best.prediction.step_s > best.baseline.step_s:
        return Plan((), (), best.baseline, best.baseline)
    return best


def _stalled(state: WaterFill | RangeState) -> bool:
    """Whether a level fill's max total is at a rank that its own rows of an expert took past
    the level when it became a holder (``RangeState.overshot``); False for the moves."""
    overshot = getattr(state, "overshot", None)
    if not overshot:
        return False
    totals = state.totals
    return max(range(len(totals)), key=totals.__getitem__) in overshot


LIST_PREDICTION_W = 64  # ranks up to which a Prediction is priced on lists (_prediction)


def _prediction(model: StepModel, loads_4W: torch.Tensor, rounds: int) -> Prediction:
    """``model.prediction_W(loads_4W, rounds)``: compiled with one link where it can run
    (``native_pricing.prediction``: the same Prediction, measured ~2.5-5x faster at W =
    8..256, ~1.8x at W = 1024); else on Python lists (``prediction_lists``: the same floats, bit for
    bit) up to ``LIST_PREDICTION_W`` ranks with one link, where its ~20 tensor ops cost more
    than W scalar evaluations (measured ~80 vs ~25 us at W = 8)."""
    if loads_4W.shape[0] == 4:
        prediction = compiled_prediction(model, loads_4W, rounds)
        if prediction is not None:
            return prediction
    if loads_4W.shape[0] == 4 and loads_4W.shape[1] <= LIST_PREDICTION_W:
        rows, local, remote = loads_4W[:3].to(torch.int64).tolist()
        # copies: whole ones as ints, the relay's fractional ones as floats (as ``pack`` reads
        # them)
        replica = [int(x) if x.is_integer() else x for x in loads_4W[3].tolist()]
        return model.prediction_lists(rows, local, remote, replica, rounds=rounds)
    return model.prediction_W(loads_4W, rounds)


def _fill_mean(fill: WaterFill | RangeState | None, best: Plan) -> float:
    """The mean rank total (s) of the fill's search, or of the best candidate's prediction."""
    if fill is not None:
        return fold_sum(fill.totals) / len(fill.totals)
    totals = list(map(float.__add__, best.prediction.compute_s, best.prediction.comm_s))
    return fold_sum(totals) / len(totals)


def _fill_plan(fill: WaterFill | RangeState) -> Plan:
    """The plan a fill's state stands for (unpriced): its holders by the relay, and its rows as
    ranges (``RangeState``) or share entries (``WaterFill``)."""
    if isinstance(fill, RangeState):
        hot, replicas, ranges, kept = fill.plan_fields()
        return Plan(
            hot, replicas, _NO_PREDICTION, _NO_PREDICTION, relay=True, ranges=ranges, kept=kept
        )
    hot = tuple(sorted(g for g, h in fill.holders.items() if h))
    replicas = tuple((g, tuple(fill.holders[g])) for g in hot)
    return Plan(hot, replicas, _NO_PREDICTION, _NO_PREDICTION, fill.shares(), relay=True)


def _fill_step(
    fill: WaterFill | RangeState,
    model: StepModel,
    C_WN: torch.Tensor,
    E: int,
    profile: HardwareProfile,
    base_4W: torch.Tensor | None = None,
    colsum_N: torch.Tensor | None = None,
) -> float:
    """The predicted step (s) of the plan the fill would emit: from its own loads and rounds
    (one link: the same numbers ``plan_pricing`` gives that plan), or priced in full when the
    profile has a topology (the search saw one link). ``base_4W``, ``colsum_N``: the caller's
    baseline loads and column sums, for ``plan_pricing``."""
    if node_distance(profile) is None:
        if any(fill.remote) == fill.any_remote:
            # the search's totals are those of its loads under its rounds and flags (every
            # rank recomputed when the rounds change: WaterFill.apply), so their max is the step
            return max(fill.totals)
        loads_4W = torch.tensor(
            [fill.rows, fill.local, fill.remote, fill.replica], dtype=torch.float64
        )
        compute_W, comm_W = model.seconds_W(loads_4W, bool(loads_4W[2].any()), fill.rounds)
        return float((compute_W + comm_W).max())
    plan = _fill_plan(fill)
    priced = plan_pricing(C_WN, plan, E, profile, base_4W=base_4W, colsum_N=colsum_N)
    return model.prediction_W(*priced).step_s


def _water_fill(
    C_WN: torch.Tensor,
    colsum_N: torch.Tensor,
    shape: LayerShape,
    model: StepModel,
    start: dict[int, tuple[int, ...]],
    slots: int,
    block_size: int,
    profile: HardwareProfile,
    beat: float,
    fill: str = "level",
    loads_4W: torch.Tensor | None = None,
    base_4W: torch.Tensor | None = None,
    kept: bool = False,
) -> WaterFill | RangeState | None:
    """``RangeState`` (level) or ``WaterFill`` (moves) from the replicas ``start`` after its fill; None if nothing moved.
    ``fill``: "level" (``level_fill``'s passes, up to ``LEVEL_PASSES``) or "moves" (the
    move-by-move search). Both stop once the max is within ``FILL_STOP`` of the level (the mean
    rank total); both also once the level reaches ``beat``, the step (s) the fill must beat
    (its max is never below it, and moves mostly add traffic, so the level mostly rises; the
    last moves of a nearly level fill gain < 1% each; planning time:
    ``docs/results/balance-after.md``); a level fill stopped so is dropped (None: it cannot
    win, ``level_fill``). ``loads_4W``: the start plan's
    ``plan_pricing`` under relay, when the caller has it; ``base_4W``: the aggregates with
    nothing replicated (``baseline_loads``), when the caller has them. ``kept``: the level
    fill's new holders keep only the own rows that fit under its level (``level_fill``)."""
    W, E = shape.world_size, shape.experts_per_rank
    distance = node_distance(profile)
    if loads_4W is None and not start and distance is None and base_4W is not None:
        loads_4W = base_4W  # nothing replicated, one link: plan_pricing's loads are the baseline
    if loads_4W is None:
        hot = tuple(sorted(start))
        plan = Plan(hot, tuple((g, start[g]) for g in hot), _NO_PREDICTION, _NO_PREDICTION,
                    relay=True)  # fmt: skip
        loads_4W, _ = plan_pricing(C_WN, plan, E, profile, base_4W=base_4W, colsum_N=colsum_N)
    any_remote = bool(loads_4W[2].any())
    # the search: one link (module doc); copies: float under the relay's scatter
    if fill == "level":  # compiled where it can run (``native_fill``), else Python: same state
        holders = {g: sorted(h) for g, h in start.items() if h}
        _, rounds = start_relay(holders, E, distance)
        inter_W = None  # across nodes: the copies that cross them (RangeState.split)
        if distance is not None and model.bw_far is not None:
            inter_W = start_inter(holders, E, W, distance)[1]
        if is_level(start_totals(model, loads_4W[:4], any_remote, rounds, inter_W), FILL_STOP):
            return None  # the fill's first test (RangeState's start totals): nothing would move
        args = (model, C_WN, E, start, slots, block_size, distance, colsum_N, any_remote,
                loads_4W[:4])  # fmt: skip
        state = filled(*args, LEVEL_PASSES, FILL_STOP, kept, beat)
        if state is BEATEN:
            return None
        if state is None:
            state = RangeState(*args)
            state.moves += level_fill(state, LEVEL_PASSES, FILL_STOP, kept, beat)
        # beaten: its mean reached the step it had to beat (level_fill): it cannot win
        return state if state.moves and not state.beaten else None
    state = WaterFill(model, C_WN, E, start, slots, block_size, distance, colsum_N, any_remote)
    state.set_loads([*loads_4W[:3].to(torch.int64).tolist(), loads_4W[3].tolist()], loads_4W[:4])
    state.run(min(MOVES_PER_RANK * W + 16, MAX_MOVES), beat, FILL_STOP)
    return state if state.moves else None


# a placeholder prediction for plans priced right after they are built
_NO_PREDICTION = Prediction((), (), (), (), (), float("inf"))
