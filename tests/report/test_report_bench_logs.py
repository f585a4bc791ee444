"""Benchmark-log readers (docs/formats.md sections 1 and 2) and ``mixmoe report``.

The synthetic logs are built so that every expected figure is simple arithmetic (see comments).
"""

from __future__ import annotations

import json

import pytest

from mixmoe.cli import main
from mixmoe.formats.layer_log import read_layer_log
from mixmoe.formats.model_log import read_model_log
from mixmoe.report.run_stats import run_stats, speedups, steady_steps

HEADER = (
    "[Benchmark] world_size = 2, dtype = float32, model_dim = 256, hidden_size = 1024, "
    "samples = 4096, num_local_experts = {e}, topK = 2, a2a_ffn_overlap_degree = 1, device = `cpu`"
)


def step(i: int, total: float, fwd: float, bwd: float) -> str:
    return (
        f"STEP-{i}: step_time = {total:.6f} ms, foward_time = {fwd:.6f}, "
        f"backward_time = {bwd:.6f}, perf = 0.20 tflops."
    )


# fast_moe.log: E=4 (summary names it; its mean over STEP-2..4 = 22 / 9 / 13, so 2 warm-up
# steps) and E=8 (summary without a name -> system = file stem; mean over STEP-1..2 = 30/12/18)
FAST = "\n".join(
    [
        "start",
        HEADER.format(e=4),
        "cuda:3",
        "rank: 1, nranks: 2",
        step(0, 100, 60, 40),
        step(1, 50, 30, 20),
        step(2, 20, 8, 12),
        step(3, 22, 9, 13),
        "DistributedDataParallel(",
        "  (module): Linear(in_features=2, out_features=2, bias=True)",
        ")",
        step(4, 24, 10, 14),
        "",
        " fast_moe 4 [Summary] Average synchronized step_time = 22 ms, forward = 9 , backward = 13 .",
        HEADER.format(e=8),
        step(0, 99, 50, 49),
        step(1, 29, 11, 18),
        step(2, 31, 13, 18),
        "",
        "[Summary] Average synchronized step_time = 30 ms, forward = 12, backward = 18.",
    ]
)
# mixmoe-mix.log: E=8 without summary (10 steps -> drop ceil(10/10) = 1: STEP-1..9 = 10..18 ms,
# median = mean = 14) then E=4 with a summary (STEP-2..4 = 10, 12, 11 -> 11 / 5 / 6)
MIX = "\n".join(
    [HEADER.format(e=8), step(0, 100, 50, 50)]
    + [step(i, 9 + i, (9 + i) / 2, (9 + i) / 2) for i in range(1, 10)]
    + [
        HEADER.format(e=4),
        step(0, 90, 45, 45),
        step(1, 40, 20, 20),
        step(2, 10, 4, 6),
        step(3, 12, 5, 7),
        step(4, 11, 6, 5),
        "",
        " mixmoe-mix 4 [Summary] Average synchronized step_time = 11 ms, forward = 5 , backward = 6 .",
    ]
)


