"""``mixmoe simulate`` and ``mixmoe calibrate`` from the command line: output, files, errors."""

from __future__ import annotations

import json

import pytest

from mixmoe import cli
from mixmoe.formats.counts import write_counts
from mixmoe.placement.profile_io import load_profile, read_profile_record

SMALL = ["simulate", "--model-dim", "64", "--hidden-size", "128", "--tokens", "256"]


def _error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixmoe: error: "), err
    return err[0]


def test_simulate_prints_every_strategy_and_writes_files(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    jsonl, png, sweep = tmp_path / "s.jsonl", tmp_path / "r.png", tmp_path / "w.png"
    argv = [*SMALL, "--routing", "uniform,hot:0.5", "--profile", "a100-pcie", "--per-rank",
            "--vs-world", "2,8", "--png", str(png), "--sweep-png", str(sweep), "--jsonl",
            str(jsonl), "--layers", "4", "--pipeline-stages", "2", "--microbatches", "4",
            "--markdown"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ESTIMATE, not measured" in out
    for s in ("a2a", "shadow", "mix"):
        assert f"| hot:0.5 | {s} |" in out
    assert "predicted step ms vs W" in out and "bubble" in out
    assert png.stat().st_size > 1000 and sweep.stat().st_size > 1000
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(recs) == 2 * 3 + 2 * 3
    assert {r["kind"] for r in recs} == {"simulate"} and "environment" in recs[0]


def test_simulate_from_a_counts_file_and_a_profile_file(tmp_path, capsys) -> None:
    counts = write_counts(tmp_path / "c.json", [[[50, 10], [40, 5]]], source="test")
    prof = tmp_path / "p.json"
    prof.write_text(
        json.dumps(
            {"format": "mixmoe-hardware-profile", "version": 1, "name": "mine",
             "gemm_flops": 1e9, "link_bandwidth": 1e8, "link_latency": 1e-4,
             "measured": True, "source": "by hand"}
        )
    )  # fmt: skip
    argv = [*SMALL, "--world-size", "2", "--experts", "2", "--routing", f"counts:{counts}",
            "--profile", str(prof)]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "profile mine (by hand)" in out and f"counts:{counts}" in out


def test_simulate_bad_input_is_one_line(tmp_path, capsys) -> None:
    assert "routing 'zipf:x' is not understood" in _error(capsys, [*SMALL, "--routing", "zipf:x"])
    assert "routing 'skewed' is not understood" in _error(capsys, [*SMALL, "--routing", "skewed"])
    missing = tmp_path / "nope.json"
    assert "mixmoe calibrate" in _error(capsys, [*SMALL, "--profile", str(missing)])
    assert "neither a preset" in _error(capsys, [*SMALL, "--profile", "tpu-v9"])
    assert "not a positive multiple of --world-size 4" in _error(capsys, [*SMALL, "--experts", "6"])
    assert "--tokens must be >= 1" in _error(capsys, [*SMALL, "--tokens", "0"])
    assert "--remeasure" in _error(capsys, ["simulate", "--validate", str(missing)])


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--pipeline-stages", "4"], "--pipeline-stages is read only with --layers N"),
        (["--edp", "2"], "--edp is read only with --layers N"),
        (["--ep-size", "4"], "--ep-size is read only with --replay TRACE"),
        (["--trace-rank", "1"], "--trace-rank is read only with --replay TRACE"),
        (["--remeasure"], "--remeasure is read only with --validate FILE"),
        (["--device", "cuda"], "--device is read only with --remeasure"),
    ],
)
def test_simulate_options_without_their_mode_are_one_line(extra, expected, capsys) -> None:
    """Each was ignored without a word (``--pipeline-stages 4`` without ``--layers``: the layer
    table as if it had not been given)."""
    assert expected in _error(capsys, [*SMALL, *extra])


@pytest.mark.slow
def test_calibrate_tiny_sweep_writes_a_loadable_profile(tmp_path, capsys) -> None:
    out = tmp_path / "prof.json"
    argv = ["calibrate", "--model-dim", "32", "--hidden-size", "64", "--experts", "2",
            "--rows", "32,256", "--a2a-bytes", "1024,262144", "--repeats", "2", "--warmup", "1",
            "--world-size", "2", "--name", "tiny", "--out", str(out),
            "--layer-tokens", "64,128", "--processors", "1"]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "all_to_all_single on 2 ranks" in text and "profile tiny" in text
    prof = load_profile(out)
    assert prof.name == "tiny" and prof.gemm_flops > 0 and prof.link_bandwidth > 0
    rec = read_profile_record(out)
    assert rec["measured"] is True and "measured by `mixmoe calibrate`" in rec["source"]
    assert [p["rows_per_expert"] for p in rec["measurements"]["gemm"]] == [32, 256]
    assert len(rec["measurements"]["all_to_all"]) == 2
    # the fixed costs: fitted to layer runs (a2a uniform at each size, a2a and mix skewed)
    fit = rec["measurements"]["fixed_costs"]
    assert [(r["strategy"], r["tokens"]) for r in fit["runs"]] == [
        ("a2a", 64), ("a2a", 128), ("a2a", 128), ("mix", 128)
    ]  # fmt: skip
    assert all(r["step_s"] > 0 for r in fit["runs"]) and "least-squares" in fit["method"]
    # --processors 1: the fit aggregated as simulate --processors 1 predicts; kept re-fittable
    assert fit["processors"] == 1 and "processor sharing of 1 cores" in fit["method"]
    assert (
        all(len(r["counts_WN"]) == 2 for r in fit["runs"]) and "gemm_flops" in fit["base_profile"]
    )
    assert rec["config"]["processors"] == 1
    assert (prof.step_fixed_s, prof.row_overhead_s, prof.replica_fixed_s) == (
        fit["step_fixed_s"], fit["row_overhead_s"], fit["replica_fixed_s"]
    )  # fmt: skip
    assert min(prof.step_fixed_s, prof.row_overhead_s, prof.replica_fixed_s) >= 0
    # ranks outnumber cores: the efficiency of the shared core is fitted, kept and printed
    assert 0.5 <= prof.shared_core_efficiency <= 1.0
    assert prof.shared_core_efficiency == fit["shared_core_efficiency"]
    assert "shared_core_efficiency:" in fit["method"]
    assert f"shared_core_efficiency = {prof.shared_core_efficiency:.3f}" in text
    assert "predict with simulate --processors 1" in text
    assert "layer runs for the fixed costs" in text and "replica_fixed" in text


def test_calibrate_bad_input(capsys) -> None:
    assert "rows needs at least two" in _error(capsys, ["calibrate", "--rows", "64"])
    assert "world_size must be >= 1" in _error(capsys, ["calibrate", "--world-size", "0"])
    assert "layer_tokens needs at least two distinct" in _error(
        capsys, ["calibrate", "--layer-tokens", "64"]
    )
    assert "processors must be >= 1" in _error(capsys, ["calibrate", "--processors", "0"])
