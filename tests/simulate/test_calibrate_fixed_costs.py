"""The fixed-cost fit of ``mixmoe calibrate`` (``mixmoe.simulate.fixed_cost_fit``), on runs whose
"measured" steps are the cost model's own predictions under a known profile: the fit must give
that profile back. (The real runs are exercised by the calibrate CLI test.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import HardwareProfile, LayerShape
from mixmoe.simulate.fixed_cost_fit import HOT, _loads, _step, fit_fixed_costs

SHAPE = LayerShape(model_dim=64, hidden_dim=256, experts_per_rank=2, world_size=2,
                   bytes_per_element=4)  # fmt: skip
BASE = HardwareProfile("sweep", gemm_flops=2e10, link_bandwidth=1e9, link_latency=2e-4)


def _runs(truth: HardwareProfile) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    runs = []
    for T, routing, strategies in ((256, "uniform", ("a2a",)), (512, "uniform", ("a2a",)),
                                   (1024, "uniform", ("a2a",)), (1024, HOT, ("a2a", "mix"))):  # fmt: skip
        C = synthetic_counts(RoutingSpec.parse(routing), 2, T, 2, 4, gen).tolist()
        for s in strategies:
            run = {"tokens": T, "routing": routing, "strategy": s, "replicas": 0, "counts_WN": C}
            loads_4W, overlap = _loads(run, SHAPE, BASE)
            run["step_s"] = _step(loads_4W, SHAPE, truth, overlap)[0]
            runs.append(run)
    return runs


@pytest.mark.parametrize("extra_gemm", [1.0, 0.5])
def test_fit_recovers_the_profile_the_runs_came_from(extra_gemm: float) -> None:
    # extra_gemm 0.5: the layer runs at twice the sweep's rate: gemm_flops is raised, no overhead
    truth = dataclasses.replace(
        BASE,
        gemm_flops=BASE.gemm_flops / extra_gemm,
        step_fixed_s=4e-3,
        row_overhead_s=3e-6 if extra_gemm == 1.0 else 0.0,
        replica_fixed_s=5e-3,
    )
    fitted, record = fit_fixed_costs(BASE, _runs(truth), SHAPE)
    assert fitted.gemm_flops == pytest.approx(truth.gemm_flops, rel=1e-6)
    assert fitted.step_fixed_s == pytest.approx(4e-3, rel=1e-6)
    assert fitted.row_overhead_s == pytest.approx(truth.row_overhead_s, abs=1e-12)
    assert fitted.replica_fixed_s == pytest.approx(5e-3, rel=1e-6)
    assert [r["predicted_s"] for r in record["runs"]] == pytest.approx(
        [r["step_s"] for r in record["runs"]], rel=1e-6
    )
    assert any(max(r["replica_W"]) for r in record["runs"])  # the mix run did replicate
    assert "bisection" in record["method"]


def test_fit_never_goes_negative() -> None:
    # runs faster than the base model everywhere and mix cheaper than predicted: all 0.0 but the
    # rate the runs sustain
    runs = _runs(dataclasses.replace(BASE, gemm_flops=4e10))
    for r in runs:
        r["step_s"] *= 0.5 if r["strategy"] == "mix" else 1.0
    fitted, record = fit_fixed_costs(BASE, runs, SHAPE)
    assert fitted.step_fixed_s >= 0 and fitted.row_overhead_s == 0.0
    assert fitted.replica_fixed_s == 0.0 and "0: the model already predicts" in record["method"]


SHAPE4 = dataclasses.replace(SHAPE, world_size=4)


def _runs4(truth: HardwareProfile, processors: int | None) -> list[dict]:
    """W=4 runs whose "measured" steps are the model's under ``processors`` cores."""
    gen = torch.Generator().manual_seed(1)
    runs = []
    for T, routing, strategies in ((256, "uniform", ("a2a",)), (512, "uniform", ("a2a",)),
                                   (1024, "uniform", ("a2a",)), (1024, HOT, ("a2a", "mix"))):  # fmt: skip
        C = synthetic_counts(RoutingSpec.parse(routing), 4, T, 2, 8, gen).tolist()
        for s in strategies:
            run = {"tokens": T, "routing": routing, "strategy": s, "replicas": 0, "counts_WN": C}
            loads_4W, overlap = _loads(run, SHAPE4, BASE)
            run["step_s"] = _step(loads_4W, SHAPE4, truth, overlap, processors)[0]
            runs.append(run)
    return runs


