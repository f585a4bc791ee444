"""A mixed plan carried over to another step's counts: planning a step ahead.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s
routes to expert g; expert g is owned by o = g // E), T_g the length of g's stream
(``mixmoe.placement.ranges``: the rows its owner computes under the replica rule).

Why: the layer waits for its plan (its background thread overlaps only each rank's own rows,
~1/W of them), so a plan made from a step's own counts costs the step its whole planning time
(``mixmoe bench planner``'s "exposed ms": 1.2 ms of a 6.2 ms step at W = 256, 5.1 of 6.2 at
W = 1024). A plan made from the *previous* step's counts can be made while that step runs; what
the new step must do on its critical path is only to fit it to its own counts (``refit_plan``).
Expert popularity moves slowly in training, and a plan's worth is mostly in which experts are
replicated where and how much each helper takes, which carries over.

The refit keeps the plan's hot experts, holders and relay flag. A kept holder (``Plan.kept``:
y computes L of its own rows of g, whole blocks, the rest stays in g's stream) keeps L while
L < C[y][g] on the new counts, else computes all its own rows (a plain holder): the capacity the
plan gave it is kept, so a plan whose balance rests on its kept holders stays balanced (before
they were dropped, and such plans went stale: 4 gloo ranks in two nodes, a fit 1.39x its plan's
step on counts a few rows apart). Each helper of expert g takes the same share of g's stream
as before (its rows times T_g after / T_g before, cut again at the stream's allowed positions:
``ranges.cut_ranges_many``; T_g counts the kept holders' rests, before and after). Share
entries (the move-by-move planner's; they name segments, not shares of a stream) are dropped.
The result is a valid plan for the new counts (``Plan.check_shares``), priced on them; where
it is not strictly below nothing replicated (the same model), nothing replicated is returned:
never predicted worse than ``a2a``'s plan under the same overlap, as ``plan_mix``. Refitted to
the counts it was made for, a plan without share entries is returned unchanged, prices
included. ``carried_plan`` (the layer's) does not fit a plan whose hot experts lost over half
their share of the rows (``moved``: a rotating hotspot's next step), and drops a fit predicted
more than ``REFIT_SLACK`` above its plan's own step: the step then plans afresh.
"""

from __future__ import annotations

import dataclasses

import torch

from mixmoe.placement.cost_model import LayerShape, counts_as_tensor, reprice, step_model
from mixmoe.placement.counts import CountSums
from mixmoe.placement.native_planner import HOT_MOVED, refitted
from mixmoe.placement.plan import Plan
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.ranges import cut_ranges_many

__all__ = ["MOVED", "REFIT_SLACK", "carried_plan", "moved", "refit_plan", "refit_python"]

# a fitted plan predicted more than this above the step its plan was made for is stale
REFIT_SLACK = 1.10
# and a plan whose hot experts' rows fell below 1 / MOVED of their share is not fitted
MOVED = 2


