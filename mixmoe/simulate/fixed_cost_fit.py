"""The fixed costs of a ``HardwareProfile`` (``step_fixed_s``, ``row_overhead_s``,
``replica_fixed_s``), fitted to the short layer runs ``mixmoe.bench.calibrate_layer`` measures
(``mixmoe calibrate``).

Legend: W ranks, E experts per rank, T tokens per rank, C = counts_WN (rows rank s routes to g).

Fit. With the base profile (the sweeps' three figures, fixed costs 0.0) the cost model predicts
every run; b is the rank it finds slowest.

- ``step_fixed_s`` and the seconds per row computed: intercept and slope of a least-squares line
  of (measured step - the model's communication at b) against rows computed at b over the uniform
  ``a2a`` (or ``local``) runs (balanced ranks: the max over ranks is then also the mean, whatever the host).
  ``row_overhead_s`` = slope - flops_per_row / gemm_flops; when the slope is below the sweep's
  GEMM seconds per row (a sweep slowed by noise), ``gemm_flops`` = flops_per_row / slope instead
  and ``row_overhead_s`` = 0. A negative slope: 0, the sweep's rate and the mean residual; a
  negative intercept: 0 and the slope through the origin.
- ``replica_fixed_s``: the value at which the model's mix - a2a on the skewed pair (same counts)
  equals the measured mix - a2a (bisection: mix's prediction grows with it; 0 when the model
  already predicts at least that difference). The planner decides by comparing plans, so the
  difference is what it must get right. It prices everything a replica costs in measured time
  beyond its bytes on the link: packing, the replica slots' extra work item, the gradient return
  and its reduction, and, where ranks share cores, the balance replication does not buy.

Under ``processors=P`` (``mixmoe calibrate --processors P``: the W ranks share P cores) every
predicted step above (the communication at b, the bisection's mix) is aggregated by processor
sharing, the simulator's ``aggregate_ranks_s`` (what ``simulate --processors P`` predicts with),
instead of the max over ranks, and with P < W ``replica_fixed_s`` is the value at which the
model's mix step equals the measured mix step (bisection), not the difference to a2a: the
difference carries the model's error on the skewed a2a run into ``replica_fixed_s``, where it is
charged per replica (the owner of a hot expert serving W - 1 of them under ``shadow``). Measured
on the 2-core VM (W=4, D=256 F=1024 E=2, gloo, 4 calibrations): processor sharing over-predicts
the skewed a2a run by 12-17% (243.6-252.8 ms vs 212.4-223.2 ms), and the difference fit put
28-31 ms per replica where the mix step alone gives 8-15 ms; per-rank CPU time of the layer
(``time.process_time`` around each span, docs/results/2026-11-23-simulator-validation.md) puts a replica's own
cost at about 2-3 ms of CPU per replica served and 6-7 ms per replica held, 5-13 ms of a rank
at the all-busy share. Under the max over ranks (P None or P >= W) the difference is kept:
there it prices, on purpose, the balance replication does not buy where ranks share cores (the
planner decides by comparing plans). Use such a profile with ``--processors P``.

Also under P < W, before ``replica_fixed_s``: ``shared_core_efficiency`` e, the value at which
the model's step of the skewed ``a2a`` run equals the measured one (bisection over [0.5, 1]; 1.0
when fair sharing already predicts it at or below the measurement). That run's hot rank
computes alone once the others wait in a collective, and fair sharing of the all-busy rate
over-predicted it (the 12-17% above, and 8 W=4 calibrations of the stored validation file:
fair sharing 3-13% above in 5 of them, e = 0.74-0.85; at or below in 3, e = 1.0): ranks that
outnumber the cores get less than P cores' work (switching, caches), so the all-busy rate
undersells a rank running alone. The uniform runs of the line fit barely depend on e; the
line and e are fitted in turn until e moves less than ``EFFICIENCY_TOL``.

``measurements["fixed_costs"]`` keeps every run (with its counts), the base profile, the
aggregation, the method and the fit: ``fit_fixed_costs`` can be redone from it alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mixmoe.placement.cost_model import LayerShape, StepModel, counts_as_tensor, plan_pricing
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.replica_search import plan_replicas

__all__ = ["HOT", "REPLICATE", "TOP_K", "fit_fixed_costs"]

HOT = "hot:0.6"  # the skewed routing of the fit (the validation grid uses 0.4 and 0.8)
EFFICIENCY_MIN = 0.5  # the fit's floor for shared_core_efficiency (half of fair sharing)
# line fit <-> efficiency alternations: the pair converges geometrically (on the VM's W=4 runs
# the efficiency moved 1e-2, 1e-3, 1e-4, ... per round); stop once it moves less than the tolerance
EFFICIENCY_ROUNDS = 30
EFFICIENCY_TOL = 1e-9
TOP_K = 2
# a profile under which compute is all that matters: mix replicates every hot expert it can
REPLICATE = HardwareProfile("calibrate-replicate", 1e6, 1e15, 1e-9)


def _loads(run: dict[str, Any], shape: LayerShape, base: HardwareProfile):
    """(loads_4W, overlap) of a run: its plan recomputed from its counts (deterministic), with
    the layer configuration ``bench layer`` ran (``LayerBenchConfig.moe_config``)."""
    from mixmoe.config import MoEConfig
    from mixmoe.dispatch.strategies import planning_spec

    C_WN = counts_as_tensor(run["counts_WN"], shape)
    spec = planning_spec(run["strategy"], shape.world_size)
    config = MoEConfig(
        model_dim=shape.model_dim,
        hidden_dim=shape.hidden_dim,
        num_experts=shape.num_experts,
        top_k=TOP_K,
        strategy=run["strategy"],
    )
    # mix: the source-replica search the stored calibration runs were planned by (before the
    # balanced plan_mix of issue 26), forced to replicate by the REPLICATE profile
    if run["strategy"] == "mix":
        plan = plan_replicas(C_WN, shape, REPLICATE, config.max_replicas)
    else:
        plan = spec.planner(C_WN, shape, base, config)
    return plan_pricing(C_WN, plan, shape.experts_per_rank)[0], spec.overlap


def _step(
    loads_4W: torch.Tensor,
    shape: LayerShape,
    profile: HardwareProfile,
    overlap: bool,
    processors: int | None = None,
):
    """The cost model's step and its slowest rank: the max over ranks, or, given the cores the
    ranks share, the simulator's processor-sharing aggregation (``aggregate_ranks_s``, the
    overlap as it prices it: ``overlap_under``)."""
    from mixmoe.simulate.layer import aggregate_ranks_s, overlap_under

    any_remote, any_hot = bool(loads_4W[2].any()), bool(loads_4W[3].any())
    overlap = overlap_under(overlap, processors, shape.world_size)
    compute, comm = StepModel(shape, profile, overlap).seconds_W(loads_4W, any_remote, any_hot)
    total = compute + comm
    eff = profile.shared_core_efficiency
    return aggregate_ranks_s(total, processors, eff), int(total.argmax())


def fit_fixed_costs(
    base: HardwareProfile,
    runs: list[dict[str, Any]],
    shape: LayerShape,
    processors: int | None = None,
) -> tuple[HardwareProfile, dict[str, Any]]:
    """``base`` with the fixed costs fitted to ``runs`` (``layer_runs``; see the module doc), and
    the fit's record (per run: measured, predicted before and after, rows and replicas per
    rank, its counts). ``shape``: the runs' layer (its bytes_per_element as run).
    ``processors``: the cores the ranks shared; every predicted step of the fit is then
    aggregated by processor sharing (``mixmoe.simulate.layer.aggregate_ranks_s``, what
    ``simulate --processors`` predicts with) instead of the max over ranks."""
    if processors is not None and (
        isinstance(processors, bool) or not isinstance(processors, int) or processors < 1
    ):
        raise ValueError(
            f"processors must be an int >= 1 (the cores the ranks share), got {processors!r}"
        )
    P = processors
    loads = [_loads(r, shape, base) for r in runs]
    absolute = P is not None and P < shape.world_size  # processor sharing: the mix step alone
    fitted, how = _fit_line_costs(base, runs, loads, shape, P)
    eff_how = "1.0: not fitted (a core per rank)"
    if absolute:  # the line (uniform runs) hardly moves with the efficiency: a few rounds
        for _ in range(EFFICIENCY_ROUNDS):
            efficiency, eff_how = _solve_efficiency(fitted, runs, loads, shape, P)
            if abs(efficiency - fitted.shared_core_efficiency) <= EFFICIENCY_TOL:
                break
            with_eff = dataclasses.replace(base, shared_core_efficiency=efficiency)
            fitted, how = _fit_line_costs(with_eff, runs, loads, shape, P)
    replica, rep_how = _solve_replica(fitted, runs, loads, shape, P, absolute)
    fitted = dataclasses.replace(fitted, replica_fixed_s=replica)
    aggregation = (
        "the max over ranks"
        if P is None or P >= shape.world_size
        else f"processor sharing of {P} cores (simulate --processors {P})"
    )
    record = {
        "method": (
            f"every predicted step aggregated by {aggregation}; "
            "step_fixed_s, per-row seconds: least-squares line of (measured step - the base "
            f"model's communication) against rows at the slowest rank over a2a (local) uniform runs "
            f"({how}); shared_core_efficiency: {eff_how}; replica_fixed_s: {rep_how}"
        ),
        "gemm_flops_sweep": base.gemm_flops,
        "gemm_flops": fitted.gemm_flops,
        "step_fixed_s": fitted.step_fixed_s,
        "row_overhead_s": fitted.row_overhead_s,
        "replica_fixed_s": replica,
        "shared_core_efficiency": fitted.shared_core_efficiency,
        "processors": P,
        "base_profile": dataclasses.asdict(base),  # what an offline re-fit starts from
        "runs": [
            {
                **r,  # counts_WN included: the fit can be redone from the record alone
                "predicted_base_s": _step(ld, shape, base, ov, P)[0],
                "predicted_s": _step(ld, shape, fitted, ov, P)[0],
                "rows_W": [int(v) for v in ld[0].tolist()],
                "replica_W": [int(v) for v in ld[3].tolist()],
            }
            for r, (ld, ov) in zip(runs, loads, strict=True)
        ],
    }
    return fitted, record


def _fit_line_costs(
    base: HardwareProfile,
    runs: list[dict[str, Any]],
    loads: list,
    shape: LayerShape,
    processors: int | None,
) -> tuple[HardwareProfile, str]:
    """``base`` with step_fixed_s and the per-row figure (row_overhead_s, or gemm_flops) of the
    least-squares line over the uniform a2a (local) runs (module doc), and how it was fitted."""
    t_gemm = shape.flops_per_row / base.gemm_flops  # seconds per row of the sweep's GEMM rate
    xs, ys = [], []
    for i, r in enumerate(runs):
        if r["strategy"] in ("a2a", "local") and r["routing"] == "uniform":
            pred, b = _step(loads[i][0], shape, base, loads[i][1], processors)
            rows_b = float(loads[i][0][0, b])
            xs.append(rows_b)
            ys.append(r["step_s"] - (pred - rows_b * t_gemm))  # measured minus communication
    fixed, t_row, how = _line(xs, ys)
    if t_row <= 0:  # no per-row figure from the runs: keep the sweep's rate
        return dataclasses.replace(base, step_fixed_s=fixed), how + "; gemm_flops from the sweep"
    if t_row >= t_gemm:
        fitted = dataclasses.replace(base, step_fixed_s=fixed, row_overhead_s=t_row - t_gemm)
        return fitted, how + "; row_overhead_s = per-row slope - the sweep's GEMM seconds per row"
    # the layer sustains more than the sweep measured (a noisy sweep): trust the layer
    gemm = shape.flops_per_row / t_row
    fitted = dataclasses.replace(base, gemm_flops=gemm, step_fixed_s=fixed)
    return (
        fitted,
        how + "; the per-row slope beat the sweep's rate: gemm_flops = flops_per_row / slope",
    )


def _line(xs: list[float], ys: list[float]) -> tuple[float, float, str]:
    """(intercept >= 0, slope >= 0, how) of a least-squares line of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    if slope <= 0:
        return max(0.0, my), 0.0, "slope <= 0: row_overhead_s = 0, step_fixed_s = mean residual"
    icpt = my - slope * mx
    if icpt < 0:
        sxy0 = sum(x * y for x, y in zip(xs, ys, strict=True))
        slope0 = max(0.0, sxy0 / sum(x * x for x in xs))
        return 0.0, slope0, "intercept < 0: step_fixed_s = 0, slope through the origin"
    return icpt, slope, "intercept and slope"