def test_fit_under_processor_sharing_recovers_what_the_max_inflates() -> None:
    # 4 ranks on 2 cores: the runs follow processor sharing. Fitted under the same aggregation
    # the replica cost comes back; fitted under the max over ranks the sharing lands in it
    truth = dataclasses.replace(BASE, step_fixed_s=4e-3, replica_fixed_s=5e-3)
    runs = _runs4(truth, processors=2)
    fitted, record = fit_fixed_costs(BASE, runs, SHAPE4, processors=2)
    assert fitted.replica_fixed_s == pytest.approx(5e-3, rel=1e-6)
    assert fitted.step_fixed_s == pytest.approx(4e-3, rel=1e-3)
    assert record["processors"] == 2 and "processor sharing of 2 cores" in record["method"]
    assert [r["predicted_s"] for r in record["runs"]] == pytest.approx(
        [r["step_s"] for r in runs], rel=1e-3
    )
    # the record alone redoes the fit (base profile and runs with their counts)
    again, _ = fit_fixed_costs(HardwareProfile(**record["base_profile"]), record["runs"], SHAPE4, 2)
    assert again == fitted
    under_max, _ = fit_fixed_costs(BASE, runs, SHAPE4)
    assert under_max.replica_fixed_s != pytest.approx(5e-3, rel=0.05)
    # P >= W is the max over ranks exactly
    assert fit_fixed_costs(BASE, runs, SHAPE4, 4)[0] == under_max
    with pytest.raises(ValueError, match="processors must be an int >= 1"):
        fit_fixed_costs(BASE, runs, SHAPE4, 0)


@pytest.mark.parametrize("efficiency", [0.8, 0.62])
def test_fit_under_processor_sharing_recovers_the_shared_core_efficiency(efficiency: float) -> None:
    # runs made by processor sharing at a known efficiency: the fit gives it back, with the
    # fixed costs, and predicts every run (the skewed a2a run, where the hot rank computes
    # alone at the end, is what pins the efficiency; the uniform runs hardly move with it)
    truth = dataclasses.replace(
        BASE, step_fixed_s=4e-3, replica_fixed_s=5e-3, shared_core_efficiency=efficiency
    )
    runs = _runs4(truth, processors=2)
    fitted, record = fit_fixed_costs(BASE, runs, SHAPE4, processors=2)
    assert fitted.shared_core_efficiency == pytest.approx(efficiency, rel=1e-3)
    assert fitted.replica_fixed_s == pytest.approx(5e-3, rel=1e-3)
    assert fitted.step_fixed_s == pytest.approx(4e-3, rel=1e-3)
    assert record["shared_core_efficiency"] == fitted.shared_core_efficiency
    assert "skewed a2a step equals the measured one" in record["method"]
    assert [r["predicted_s"] for r in record["runs"]] == pytest.approx(
        [r["step_s"] for r in runs], rel=1e-3
    )
    # fair sharing (1.0) over-predicts the skewed a2a run that the fitted efficiency matches
    fair = dataclasses.replace(fitted, shared_core_efficiency=1.0)
    skewed = next(i for i, r in enumerate(runs) if r["routing"] == HOT and r["strategy"] == "a2a")
    loads_4W, overlap = _loads(runs[skewed], SHAPE4, BASE)
    assert _step(loads_4W, SHAPE4, fair, overlap, 2)[0] > runs[skewed]["step_s"] * 1.01


def test_fit_under_processor_sharing_takes_the_replica_cost_from_the_mix_step() -> None:
    # the skewed a2a run measured 15% below fair sharing (as on the 2-core VM at W=4): under
    # processor sharing that goes into the efficiency, the model then predicting that run, and
    # replica_fixed_s is fitted to the mix step alone; under the max over ranks the difference
    # fit moves it into replica_fixed_s (there on purpose: module doc)
    truth = dataclasses.replace(BASE, step_fixed_s=4e-3, replica_fixed_s=5e-3)
    runs = _runs4(truth, processors=2)
    skewed = [r for r in runs if r["routing"] == HOT]
    assert [r["strategy"] for r in skewed] == ["a2a", "mix"]
    fast = [dict(r, step_s=r["step_s"] * (0.85 if r is skewed[0] else 1.0)) for r in runs]
    fitted, record = fit_fixed_costs(BASE, fast, SHAPE4, processors=2)
    assert fitted.shared_core_efficiency < 0.95
    assert [r["predicted_s"] for r in record["runs"]] == pytest.approx(
        [r["step_s"] for r in fast], rel=1e-3
    )
    assert "mix step equals the measured mix step" in record["method"]
    exact = fit_fixed_costs(BASE, runs, SHAPE4, processors=2)[0]  # fair sharing: 1.0 exactly
    assert exact.shared_core_efficiency == 1.0
    assert exact.replica_fixed_s == pytest.approx(5e-3, rel=1e-6)
    # a skewed a2a run slower than fair sharing predicts: 1.0, the bound (never above)
    slow = [dict(r, step_s=r["step_s"] * (1.2 if r is skewed[0] else 1.0)) for r in runs]
    assert fit_fixed_costs(BASE, slow, SHAPE4, processors=2)[0] == exact
    as_max = fit_fixed_costs(BASE, runs, SHAPE4)[0].replica_fixed_s
    assert fit_fixed_costs(BASE, fast, SHAPE4)[0].replica_fixed_s > as_max
    assert fit_fixed_costs(BASE, runs, SHAPE4)[0].shared_core_efficiency == 1.0  # not fitted
    # P >= W: the max over ranks and its difference fit
    assert "mix - a2a equals" in fit_fixed_costs(BASE, fast, SHAPE4, processors=4)[1]["method"]


