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

from dataclasses import dataclass, field

from mixmoe.placement.cost_model import (
    LayerShape,
    Prediction,
    StepModel,
    counts_as_lists,
    rank_loads,
)
from mixmoe.placement.profile import HardwareProfile


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
    model = StepModel(shape, profile, overlap)
    C = counts_as_lists(counts_WN, shape)
    baseline = model.prediction(*rank_loads(C, {}, shape.experts_per_rank))
    return Plan((), (), baseline, baseline)


def plan_mix(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    max_replicas: int,
    overlap: bool = True,
) -> Plan:
    """The mixed strategy's plan: replicate while the predicted step time strictly drops.

    Candidates: experts with at least one remote row (C[s][g] > 0 for some s != owner), ordered by
    remote rows descending, then expert id ascending. Replicating g gives a replica to every rank
    s != owner with C[s][g] > 0 (all of g's rows are then computed at their sources).

    Greedy, first improvement with rescans: walk the candidates in order and accept g when (a) no
    holder would then hold more than ``max_replicas`` replicas and (b) the predicted step time
    (``cost_model``, same ``overlap``) is strictly lower than with the experts accepted so far.
    Accepting an expert can move the bottleneck, so rejected candidates are walked again, in the
    same order, skipping those evaluated since the last acceptance (their answer cannot have
    changed); the search ends after a walk that accepts nothing. A candidate blocked by (a) is
    dropped for good (replica counts only grow). Hence ``prediction.step_s <= baseline.step_s``,
    with equality only when nothing is replicated.

    Cost: O(N * W) to set up, then per evaluation O(W) at worst; a rejection usually stops at the
    first rank checked (the current bottleneck). W=8, N=64: ~0.3-0.6 ms on one CPU core.
    """
    model = StepModel(shape, profile, overlap)
    if isinstance(max_replicas, bool) or not isinstance(max_replicas, int):
        raise TypeError(f"max_replicas must be an int, got {max_replicas!r}")
    if max_replicas < 0:
        raise ValueError(f"max_replicas must be >= 0, got {max_replicas}")
    C = counts_as_lists(counts_WN, shape)
    W, E = shape.world_size, shape.experts_per_rank
    rows, local, remote, replica = rank_loads(C, {}, E)
    baseline = model.prediction(rows, local, remote, replica)
    if max_replicas == 0 or W == 1:
        return Plan((), (), baseline, baseline)

    candidates = []  # (remote rows, g, sources, then dense per-rank deltas of the four loads)
    for g, col in enumerate(zip(*C, strict=True)):
        o = g // E
        sources = tuple(s for s, c in enumerate(col) if c and s != o)
        if not sources:
            continue
        moved = sum(col[s] for s in sources)
        d_rows, d_local, d_remote, d_replica = [0] * W, [0] * W, [0] * W, [0] * W
        d_rows[o], d_remote[o], d_replica[o] = -moved, -moved, len(sources)
        for s in sources:
            d_rows[s] = d_local[s] = col[s]
            d_remote[s], d_replica[s] = -col[s], 1
        candidates.append((moved, g, sources, d_rows, d_local, d_remote, d_replica))
    candidates.sort(key=lambda cand: (-cand[0], cand[1]))

    total_remote = sum(remote) // 2
    totals = [c + m for c, m in zip(baseline.compute_s, baseline.comm_s, strict=True)]
    best = baseline.step_s
    order = _bottleneck_first(totals, best)
    held = [0] * W
    accepted: dict[int, tuple[int, ...]] = {}
    seen = [-1] * len(candidates)  # len(accepted) when each candidate was last rejected
    pending = list(range(len(candidates)))
    while pending:
        kept, progressed = [], False
        for i in pending:
            moved, g, sources, d_rows, d_local, d_remote, d_replica = candidates[i]
            if any(held[s] >= max_replicas for s in sources):
                continue  # can never fit again: replica counts only grow
            if seen[i] == len(accepted):
                kept.append(i)
                continue
            any_remote = total_remote > moved
            trial = [0.0] * W
            for r in order:  # the bottleneck first: most rejections stop there
                compute, comm = model.rank_seconds(
                    rows[r] + d_rows[r],
                    local[r] + d_local[r],
                    remote[r] + d_remote[r],
                    replica[r] + d_replica[r],
                    any_remote,
                    True,
                )
                trial[r] = compute + comm
                if not trial[r] < best:
                    seen[i] = len(accepted)
                    kept.append(i)
                    break
            else:
                for r in range(W):
                    rows[r] += d_rows[r]
                    local[r] += d_local[r]
                    remote[r] += d_remote[r]
                    replica[r] += d_replica[r]
                for s in sources:
                    held[s] += 1
                total_remote -= moved
                accepted[g] = sources
                totals, best = trial, max(trial)
                order = _bottleneck_first(totals, best)
                progressed = True
        if not progressed:
            break
        pending = kept

    if not accepted:
        return Plan((), (), baseline, baseline)
    prediction = model.prediction(rows, local, remote, replica)
    assert prediction.step_s == best < baseline.step_s, (prediction.step_s, best, baseline)
    hot = tuple(sorted(accepted))
    return Plan(hot, tuple((g, accepted[g]) for g in hot), prediction, baseline)


def _bottleneck_first(totals: list[float], step: float) -> tuple[int, ...]:
    """Ranks in evaluation order: the lowest rank at the max first, then the others ascending."""
    b = totals.index(step)
    return (b, *range(b), *range(b + 1, len(totals)))


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
    model = StepModel(shape, profile, overlap)
    C = counts_as_lists(counts_WN, shape)
    W, E, N = shape.world_size, shape.experts_per_rank, shape.num_experts
    baseline = model.prediction(*rank_loads(C, {}, E))
    if W == 1:
        return Plan((), (), baseline, baseline)
    t_row_feat = (
        shape.flops_per_row / profile.gemm_flops + 4 * shape.row_bytes / profile.link_bandwidth
    )
    t_model = shape.params_bytes_per_expert / profile.link_bandwidth
    load_N = [sum(C[s][g] for s in range(W)) for g in range(N)]
    load_W = [sum(load_N[r * E : (r + 1) * E]) for r in range(W)]
    shadowed: list[int] = []
    best = max(load_W) * t_row_feat
    for g in sorted(range(N), key=lambda g: (-load_N[g], g)):
        o = g // E
        trial = [load_W[r] + C[r][g] for r in range(W)]
        trial[o] = load_W[o] - load_N[g] + C[o][g]
        lat = max(trial) * t_row_feat + (len(shadowed) + 1) * t_model
        if not lat < best:
            break
        best, load_W = lat, trial
        shadowed.append(g)
    hot = tuple(sorted(shadowed))
    replicas = tuple((g, tuple(r for r in range(W) if r != g // E)) for g in hot)
    prediction = model.prediction(*rank_loads(C, dict(replicas), E)) if hot else baseline
    return Plan(hot, replicas, prediction, baseline)
