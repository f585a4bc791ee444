"""The fixed-cost fit of ``mixmoe calibrate`` (``mixmoe.bench.calibrate_layer``), on runs whose
"measured" steps are the cost model's own predictions under a known profile: the fit must give
that profile back. (The real runs are exercised by the calibrate CLI test.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe.bench.calibrate_layer import HOT, _loads, _step, fit_fixed_costs
from mixmoe.bench.routing import RoutingSpec, synthetic_counts
from mixmoe.placement import HardwareProfile, LayerShape

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
