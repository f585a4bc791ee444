"""One device (W = 1): ``mixmoe calibrate --world-size 1`` measures the GEMM sweep and the
``local`` layer runs and takes the link figures from a named preset (said so in the JSON and the
output); ``mixmoe simulate --world-size 1`` predicts the ``local`` step from it; the validation
compares that with ``bench layer --world-size 1``. Tiny shapes: the plumbing, not the accuracy."""

from __future__ import annotations

import math

import pytest

from mixmoe import cli
from mixmoe.bench.calibrate import CalibrateConfig, calibrate
from mixmoe.bench.simulator_runs import measure
from mixmoe.dispatch.strategies import planning_spec
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.profile import CPU_PROFILE, HardwareProfile
from mixmoe.placement.profile_io import load_profile, read_profile_record
from mixmoe.simulate.agreement import ValidationCase, cases_for, compare, read_records
from mixmoe.simulate.layer import predict_layer

TINY = ["--model-dim", "32", "--hidden-size", "64", "--experts", "2", "--rows", "32,128",
        "--repeats", "2", "--warmup", "1", "--layer-tokens", "64,192"]  # fmt: skip


def test_calibrate_one_rank_measures_gemm_and_fixed_costs_not_links(tmp_path, capsys) -> None:
    out = tmp_path / "one.json"
    argv = ["calibrate", *TINY, "--world-size", "1", "--name", "one", "--out", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "all_to_all: NOT MEASURED" in text and "preset 'cpu'" in text
    assert "not measured (preset 'cpu'): link_bandwidth, link_latency, replica_fixed_s" in text
    rec = read_profile_record(out)
    m = rec["measurements"]
    assert m["all_to_all"] == [] and m["links"]["preset"] == "cpu"
    assert m["not_measured"] == ["link_bandwidth", "link_latency", "replica_fixed_s"]
    assert "NOT measured" in rec["source"] and "NOT MEASURED" in m["a2a_fit"]["method"]
    # the layer runs are local ones at each size, the fixed costs fitted to them
    runs = m["fixed_costs"]["runs"]
    assert [(r["strategy"], r["tokens"]) for r in runs] == [("local", 64), ("local", 192)]
    assert all(r["step_s"] > 0 and r["rows_W"] == [2 * r["tokens"]] for r in runs)
    prof = load_profile(out)
    assert prof.gemm_flops > 0 and prof.step_fixed_s == m["fixed_costs"]["step_fixed_s"]
    assert (prof.link_bandwidth, prof.link_latency, prof.replica_fixed_s) == (
        CPU_PROFILE.link_bandwidth, CPU_PROFILE.link_latency, CPU_PROFILE.replica_fixed_s
    )  # fmt: skip


def test_calibrate_one_rank_links_preset_is_named_and_checked() -> None:
    cfg = CalibrateConfig(32, 64, 2, (32, 64), 1, layer_tokens=(), repeats=1, warmup=0,
                          links="h100-pcie")  # fmt: skip
    prof, m = calibrate(cfg)
    assert m["links"]["preset"] == "h100-pcie" and m["fixed_costs"]["replica_fixed_s"] == 0.0
    assert prof.link_bandwidth == load_profile("h100-pcie").link_bandwidth
    with pytest.raises(ValueError, match="is not a preset"):
        CalibrateConfig(world_size=1, links="tpu")
    with pytest.raises(ValueError, match="drop --links"):
        CalibrateConfig(world_size=2, links="cpu")


def test_local_is_priced_at_one_rank_only() -> None:
    shape = LayerShape(model_dim=32, hidden_dim=64, experts_per_rank=3, world_size=1,
                       bytes_per_element=4)  # fmt: skip
    prof = HardwareProfile("p", 1e9, 1e9, 1e-4, step_fixed_s=2e-3, row_overhead_s=1e-6)
    p = predict_layer([[40, 0, 23]], shape, prof, top_k=2, strategies=("local",))["local"]
    # every row on the one rank, no communication: rows x (FLOPs / rate + overhead) + fixed
    want = 63 * (shape.flops_per_row / 1e9 + 1e-6) + 2e-3
    assert p.step_s == pytest.approx(want, rel=1e-12) and p.exposed_W == (0.0,)
    assert p.rows_W == (63,) and p.replicas == 0
    with pytest.raises(ValueError, match="on one rank the strategy is 'local'"):
        planning_spec("a2a", 1)
    with pytest.raises(ValueError, match="'local' runs on one rank"):
        planning_spec("local", 2)


def test_simulate_one_rank_predicts_local(capsys) -> None:
    argv = ["simulate", "--world-size", "1", "--experts", "4", "--model-dim", "64",
            "--hidden-size", "128", "--tokens", "256", "--routing", "uniform", "--profile", "cpu"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("uniform"))
    assert row[1] == "local" and row[-1] == "-"  # no a2a to compare with
    shape = LayerShape(64, 128, 4, 1, 2)
    want = 512 * shape.flops_per_row / CPU_PROFILE.gemm_flops  # 256 tokens x top-2, no comm
    assert float(row[4]) == pytest.approx(want * 1e3, rel=1e-3)
    argv[argv.index("1")] = "2"
    assert cli.main([*argv, "--strategy", "local"]) == 2
    assert "'local' runs on one rank" in capsys.readouterr().err


def test_one_device_validation_plumbing(tmp_path, capsys) -> None:
    path = tmp_path / "one.jsonl"
    case = ValidationCase(1, 32, 64, 128, 2, "uniform")
    measure(path, [case], steps=2, warmup=1, calibrate_repeats=2, log=lambda _: None)
    (rec,) = read_records(path)
    assert rec["strategy"] == "local" and rec["case"]["device"] == "cpu"
    assert len(rec["counts_WN"]) == 1 and sum(rec["counts_WN"][0]) == 2 * 128
    assert rec["profile"]["link_bandwidth"] == CPU_PROFILE.link_bandwidth  # the preset's
    (row,) = compare([rec])
    assert row["strategy"] == "local" and row["measured_ms"] == rec["step_ms"] > 0
    assert row["predicted_ms"] > 0 and math.isfinite(row["error"])
    assert "ratio_measured" not in row and row["replicas_predicted"] == 0
    assert cli.main(["simulate", "--validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "W=1 D=32 F=64 T=128 E=2 uniform" in out and "local" in out


def test_validation_cases_per_world_and_device() -> None:
    one = cases_for((1,), "cuda")
    assert {(c.world_size, c.device, c.strategies, c.dtype) for c in one} == {
        (1, "cuda", ("local",), "bfloat16")
    }
    assert [c.world_size for c in cases_for((4, 2))] == [4] * 8 + [2] * 8  # the stored grid
    with pytest.raises(ValueError, match="with --device cpu"):
        cases_for((1, 2), "cuda")
