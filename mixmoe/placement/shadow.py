"""``shadow``: FasterMoE's dynamic shadowing rule (``plan_shadow``), one of ``plan_mix``'s candidates.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes to
expert g; expert g is owned by rank g // E).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mixmoe.placement import native_candidates
from mixmoe.placement.cost_model import LayerShape, prediction_of, reprice, step_model
from mixmoe.placement.counts import CountSums, baseline_loads, counts_with_sums
from mixmoe.placement.native_pricing import counted_baseline
from mixmoe.placement.plan import Plan
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.relay import node_distance

__all__ = ["plan_shadow", "shadow_hot"]


def plan_shadow(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    *,
    overlap: bool = False,
    counted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sums: CountSums | None = None,
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
    ``overlap`` default False) is reported for comparison. ``counted``:
    ``counts_with_sums(counts_WN, shape)`` when the caller has it (checked and summed once);
    ``sums``: C's ``CountSums`` (the compiled baseline then reads no more of C than each rank's
    own experts' columns).
    """
    model = step_model(shape, profile, overlap)
    W, E = shape.world_size, shape.experts_per_rank
    # one compiled pass over C where it runs (plan_none's; W = 1024: the Python's validation
    # and sums take ~3.6 ms), else the Python's
    both = counted_baseline(counts_WN, shape, sums) if counted is None else None
    if both is not None:
        (C_WN, *_), (loads_4W, load_N, own_N) = both
    else:
        C_WN, *sums = counted if counted is not None else counts_with_sums(counts_WN, shape)
        loads_4W, load_N, own_N = baseline_loads(C_WN, E, sums)
    model.check_exact(max(2 * int(load_N.sum()), W * shape.num_experts))
    baseline = prediction_of(model, loads_4W)
    if W == 1:
        return Plan((), (), baseline, baseline)
    hot = shadow_hot(C_WN, shape, profile, load_N, own_N)
    replicas = tuple((g, tuple(r for r in range(W) if r != g // E)) for g in hot)
    if node_distance(profile) is not None:  # topology: each plan priced per link (one rule)
        return reprice(C_WN, Plan(hot, replicas, baseline, baseline), model, profile)
    if not hot:
        return Plan((), (), baseline, baseline)
    return Plan(
        hot, replicas, prediction_of(model, _shadow_loads(C_WN, loads_4W, hot, E)), baseline
    )


def shadow_hot(
    C_WN: torch.Tensor,
    shape: LayerShape,
    profile: HardwareProfile,
    load_N: torch.Tensor,
    own_N: torch.Tensor,
) -> tuple[int, ...]:
    """The experts FasterMoE's rule shadows, ascending (the search of ``plan_shadow``'s doc),
    without pricing them: ``plan_mix`` prices the plan under its own overlap. ``load_N``,
    ``own_N``: ``baseline_loads``' column sums and owners' own rows of the validated int64
    ``C_WN``.

    Compiled where the library runs (``native_candidates``: the same experts); otherwise on
    Python ints (a W-list per tried expert, one column of C brought to the host each): the
    search usually stops within a few experts, and a handful of tensor ops per expert cost
    more than the list arithmetic up to W ~ 10**3. lat(S) is compared as
    ``max_r B_r * (t_row + t_feat) + |S| * t_model`` in the same float operations as before.
    """
    W, E = shape.world_size, shape.experts_per_rank
    if W == 1:
        return ()
    t_row_feat, t_model = shadow_terms(shape, profile)
    # compiled (the same experts) at every size: measured faster at W = 8 (0.04 -> 0.008 ms)
    # up to W = 1024 (0.2-0.3 -> 0.05-0.09 ms)
    hot = native_candidates.shadow_hot(C_WN, E, load_N, own_N, t_row_feat, t_model)
    if hot is not None:
        return hot
    if W > LIST_SHADOW_W:
        return _shadow_hot_tensor(C_WN, E, load_N, own_N, t_row_feat, t_model)
    return _shadow_hot_lists(C_WN, E, load_N, own_N, t_row_feat, t_model)


LIST_SHADOW_W = 64  # ranks up to which shadow_hot tries experts on Python lists


def _shadow_hot_lists(
    C_WN: torch.Tensor,
    E: int,
    load_N: torch.Tensor,
    own_N: torch.Tensor,
    t_row_feat: float,
    t_model: float,
) -> tuple[int, ...]:
    """``shadow_hot``'s search on Python lists (up to ``LIST_SHADOW_W`` ranks, when the
    compiled one cannot run), W >= 2."""
    W = C_WN.shape[0]
    load_W = load_N.view(W, E).sum(1).tolist()  # rows computed at each rank (int64 sums)
    best = max(load_W) * t_row_feat
    # load descending, ties by expert id ascending (a stable sort of the ascending ids); the
    # search mostly stops within the first few: their loads on the host, a few at a time
    shadowed: list[int] = []
    for g, load_g, own_g in _by_load(load_N, own_N):
        o = g // E
        # every source computes its own rows of g; the owner keeps only its own
        trial_W = list(map(int.__add__, load_W, C_WN[:, g].tolist()))
        trial_W[o] = load_W[o] - load_g + own_g
        lat = max(trial_W) * t_row_feat + (len(shadowed) + 1) * t_model
        if not lat < best:
            break
        best, load_W = lat, trial_W
        shadowed.append(g)
    return tuple(sorted(shadowed))


def shadow_terms(shape: LayerShape, profile: HardwareProfile) -> tuple[float, float]:
    """``shadow_hot``'s two costs (s): a row's compute and feature traffic, an expert's copy."""
    t_row_feat = (
        shape.flops_per_row / profile.gemm_flops + 4 * shape.row_bytes / profile.link_bandwidth
    )
    return t_row_feat, shape.params_bytes_per_expert / profile.link_bandwidth


def _shadow_hot_tensor(
    C_WN: torch.Tensor,
    E: int,
    load_N: torch.Tensor,
    own_N: torch.Tensor,
    t_row_feat: float,
    t_model: float,
) -> tuple[int, ...]:
    """``shadow_hot``'s search above ``LIST_SHADOW_W`` ranks: the same integers per tried
    expert in a few int64 tensor ops over W (the tried experts' columns gathered a batch at a
    time) instead of W-long Python lists; each max comes back as a Python int, so ``lat`` is
    the same float and the decisions are the same."""
    W = C_WN.shape[0]
    load_W = load_N.view(W, E).sum(1)  # rows computed at each rank
    best = int(load_W.max()) * t_row_feat
    shadowed: list[int] = []
    for g_B, loads_B, own_B in _batches(load_N, own_N):
        cols_BW = C_WN.t().index_select(0, g_B)  # the batch's columns, rows of C's transpose
        for i, (g, load_g, own_g) in enumerate(zip(g_B.tolist(), loads_B, own_B, strict=True)):
            o = g // E
            # every source computes its own rows of g; the owner keeps only its own
            trial_W = load_W + cols_BW[i]
            trial_W[o] = int(load_W[o]) - load_g + own_g
            lat = int(trial_W.max()) * t_row_feat + (len(shadowed) + 1) * t_model
            if not lat < best:
                return tuple(sorted(shadowed))
            best, load_W = lat, trial_W
            shadowed.append(g)
    return tuple(sorted(shadowed))


def _batches(
    load_N: torch.Tensor, own_N: torch.Tensor
) -> Iterator[tuple[torch.Tensor, list[int], list[int]]]:
    """``_by_load``'s order a batch at a time: (g_B, their loads, their owners' own rows)."""
    load_sorted_N, order_N = torch.sort(load_N, descending=True, stable=True)
    first, size = 0, 8
    while first < len(order_N):
        g_B = order_N[first : first + size]
        yield g_B, load_sorted_N[first : first + size].tolist(), own_N[g_B].tolist()
        first, size = first + size, 8 * size


def _by_load(load_N: torch.Tensor, own_N: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """(g, load_N[g], own_N[g]) by load descending, ties by expert id ascending (a stable sort
    of the ascending ids), brought to the host 8, 64, 512, ... at a time."""
    for g_B, loads_B, own_B in _batches(load_N, own_N):
        yield from zip(g_B.tolist(), loads_B, own_B, strict=True)


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
