"""Today's greedy mixed-strategy planner, before ``mixmoe.placement.planner.plan_mix`` was
restructured for scale: the slow twin the tests and ``mixmoe bench planner`` compare it with;
and FasterMoE's shadowing rule on lists (``plan_shadow_lists``), the twin of ``plan_shadow``.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g; expert g is owned by rank g // E).

It works on Python lists of W x N ints and rescans the candidates after every acceptance, with
dense per-rank deltas per candidate: O(N * W) memory and time to set up, which is what made it
cost seconds at W = 1024. It shares the cost model (``StepModel.rank_seconds``, the scalar spelling
of the formulas) and the ``Plan`` record with the fast planner, nothing else.
"""

from __future__ import annotations

from mixmoe.placement.cost_model import LayerShape, StepModel, counts_as_lists, rank_loads
from mixmoe.placement.planner import Plan
from mixmoe.placement.profile import HardwareProfile

__all__ = ["plan_mix_rescan", "plan_shadow_lists"]


def plan_mix_rescan(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    max_replicas: int,
    overlap: bool = True,
) -> Plan:
    """Today's mixed-strategy planner, kept as the slow twin of ``plan_mix``: replicate while the
    predicted step time strictly drops, by first improvement with rescans over every candidate.

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
    first rank checked (the current bottleneck). W=8, N=64: ~0.3-0.6 ms on one CPU core; W=64, N=512: ~15 ms; W=1024, N=4096:
    ~1.5-2 s (GPU profile, fp16, D=1024, F=4096): the reason ``plan_mix`` replaced it.
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


def plan_shadow_lists(
    counts_WN: object, shape: LayerShape, profile: HardwareProfile, *, overlap: bool = False
) -> Plan:
    """FasterMoE's shadowing rule on Python lists, as written before ``plan_shadow`` moved to
    the counts tensor: the slow twin it is checked against (same decision, same plan, same
    prediction). The rule is documented at ``mixmoe.placement.planner.plan_shadow``."""
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