def test_validation_refits_stored_calibration_runs_under_processor_sharing() -> None:
    from mixmoe.simulate.agreement import STORED_RUN_PLANNERS, compare, summarize
    from mixmoe.simulate.layer import predict_layer

    truth = dataclasses.replace(BASE, step_fixed_s=4e-3, replica_fixed_s=5e-3)
    runs = _runs4(truth, processors=2)
    stored, record = fit_fixed_costs(BASE, runs, SHAPE4)  # as calibrate fitted it: the max
    case = {"world_size": 4, "model_dim": 64, "hidden_size": 256, "tokens": 1024,
            "experts_per_rank": 2, "routing": HOT}  # fmt: skip
    counts = runs[-1]["counts_WN"]
    calibration = {"base_profile": record["base_profile"], "processors": None, "runs": runs}
    recs = [
        {"case": case, "strategy": s, "step_ms": 30.0 + i, "replicas": 0, "counts_WN": counts,
         "profile": dataclasses.asdict(stored), "calibration": calibration}
        for i, s in enumerate(("a2a", "mix"))
    ]  # fmt: skip
    rows = compare(recs, processors=2)
    refit = fit_fixed_costs(BASE, runs, SHAPE4, 2)[0]
    # the plan the run used (planned with the stored profile by the stored runs' planner),
    # priced with the re-fitted costs
    want = predict_layer(counts, SHAPE4, refit, top_k=2, strategies=("a2a", "mix"),
                         processors=2, plan_profile=stored,
                         planners=STORED_RUN_PLANNERS)  # fmt: skip
    assert [r["refit_ps"] for r in rows] == [True, True]
    assert [r["predicted_ps_ms"] for r in rows] == pytest.approx(
        [want[s].step_s * 1e3 for s in ("a2a", "mix")], rel=1e-12
    )
    # the max-over-ranks columns keep the stored profile; without calibration runs so do the ps
    plain = predict_layer(counts, SHAPE4, stored, top_k=2, strategies=("a2a", "mix"),
                          planners=STORED_RUN_PLANNERS)  # fmt: skip
    assert [r["predicted_ms"] for r in rows] == pytest.approx(
        [plain[s].step_s * 1e3 for s in ("a2a", "mix")], rel=1e-12
    )
    old = compare([{k: v for k, v in r.items() if k != "calibration"} for r in recs], processors=2)
    assert [r["refit_ps"] for r in old] == [False, False]
    assert summarize(rows)["ps_refit_cases"] == 1 and summarize(old)["ps_refit_cases"] == 0


def test_validation_replays_marked_runs_with_the_layers_planner() -> None:
    """Records written since the balanced planner (``mix_planner: MIX_PLANNER``) are replayed with
    ``plan_mix``, unmarked ones with the stored runs' ``plan_replicas``; an unknown mark is refused.
    Counts where the two planners disagree (4 ranks, expert 3 hot, rank 0 sending more)."""
    from mixmoe.simulate.agreement import MIX_PLANNER, STORED_RUN_PLANNERS, compare, run_planners
    from mixmoe.simulate.layer import predict_layer

    C = torch.full((4, 8), 40, dtype=torch.int64)
    C[:, 3] = 1300
    C[0, 5] = 650
    case = {"world_size": 4, "model_dim": 64, "hidden_size": 256, "tokens": 1024,
            "experts_per_rank": 2, "routing": HOT}  # fmt: skip
    recs = [
        {"case": case, "strategy": s, "step_ms": 30.0 + i, "replicas": 0,
         "counts_WN": C.tolist(), "profile": dataclasses.asdict(BASE)}
        for i, s in enumerate(("a2a", "mix"))
    ]  # fmt: skip
    marked = [dict(r, mix_planner=MIX_PLANNER) for r in recs]
    own = predict_layer(C, SHAPE4, BASE, top_k=2, strategies=("a2a", "mix"))
    stored = predict_layer(C, SHAPE4, BASE, top_k=2, strategies=("a2a", "mix"),
                           planners=STORED_RUN_PLANNERS)  # fmt: skip
    assert own["mix"].step_s != stored["mix"].step_s  # the two planners disagree here
    assert [r["predicted_ms"] for r in compare(marked)] == pytest.approx(
        [own[s].step_s * 1e3 for s in ("a2a", "mix")], rel=1e-12
    )
    assert [r["predicted_ms"] for r in compare(recs)] == pytest.approx(
        [stored[s].step_s * 1e3 for s in ("a2a", "mix")], rel=1e-12
    )
    assert run_planners(recs[0]) is STORED_RUN_PLANNERS and run_planners(marked[0]) is None
    with pytest.raises(ValueError, match="mix_planner='other'"):
        run_planners(dict(recs[0], mix_planner="other"))
