"""What-if prediction of one MoE layer step per strategy, on the planner's own cost model.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN [W, N] (C[s, g] = rows rank s
routes to expert g).

For each strategy (``a2a``, ``shadow``, ``mix``) the plan is the one the layer would run: the
strategy's planner and overlap flag from ``mixmoe.dispatch.strategies.STRATEGY_SPECS``; at W = 1
``local`` (every expert on the one device: nothing moves, ``planning_spec``) prices the one-device
step (expert compute and the fixed costs; no communication). Every
second comes from ``StepModel.seconds_W`` (``mixmoe.placement.cost_model``); nothing is
re-derived here. The per-rank breakdown is read off the same function with the terms switched on
one at a time:

- compute_W: expert GEMMs, forward + backward, plus the profile's per-row and per-step fixed
             costs (``row_overhead_s``, ``step_fixed_s``; 0.0 unless calibrated);
- token_W:   the token all-to-alls (4 per step) before any overlap (``overlap=False``, no replica);
- weight_W:  the replica fetch and gradient return (2 collectives; never overlapped), plus the
             profile's ``replica_fixed_s`` per replica served or held;
- exposed_W: the communication left after overlap (the cost model's comm) = token + weight - hidden;
- hidden_W:  token time hidden under source-local compute (``mix`` only).

step_s = max over ranks of compute + exposed (the cost model's step). Forward / backward are
apportioned, not modelled apart: forward = compute / 3 + exposed / 2 (a third of the FLOPs, half
of the collectives), backward = the rest; fwd_s and bwd_s are maxima over ranks, so
fwd_s + bwd_s >= step_s when different ranks are the bottleneck.

``shared=True`` models ranks that share processors (W gloo ranks on fewer free cores than
ranks, as on a busy CPU host) instead of owning one each: with every core saturated, the step
follows the total work, so step_s (fwd_s, bwd_s) is the MEAN over ranks of compute + exposed
(the calibrated per-rank rate being the all-ranks-busy share) instead of the max. The plan is
unchanged (the planners assume a processor per rank); on such a host balancing ranks buys
nothing and replication only adds work, which is what the measurements show (docs/results/
2026-11-23-simulator-validation.md).

``processors=P`` models W ranks sharing P processors by processor sharing, the way an
operating system runs them: while n ranks still have work, each runs at min(1, P / n) of a
processor, so a rank that finishes (and blocks in its next collective, which does not spin)
hands its share to the others. The calibrated per-rank rate is the all-ranks-busy share,
min(1, P / W) of a processor; each rank's compute + exposed seconds is turned into processor
seconds at that share and step_s (fwd_s, bwd_s) is the time the last rank finishes
(``processor_sharing_s``). It lies between ``shared``'s mean (every rank saturated until the
end) and the max over ranks (a processor per rank, P >= W: exactly the max). One parameter
beyond P, the profile's ``shared_core_efficiency`` e (default 1.0: fair sharing): while more
ranks than cores work, they get e x P cores' worth of work (e P / n each), so the
calibrated all-busy share is e P / W and a rank that runs alone afterwards runs 1 / e faster
than fair sharing of the all-busy rate suggests. ``mixmoe calibrate --processors P`` fits e to
its skewed ``a2a`` run (``mixmoe.simulate.fixed_cost_fit``). With P < W the token exchange hides nothing (``mix``'s overlap is not priced:
``overlap_under``): the aggregation counts a rank's communication seconds as processor work,
and overlapping work with work on a saturated processor frees none; exposed_W is then
token + weight and hidden_W 0. Measured (W=4, D=256 F=1024 T=512 E=2, uniform, gloo, 2 cores,
``time.process_time`` per rank around every span): ``a2a`` 55.4-60.3 ms of CPU per rank and
step, ``mix`` (no replica, token exchange overlapped) 55.4-60.1 ms, the same work. Measured on the 2-core development VM (W=4, hot:0.8, a2a; ``bench layer --trace``):
the hot rank's forward expert rows ran at 180 rows/ms while the other ranks waited, against
72-83 rows/ms per rank when all four computed (docs/results/2026-11-23-simulator-validation.md).

``fixed_s`` (optional) adds a measured per-step cost that does not depend on the placement
(gate, sort, combine, optimizer, framework overhead) to every strategy's step: it changes the
absolute prediction and the ratios, never the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixmoe.config import MoEConfig
from mixmoe.dispatch.strategies import planning_spec
from mixmoe.placement.cost_model import LayerShape, StepModel, counts_as_tensor, plan_pricing
from mixmoe.placement.profile import HardwareProfile
from mixmoe.validation import check_float

__all__ = [
    "STRATEGIES",
    "StrategyPrediction",
    "aggregate_ranks_s",
    "layer_config",
    "overlap_under",
    "predict_layer",
    "processor_sharing_s",
    "speedups",
]

STRATEGIES = ("a2a", "shadow", "mix")


@dataclass(frozen=True)
class StrategyPrediction:
    """One strategy's predicted layer step (seconds; tuples have one entry per rank)."""

    strategy: str
    compute_W: tuple[float, ...]
    token_W: tuple[float, ...]
    weight_W: tuple[float, ...]
    hidden_W: tuple[float, ...]
    exposed_W: tuple[float, ...]
    rows_W: tuple[int, ...]
    fwd_s: float
    bwd_s: float
    step_s: float
    hot: tuple[int, ...]
    replicas: int  # replica copies in all (sum of holders over hot experts)
    bottleneck: int  # the lowest rank at the max