def refit_plan(
    plan: Plan,
    before_WN: object,
    after_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    overlap: bool = True,
    block_size: int = 64,
    *,
    before_sums: CountSums | None = None,
    after_sums: CountSums | None = None,
    moved_below: int = 0,
) -> Plan | None:
    """``plan``, made for the counts ``before_WN``, fitted to ``after_WN`` (module doc) and
    priced on them with ``overlap`` (the mixed strategy's: True) under ``profile``. Compiled
    (``native_planner.refitted``) for the compiled planner's plans, given the counts' sums
    where they are known (``CountSums``: no pass over C), else ``refit_python``: the same
    plan. ``moved_below`` > 0: None, nothing fitted, when the hot experts moved (``moved``)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    got = refitted(plan, before_WN, after_WN, shape, profile, overlap, block_size,
                   before_sums, after_sums, moved_below)  # fmt: skip
    if got is HOT_MOVED:
        return None
    if got is not None:
        return got
    return refit_python(plan, before_WN, after_WN, shape, profile, overlap, block_size,
                        moved_below)  # fmt: skip


def carried_plan(
    plan: Plan,
    before_WN: object,
    after_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    overlap: bool = True,
    block_size: int = 64,
    *,
    before_sums: CountSums | None = None,
    after_sums: CountSums | None = None,
) -> Plan | None:
    """``refit_plan``'s plan, or None when it is stale: predicted more than ``REFIT_SLACK``
    above the step ``plan`` was predicted at on the counts it was made for (the hot experts
    moved, as a rotating hotspot's do: plan the step afresh). Not fitted at all when the hot
    experts' rows fell below 1 / ``MOVED`` of their share (``moved``: the step pays its fresh
    plan, not a fit before it). Deterministic, like the fit."""
    fitted = refit_plan(plan, before_WN, after_WN, shape, profile, overlap, block_size,
                        before_sums=before_sums, after_sums=after_sums,
                        moved_below=MOVED)  # fmt: skip
    if fitted is None or fitted.prediction.step_s > REFIT_SLACK * plan.prediction.step_s:
        return None
    return fitted


def moved(plan: Plan, before_WN: torch.Tensor, after_WN: torch.Tensor, below: int) -> bool:
    """Whether ``plan``'s hot experts lost their rows: their share of the rows after below
    1 / ``below`` of their share before (exact integers: below * hot_after * total_before <
    hot_before * total_after). False for a plan without replicas."""
    if not plan.hot:
        return False
    hot = list(plan.hot)
    hot1, total1 = int(before_WN[:, hot].sum()), int(before_WN.sum())
    hot2, total2 = int(after_WN[:, hot].sum()), int(after_WN.sum())
    return below * hot2 * total1 < hot1 * total2


def refit_python(
    plan: Plan,
    before_WN: object,
    after_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    overlap: bool = True,
    block_size: int = 64,
    moved_below: int = 0,
) -> Plan | None:
    """``refit_plan`` in Python (the fallback, and the compiled fit's slow twin)."""
    before = counts_as_tensor(before_WN, shape)
    after = counts_as_tensor(after_WN, shape)
    if moved_below > 0 and moved(plan, before, after, moved_below):
        return None
    E = shape.experts_per_rank
    # a kept holder keeps its local rows L while L < its rows now, else computes them all
    kept_after = {}
    for g, pairs in plan.kept:
        still = {y: n for y, n in pairs if n < int(after[y, g])}
        if still:
            kept_after[g] = still
    items = []
    if plan.ranges:
        gs = [g for g, _ in plan.ranges]
        # the stream the ranges were cut from, and the fitted plan's
        old_T = _stream_totals(before, plan, gs, dict(plan.kept))
        new_T = _stream_totals(after, plan, gs, kept_after)
        for (g, pairs), t0, t1 in zip(plan.ranges, old_T, new_T, strict=True):
            # t0 > 0 for a valid plan (its ranges hold rows of that stream); n * t1 // t0: exact
            items.append((g, plan.holders(g), [(y, n * t1 // t0 if t0 > 0 else 0)
                                               for y, n in pairs]))  # fmt: skip
    cut = cut_ranges_many(after, items, E, block_size, kept_after)
    ranges = tuple((g, c) for (g, _, _), c in zip(items, cut, strict=True) if c)
    kept = tuple((g, tuple(local.items())) for g, local in kept_after.items())
    fitted = dataclasses.replace(plan, shares=(), ranges=ranges, kept=kept)
    priced = reprice(after, fitted, step_model(shape, profile, overlap), profile)
    if priced.prediction.step_s < priced.baseline.step_s:
        return priced
    # nothing replicated: no helper, and no kept holder either (it would hold no replica)
    none = dataclasses.replace(priced, hot=(), replicas=(), relay=False, ranges=(), kept=())
    return dataclasses.replace(none, prediction=priced.baseline)


def _stream_totals(C_WN, plan: Plan, gs: list[int], kept: dict) -> list[int]:
    """T_g of each expert in ``gs`` under ``plan``'s holders and the kept holders ``kept``
    ({g: ((y, local rows), ...)}): its column's rows but those its holders compute locally
    (a holder all its own rows, a kept holder its local ones; the rest stays in the stream)."""
    cols = C_WN[:, gs]
    totals = cols.sum(0).tolist()
    for i, g in enumerate(gs):
        local = dict(kept.get(g, ()))
        for y in plan.holders(g):
            totals[i] -= local[y] if y in local else int(cols[y, i])
    return totals
