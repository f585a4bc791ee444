"""``bench layer``'s balanced bound: a2a under uniform routing timed in the same run beside the
strategies (``a2a-uniform``), and every strategy's ``pct_balanced`` = its median step over the
strategy's. 4 gloo ranks through the CLI (tiny shapes: the plumbing, not the timings), and
the arithmetic of ``summary_rows`` by hand."""

from __future__ import annotations

import json
import statistics

import pytest

from mixmoe import cli
from mixmoe.bench.layer import BALANCED, LayerBenchConfig, StrategyResult, summary_rows

pytestmark = pytest.mark.dist


def test_bench_layer_reports_the_balanced_bound(tmp_path, capsys) -> None:
    world = 4  # W=2 runs it too (on by default): tests/simulate/test_simulate_trace_routing.py
    out = tmp_path / "layer.jsonl"
    argv = ["bench", "layer", "--world-size", str(world), "--routing", "hot:0.8", "--threads", "1"]
    argv += ["--model-dim", "16", "--hidden-size", "32", "--tokens", "128", "--top-k", "2"]
    argv += ["--num-local-experts", "2", "--strategy", "a2a,mix", "--steps", "2", "--warmup", "1"]
    assert cli.main([*argv, "--jsonl", str(out)]) == 0
    text = capsys.readouterr().out
    assert "balanced bound: a2a-uniform = a2a under uniform routing" in text
    assert " mixmoe-a2a-uniform 2 [Summary]" in text  # its own log, like every strategy's
    records = {r["strategy"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["a2a", "a2a-uniform", "mix"]
    skewed, balanced = records["a2a"]["stats"], records[BALANCED]["stats"]
    # the balanced run routed uniformly: its busiest rank is far closer to the mean
    assert balanced["max_rows"] / balanced["mean_rows"] < skewed["max_rows"] / skewed["mean_rows"]
    header = next(line for line in text.splitlines() if line.startswith("strategy"))
    assert "pct_balanced" in header.split()
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["a2a"], ["mix"])]
    col = header.split().index("pct_balanced")
    bal_ms = statistics.median(records[BALANCED]["step_ms"][1:])
    for row in rows:
        step = statistics.median(records[row[0]]["step_ms"][1:])
        assert float(row[col]) == pytest.approx(bal_ms / step, abs=5e-4)  # printed with 3 digits


def test_balanced_off_and_one_rank(tmp_path, capsys) -> None:
    argv = ["bench", "layer", "--world-size", "1", "--balanced", "on", "--jsonl", ""]
    assert cli.main(argv) == 2
    assert "balanced bound (a2a under uniform routing) needs --world-size > 1" in (
        capsys.readouterr().err
    )


def test_summary_rows_pct_balanced_by_hand() -> None:
    cfg = LayerBenchConfig(world_size=2, strategies=("a2a", "mix"), warmup=1, steps=3)
    results = [
        StrategyResult("a2a", step_ms=[99.0, 40.0, 20.0, 30.0], fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4),
        StrategyResult("mix", step_ms=[99.0, 25.0, 15.0, 20.0], fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4),
        StrategyResult(BALANCED, step_ms=[1.0, 10.0, 12.0, 14.0], fwd_ms=[1.0] * 4,
                       bwd_ms=[1.0] * 4),
    ]  # fmt: skip
    rows = {r["strategy"]: r for r in summary_rows(cfg, results)}
    # medians after the warm-up step: a2a 30, mix 20, balanced 12
    assert rows["a2a"]["pct_balanced"] == 12 / 30
    assert rows["mix"]["pct_balanced"] == 12 / 20
    assert rows[BALANCED]["pct_balanced"] == 1.0
    assert rows["mix"]["vs_a2a"] == 20 / 30
    assert "pct_balanced" not in summary_rows(cfg, results[:2])[0]