def _tuple(x: torch.Tensor) -> tuple[float, ...]:
    return tuple(x.tolist())


def processor_sharing_s(work_W: torch.Tensor, processors: int, efficiency: float = 1.0) -> float:
    """When the last of W jobs finishes on ``processors`` processors shared among the unfinished
    jobs, each job taking at most one processor. ``work_W``: float64 [W], processor seconds of
    each job (all start at 0). With processors >= W: ``work_W.max()`` exactly.

    The jobs finish in order of their work; between two finishes the n unfinished jobs each
    advance at 1 while n <= processors, else at ``efficiency`` x processors / n (``efficiency``
    in (0, 1], 1.0: fair sharing): the k-th finish (ascending work w_(k), k from 0) comes
    after (w_(k) - w_(k-1)) / that rate more seconds."""
    W = work_W.numel()
    if processors >= W:
        return float(work_W.max())
    t, done = 0.0, 0.0
    for k, w in enumerate(sorted(work_W.tolist())):
        n = W - k
        t += (w - done) / (1.0 if n <= processors else efficiency * processors / n)
        done = w
    return t


def aggregate_ranks_s(
    seconds_W: torch.Tensor, processors: int | None = None, efficiency: float = 1.0
) -> float:
    """The step of W ranks that take ``seconds_W`` each (float64 [W], at the calibrated per-rank
    rate): the max over ranks (a processor per rank: ``processors`` None or >= W), else the
    processor-sharing finish time of W ranks on ``processors`` processors, the calibrated rate
    being the all-busy share ``efficiency`` x processors / W of a processor (module doc;
    ``efficiency``: the profile's ``shared_core_efficiency``). The one aggregation of the
    simulator and of the calibration's fit under ``--processors``."""
    W = seconds_W.numel()
    if processors is None or processors >= W:
        return float(seconds_W.max())
    share = efficiency * processors / W
    return processor_sharing_s(seconds_W * share, processors, efficiency)


def overlap_under(overlap: bool, processors: int | None, world_size: int) -> bool:
    """The token exchange's overlap as priced under an aggregation: the strategy's ``overlap``
    with a processor per rank (``processors`` None or >= ``world_size``), none when the ranks
    share fewer processors (module doc). The one rule of ``predict_layer`` and of the
    calibration's fit under ``--processors``."""
    return overlap and (processors is None or processors >= world_size)


def layer_config(shape: LayerShape, *, top_k: int, max_replicas: int) -> MoEConfig:
    """The layer configuration the planners see for ``shape`` (``StrategySpec.planner``'s
    ``config``): its sizes, ``top_k`` (at most N), SwiGLU when the shape has 3 GEMMs per expert,
    and ``max_replicas``."""
    return MoEConfig(
        model_dim=shape.model_dim,
        hidden_dim=shape.hidden_dim,
        num_experts=shape.num_experts,
        top_k=min(top_k, shape.num_experts),
        activation="swiglu" if shape.gemms_per_expert == 3 else "gelu",
        max_replicas=max_replicas,
    )


