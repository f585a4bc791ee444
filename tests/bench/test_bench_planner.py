"""``mixmoe bench planner`` end to end on tiny cases (not a timing test: times are only printed),
and the synthetic counts it plans on."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from mixmoe import cli
from mixmoe.bench import planner as planner_bench
from mixmoe.bench.planner import PlannerBenchConfig, target_ms
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement.native_cache_lines import CacheEvictor


def test_bench_planner_table_and_jsonl(tmp_path, capsys) -> None:
    out = tmp_path / "planner.jsonl"
    argv = ["bench", "planner", "--cases", "4x16,8x32", "--routing", "uniform,zipf:1.2"]
    argv += ["--tokens", "256", "--repeats", "2", "--old-repeats", "1", "--jsonl", str(out)]
    assert cli.main([*argv, "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| routing | W | N | planner ms |")
    assert len(table.strip().splitlines()) == 2 + 4
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["routing"], r["world_size"], r["num_experts"]) for r in records] == [
        ("uniform", 4, 16),
        ("uniform", 8, 32),
        ("zipf:1.2", 4, 16),
        ("zipf:1.2", 8, 32),
    ]
    for r in records:
        assert r["kind"] == "bench_planner" and r["environment"]["torch"] == torch.__version__
        assert r["planner_ms"] > 0 and r["old_planner_ms"] > 0 and r["bookkeeping_ms"] > 0
        assert r["sums_ms"] > 0 and r["planner_given_ms"] > 0
        assert r["host_ms"] == r["sums_ms"] + r["planner_given_ms"] + r["bookkeeping_ms"]
        assert r["host_device_sums_ms"] == r["planner_given_ms"] + r["bookkeeping_ms"]
        assert r["overlap_ms"] > 0  # 256 tokens, top-2: every rank routes rows to its own
        assert r["exposed_ms"] == max(0.0, r["host_device_sums_ms"] - r["overlap_ms"])
        assert r["fit_ms"] > 0 and 0 < r["fit_over_fresh_step"] < 2
        assert r["ahead_exposed_ms"] > r["fit_ms"]
        assert r["ahead_thread_ms"] > 0 and r["ahead_thread_busy_ms"] > 0
        want_layers = max(1, math.ceil(r["ahead_thread_busy_ms"] / r["step_ms"]))
        assert r["ahead_layers"] == want_layers
        assert r["meets_target_given"] == (r["planner_given_ms"] <= r["target_ms"])
        assert 0 < r["mix_over_a2a"] <= 1.5 and r["old_mix_over_a2a"] is not None
        assert r["target_ms"] == target_ms(r["world_size"], r["step_ms"])


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--cases", "8x60"], "N=60 must be a multiple of W=8"),
        (["--cases", "8by64"], "case '8by64' is not understood"),
        (["--routing", "gate"], "routing 'gate' needs a learned gate"),
        (["--routing", "zipf:-1"], "routing 'zipf:-1' is not understood"),
        (["--search-width", "0"], "search_width must be >= 1"),
        (["--repeats", "0"], "repeats must be >= 1"),
        (["--top-k", "80", "--cases", "8x64"], "top_k=80 exceeds N=64"),
    ],
)
def test_bench_planner_bad_input(argv, expected, capsys) -> None:
    assert cli.main(["bench", "planner", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2", "hot:0.3"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_synthetic_counts(routing: str, shuffle: bool) -> None:
    W, T, K, N = 6, 500, 2, 24
    spec = RoutingSpec.parse(routing)
    counts_WN = synthetic_counts(
        spec, W, T, K, N, torch.Generator().manual_seed(3), shuffle_experts=shuffle
    )
    assert counts_WN.dtype == torch.int64 and counts_WN.shape == (W, N)
    assert counts_WN.sum(1).tolist() == [T * K] * W
    assert int(counts_WN.max()) <= T  # K distinct experts per token: at most one row each
    again = synthetic_counts(
        spec, W, T, K, N, torch.Generator().manual_seed(3), shuffle_experts=shuffle
    )
    assert torch.equal(counts_WN, again)
    total_N = counts_WN.sum(0)
    if spec.kind == "hot":
        hot = int(total_N.argmax())
        assert counts_WN[:, hot].tolist() == [round(0.3 * T * K)] * W
        assert hot == 0 or shuffle  # unshuffled: expert 0 is the hot one
    if spec.kind == "zipf" and not shuffle:
        assert total_N[0] > total_N[5] > total_N[20]  # popularity follows the expert id


def test_config_defaults_are_the_issue_table() -> None:
    cfg = PlannerBenchConfig()
    assert cfg.cases[0] == (8, 64) and cfg.cases[-1] == (1024, 4096)
    assert (cfg.tokens, cfg.top_k, cfg.model_dim, cfg.hidden_size) == (8192, 2, 1024, 4096)
    assert (cfg.dtype, cfg.profile, cfg.max_replicas) == ("fp16", "gpu", 4)


def test_timed_calls_follow_an_eviction_each(monkeypatch) -> None:
    events = []
    evictor = CacheEvictor([torch.ones(4, dtype=torch.int64)])
    monkeypatch.setattr(evictor, "evict", lambda: events.append("evict"))
    planner_bench._time_ms(lambda: events.append("call"), 3, evictor)
    assert events == ["call"] + ["evict", "call"] * 3  # the untimed first call, then each pair
    events.clear()
    planner_bench._time_ms(lambda: events.append("call"), 2)  # warm: no eviction
    assert events == ["call"] * 3


@pytest.mark.parametrize("warm", [False, True])
def test_bench_planner_records_the_cache_state(tmp_path, warm: bool, capsys) -> None:
    out = tmp_path / "planner.jsonl"
    argv = ["bench", "planner", "--cases", "4x16", "--routing", "zipf:1.2", "--tokens", "64"]
    argv += ["--repeats", "1", "--old-max-world", "0", "--jsonl", str(out)]
    assert cli.main(argv + (["--warm"] if warm else [])) == 0
    err = capsys.readouterr().err
    assert ("warm caches" if warm else "counts flushed from the caches before each call") in err
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["cold_caches"] == (None if warm else "lines")
    assert record["config"]["cold"] is (not warm)


def test_the_busy_thread_timing_runs_the_job_on_a_worker_while_the_caller_issues_ops(
    monkeypatch,
) -> None:
    """Each timed call: an eviction, then the job on another thread, from its submission to its
    end, while this thread runs torch ops until the job is done (the job waits for one here)."""
    events, ops = [], []
    evictor = CacheEvictor([torch.ones(4, dtype=torch.int64)])
    monkeypatch.setattr(evictor, "evict", lambda: events.append("evict"))
    caller = threading.current_thread()
    real_add = torch.Tensor.add_
    monkeypatch.setattr(torch.Tensor, "add_", lambda t, *a: ops.append(1) or real_add(t, *a))

    def job() -> None:
        assert threading.current_thread() is not caller
        seen = len(ops)
        while len(ops) < seen + 3:  # the caller keeps issuing ops while the job runs
            pass
        events.append("job")

    ms = planner_bench._busy_thread_ms(job, 2, evictor)
    assert events == ["job"] + ["evict", "job"] * 2  # the untimed first call, then each pair
    assert ms > 0 and len(ops) >= 6