def _model_log() -> str:
    """naive bert 16: last 60 of 100 steps = 59 x 200 ms + 1 x 800 -> median 200, mean 210;
    mix_moe bert 16: last 60 = 100 ms -> speedup vs naive 2.0."""
    lines = []
    for variant, steady in (("naive", [200.0] * 59 + [800.0]), ("mix_moe", [100.0] * 60)):
        times = [999.0] * 40 + steady
        for i, t in enumerate(times):
            lines.append(
                f"STEP-{i}: step_time = {t:.6f} ms, foward_time = {0.4 * t:.6f}, "
                f"backward_time = {0.6 * t:.6f}"
            )
        mean = sum(steady) / 60
        lines += ["", f" {variant} bert 16 [Summary] Average synchronized step_time = {mean} ms,"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def logs(tmp_path):
    fast, mix, model = tmp_path / "fast_moe.log", tmp_path / "mixmoe-mix.log", tmp_path / "m.log"
    fast.write_text(FAST + "\n")
    mix.write_text(MIX + "\n")
    model.write_text(_model_log())
    return fast, mix, model


def test_layer_log_groups_runs_and_finds_steady_steps(logs) -> None:
    fast, mix, _ = logs
    runs = read_layer_log(fast)
    assert list(runs) == [("fast_moe", 4), ("fast_moe", 8)]
    (e4,) = runs[("fast_moe", 4)]
    assert e4.header["samples"] == 4096 and e4.header["device"] == "cpu"
    assert [r.step for r in e4.steps] == [0, 1, 2, 3, 4]  # noise lines skipped
    assert e4.summary.step_ms == 22 and e4.summary.backward_ms == 13
    steady, rule = steady_steps(e4)
    assert [r.step_ms for r in steady] == [20, 22, 24] and rule == "summary"
    (e8,) = runs[("fast_moe", 8)]
    assert e8.summary.forward_ms == 12
    assert [r.step_ms for r in steady_steps(e8)[0]] == [29, 31]
    mix_runs = read_layer_log(mix)
    assert list(mix_runs) == [("mixmoe-mix", 8), ("mixmoe-mix", 4)]
    (no_summary,) = mix_runs[("mixmoe-mix", 8)]
    assert no_summary.summary is None
    steady, rule = steady_steps(no_summary)
    assert [r.step for r in steady] == list(range(1, 10)) and rule == "first 10%"


def test_model_log_uses_the_last_60_of_100(logs) -> None:
    runs = read_model_log(logs[2])
    assert list(runs) == [("naive", "bert", 16), ("mix_moe", "bert", 16)]
    (naive,) = runs[("naive", "bert", 16)]
    assert len(naive.steps) == 100 and naive.summary.step_ms == 210.0
    steady, rule = steady_steps(naive)
    assert [r.step for r in steady] == list(range(40, 100)) and rule == "last 60%"
    stats = run_stats(runs)
    assert (stats[0].median_step_ms, stats[0].mean_step_ms) == (200.0, 210.0)
    assert stats[0].median_forward_ms == pytest.approx(80.0)
    assert speedups(stats, "naive") == [1.0, 2.0]


def test_tables_and_speedups(logs) -> None:
    fast, mix, _ = logs
    groups = {**read_layer_log(fast), **read_layer_log(mix)}
    stats = {(s.system, s.experts): s for s in run_stats(groups)}
    assert stats[("fast_moe", 4)].median_step_ms == 22.0
    assert stats[("mixmoe-mix", 4)].median_forward_ms == 5.0
    assert stats[("mixmoe-mix", 4)].mean_backward_ms == 6.0
    assert stats[("mixmoe-mix", 8)].median_step_ms == 14.0
    ordered = run_stats(groups)
    ratio = dict(
        zip([(s.system, s.experts) for s in ordered], speedups(ordered, "fast_moe"), strict=True)
    )
    assert ratio[("mixmoe-mix", 4)] == pytest.approx(22 / 11)
    assert ratio[("mixmoe-mix", 8)] == pytest.approx(30 / 14)
    with pytest.raises(ValueError, match="choose one of"):
        speedups(ordered, "deepspeed")


def test_truncated_step_line_names_the_line(tmp_path) -> None:
    path = tmp_path / "cut.log"
    path.write_text(HEADER.format(e=4) + "\n" + step(0, 10, 5, 5) + "\nSTEP-1: step_time = 9.5")
    with pytest.raises(ValueError) as err:
        read_layer_log(path)
    assert f"{path}:3:" in str(err.value)


def test_report_cli_text_markdown_and_plots(logs, tmp_path, capsys) -> None:
    fast, mix, model = logs
    plots = tmp_path / "plots"
    assert (
        main(["report", str(fast), str(mix), "--baseline", "fast_moe", "--plots", str(plots)]) == 0
    )
    text = capsys.readouterr().out
    row = next(
        line for line in text.splitlines() if line.startswith("mixmoe-mix") and " 4 " in line
    )
    assert row.split()[-1] == "2.00x" and "11.000" in row
    row8 = next(
        line for line in text.splitlines() if line.startswith("mixmoe-mix") and " 8 " in line
    )
    assert row8.split()[-1] == "2.14x"
    assert sorted(p.name for p in plots.iterdir()) == [
        "layer_forward_backward.png",
        "layer_step_vs_experts.png",
    ]
    assert (
        main(["report", str(model), "--markdown", "--baseline", "naive", "--plots", str(plots)])
        == 0
    )
    text = capsys.readouterr().out
    assert "| mix_moe | bert | 16 | 60 | 40 (last 60%) | 100.000 |" in text and "| 2.00x |" in text
    assert (plots / "model_step_time.png").stat().st_size > 5000
    assert main(["report", str(model), "--baseline", "nope"]) == 2
    assert "mixmoe: error: --baseline 'nope' is not in these logs" in capsys.readouterr().err


def test_report_on_logs_written_by_bench_layer(tmp_path, capsys) -> None:
    jsonl = tmp_path / "bench.jsonl"
    assert (
        main(
            [
                "bench",
                "layer",
                "--model-dim",
                "16",
                "--hidden-size",
                "32",
                "--tokens",
                "64",
                "--steps",
                "5",
                "--warmup",
                "2",
                "--jsonl",
                str(jsonl),
            ]
        )
        == 0
    )
    log = tmp_path / "bench.log"
    log.write_text(capsys.readouterr().out)
    (record,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    measured = sorted(record["step_ms"][record["warmup"] :])
    (stats,) = run_stats(read_layer_log(log))
    assert (stats.system, stats.experts, stats.steps) == ("mixmoe-local", 4, 5)
    assert stats.warmup == "2 (summary)"  # found from the summary, not assumed
    assert stats.median_step_ms == pytest.approx(measured[2], abs=1e-6)  # the log has 6 decimals
    assert main(["report", str(log)]) == 0
    assert "speedup vs mixmoe-local" in capsys.readouterr().out