def predict_layer(
    counts_WN: object,
    shape: LayerShape,
    profile: HardwareProfile,
    *,
    top_k: int,
    max_replicas: int = 4,
    strategies: tuple[str, ...] = STRATEGIES,
    fixed_s: float = 0.0,
    shared: bool = False,
    processors: int | None = None,
    plan_profile: HardwareProfile | None = None,
    planners: dict | None = None,
) -> dict[str, StrategyPrediction]:
    """Predictions per strategy for one step's counts (int CPU tensor [W, N] or nested lists).

    ``top_k`` and ``max_replicas`` complete the layer configuration the planners see;
    ``shared`` / ``processors``: how ranks sharing processors aggregate (module doc).
    ``plan_profile``: the profile the planners plan with when it is not ``profile`` (a measured
    run planned with one profile, priced with another: ``simulate --validate`` re-fitting a
    record's fixed costs prices the plan the run used). ``planners``: {strategy: planner} in
    place of the strategy's own (``StrategySpec.planner``'s signature): a stored run planned by
    an earlier planner is replayed with it."""
    if not strategies:
        raise ValueError("no strategy given; use one or more of a2a, shadow, mix")
    if processors is not None:
        if isinstance(processors, bool) or not isinstance(processors, int) or processors < 1:
            raise ValueError(
                f"processors must be an int >= 1 (the cores the ranks share), got {processors!r}"
            )
        if shared:
            raise ValueError(
                "give shared (mean over ranks) or processors (processor sharing), not both"
            )
    check_float("fixed_s", fixed_s)  # a finite number >= 0
    C_WN = counts_as_tensor(counts_WN, shape)
    W = shape.world_size
    config = layer_config(shape, top_k=top_k, max_replicas=max_replicas)
    out = {}
    for name in strategies:
        spec = planning_spec(name, shape.world_size)
        planner = (planners or {}).get(name, spec.planner)
        plan = planner(C_WN, shape, plan_profile or profile, config)
        # the plan's aggregates (share entries, relay edges) and its replica rounds
        loads_4W, any_hot = plan_pricing(C_WN, plan, shape.experts_per_rank, profile)
        any_remote = bool(loads_4W[2].any())
        compute_W, exposed_W = StepModel(shape, profile, spec.overlap).seconds_W(
            loads_4W, any_remote, any_hot
        )
        plain = StepModel(shape, profile, False)
        token_W = plain.seconds_W(loads_4W, any_remote, False)[1]
        weight_W = plain.seconds_W(loads_4W, False, any_hot)[1]
        hidden_W = token_W + weight_W - exposed_W
        total_W = compute_W + exposed_W
        step = float(total_W.max())
        # the planner's own prediction must be this one: one cost model
        assert plan_profile not in (None, profile) or abs(
            step - plan.prediction.step_s
        ) <= 1e-12 * max(step, 1e-30), (
            step,
            plan.prediction.step_s,
        )
        if processors is not None and not overlap_under(spec.overlap, processors, W):
            exposed_W = token_W + weight_W  # nothing hidden on saturated shared processors
            hidden_W = torch.zeros_like(exposed_W)
            total_W = compute_W + exposed_W
        fwd_W, bwd_W = compute_W / 3 + exposed_W / 2, compute_W * 2 / 3 + exposed_W / 2
        if shared:
            step, fwd, bwd = (float(v.mean()) for v in (total_W, fwd_W, bwd_W))
        else:  # the max over ranks, or processor sharing when ranks outnumber processors
            eff = profile.shared_core_efficiency
            step, fwd, bwd = (
                aggregate_ranks_s(v, processors, eff) for v in (total_W, fwd_W, bwd_W)
            )
        out[name] = StrategyPrediction(
            strategy=name,
            compute_W=_tuple(compute_W),
            token_W=_tuple(token_W),
            weight_W=_tuple(weight_W),
            hidden_W=_tuple(hidden_W),
            exposed_W=_tuple(exposed_W),
            rows_W=tuple(int(r) for r in loads_4W[0].tolist()),
            fwd_s=fwd + fixed_s / 2,
            bwd_s=bwd + fixed_s / 2,
            step_s=step + fixed_s,
            hot=plan.hot,
            replicas=sum(len(h) for _, h in plan.replicas),
            bottleneck=int(total_W.argmax()),
        )
    return out


def speedups(preds: dict[str, StrategyPrediction], base: str = "a2a") -> dict[str, float]:
    """step(base) / step(strategy) for every strategy (> 1: faster than the base)."""
    if base not in preds:
        raise ValueError(f"speedups need the base strategy {base!r} among {sorted(preds)}")
    return {k: preds[base].step_s / p.step_s for k, p in preds.items()}