def _solve_efficiency(
    profile: HardwareProfile,
    runs: list[dict[str, Any]],
    loads: list,
    shape: LayerShape,
    processors: int,
) -> tuple[float, str]:
    """The shared_core_efficiency in [EFFICIENCY_MIN, 1] at which the model's step of the skewed
    ``a2a`` run (no replica: its hot rank computes alone after the others finish) equals the
    measured one, by bisection (the step grows with the efficiency); 1.0 when the model at 1.0
    (fair sharing) already predicts the run at or below the measured step, or when there is
    no skewed ``a2a`` run. The uniform runs of the line fit do not depend on it (every rank
    busy until the end)."""
    skewed = [i for i, r in enumerate(runs) if r["routing"] == HOT and r["strategy"] == "a2a"]
    if not skewed:
        return 1.0, "1.0: no skewed a2a run"
    i = skewed[0]
    target = runs[i]["step_s"]

    def step(eff: float) -> float:
        fitted = dataclasses.replace(profile, shared_core_efficiency=eff)
        return _step(loads[i][0], shape, fitted, loads[i][1], processors)[0]

    if step(1.0) <= target:
        return (
            1.0,
            "1.0: fair sharing already predicts the skewed a2a step at or below the measured",
        )
    if step(EFFICIENCY_MIN) >= target:
        return EFFICIENCY_MIN, f"{EFFICIENCY_MIN} (the bound): the skewed a2a step stays above"
    lo, hi = EFFICIENCY_MIN, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
    return lo, "bisection: the model's skewed a2a step equals the measured one"


def _solve_replica(
    profile: HardwareProfile,
    runs: list[dict[str, Any]],
    loads: list,
    shape: LayerShape,
    processors: int | None = None,
    absolute: bool = False,
) -> tuple[float, str]:
    """The replica_fixed_s >= 0 at which the model's mix - a2a difference on the skewed pair of
    runs (same counts) equals the measured one: the planner's decision is a comparison, so the
    difference is what must be right. ``absolute`` (processor sharing, module doc): at which the
    model's mix step equals the measured mix step instead. 0 when nothing was replicated, or
    when the model already predicts mix at or above the target."""
    by = {r["strategy"]: i for i, r in enumerate(runs) if r["routing"] == HOT}
    if set(by) != {"a2a", "mix"} or not bool(loads[by["mix"]][0][3].any()):
        return 0.0, "0: no replicated run"
    if absolute:
        target = runs[by["mix"]]["step_s"]
        how = "bisection: the model's mix step equals the measured mix step on the skewed run"
        above = "0: the model already predicts the mix step at or above the measured one"
    else:
        a2a_s = _step(loads[by["a2a"]][0], shape, profile, loads[by["a2a"]][1], processors)[0]
        target = a2a_s + runs[by["mix"]]["step_s"] - runs[by["a2a"]]["step_s"]
        how = "bisection: the model's mix - a2a equals the measured mix - a2a on the skewed runs"
        above = "0: the model already predicts mix - a2a at or above the measured difference"
    mix_4W, overlap = loads[by["mix"]]

    def step(kappa: float) -> float:  # non-decreasing in kappa (max or processor sharing)
        fitted = dataclasses.replace(profile, replica_fixed_s=kappa)
        return _step(mix_4W, shape, fitted, overlap, processors)[0]

    if step(0.0) >= target:
        return 0.0, above
    lo, hi = 0.0, max(target, 1e-9)  # one replica alone at this cost exceeds the target
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
    return hi, how
