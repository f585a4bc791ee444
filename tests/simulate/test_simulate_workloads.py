"""``mixmoe bench balance`` (``mixmoe.simulate.workloads``): its metrics against hand arithmetic on
tiny W=4 cases, the rotating hotspot followed step by step, the summary, and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mixmoe import cli
from mixmoe.gating.synthetic import redrawn_counts
from mixmoe.placement import plan_mix
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.profile_io import load_profile, profile_record, save_profile
from mixmoe.placement.refit import carried_plan
from mixmoe.simulate import workloads
from mixmoe.simulate.routing import counts_source
from mixmoe.simulate.workloads import (
    BalanceConfig,
    ShapeSpec,
    case_records,
    layer_shape,
    shape_spec,
    summarize,
)

D, F, T = 64, 128, 512
FLOPS, BW, LAT = 1e9, 1e8, 1e-5
TINY = ShapeSpec("tiny", D, F, top_k=1, dtype="fp32", experts_per_rank=1)
ROW_BYTES = D * 4
PARAM_BYTES = (2 * D * F + F + D) * 4  # two GEMMs' weights + biases, fp32
FLOPS_PER_ROW = 6 * 2 * D * F


@pytest.fixture
def cfg(tmp_path) -> BalanceConfig:
    path = tmp_path / "tiny.json"
    profile = HardwareProfile("tiny", FLOPS, BW, LAT)
    save_profile(path, profile_record(profile, source="test", measured=False))
    return BalanceConfig(  # the workloads the tests run (each checked against TINY's 4 experts)
        shapes=(TINY,), worlds=(4,), workloads=("hotrank:1.0", "rotate:1:1.0:3", "idle:0.5"),
        tokens=T, repeats=1, seed=3, profile=str(path),
    )  # fmt: skip


def _a2a_step_by_hand(C: list[list[int]]) -> float:
    """a2a with one expert per rank: rank r computes column r; it sends the rows it routes
    elsewhere and receives the rows others route to it, each crossing 4 times (2 sent, 2 back)."""
    W = len(C)
    steps = []
    for r in range(W):
        rows = sum(C[s][r] for s in range(W))
        remote = (sum(C[r]) - C[r][r]) + (rows - C[r][r])
        token = 4 * LAT + 2 * ROW_BYTES * remote / BW
        steps.append(rows * FLOPS_PER_ROW / FLOPS + token)
    return max(steps)


def test_hot_rank_metrics_by_hand(cfg) -> None:
    # hotrank:1.0 with one expert per rank and top-1: every row of every rank goes to one expert
    (C,) = counts_source("hotrank:1.0", 4, 4, T, 1, seed=cfg.seed)
    hot = int(C.sum(0).argmax())
    assert C[:, hot].tolist() == [T] * 4 and int(C.sum()) == 4 * T
    (U,) = counts_source("uniform", 4, 4, T, 1, seed=cfg.seed)
    balanced = _a2a_step_by_hand(U.tolist())
    a2a, shadow, mix = case_records(cfg, TINY, 4, "hotrank:1.0")
    # a2a: the hot rank computes all 4T rows and receives 3T of them
    step = 4 * T * FLOPS_PER_ROW / FLOPS + 4 * LAT + 2 * ROW_BYTES * 3 * T / BW
    assert a2a["step_ms"] == pytest.approx(1e3 * step, rel=1e-12)
    assert a2a["balanced_ms"] == pytest.approx(1e3 * balanced, rel=1e-12)
    assert a2a["pct_balanced"] == pytest.approx(balanced / step, rel=1e-12)
    assert a2a["imbalance"] == 4.0  # 4T rows at one rank, mean T
    # seconds: the hot rank's step against three ranks that compute nothing and send T rows each
    idle = 4 * LAT + 2 * ROW_BYTES * T / BW
    assert a2a["time_imbalance"] == pytest.approx(step / ((step + 3 * idle) / 4), rel=1e-12)
    assert a2a["replica_bytes"] == 0 and a2a["replicas"] == 0 and a2a["hot_steps"] == [[]]
    # shadow broadcasts the hot expert: every rank computes its own T rows, 3 replicas move, each
    # its weights forward and its gradient back
    assert shadow["hot_steps"] == [[hot]] and shadow["replicas"] == 3
    assert shadow["imbalance"] == 1.0
    assert shadow["replica_bytes"] == 3 * 2 * PARAM_BYTES
    # the owner's link: it sends 3 P of weights forward, receives 3 P of gradients backward
    step = T * FLOPS_PER_ROW / FLOPS + 2 * LAT + 3 * PARAM_BYTES / BW
    assert shadow["step_ms"] == pytest.approx(1e3 * step, rel=1e-12)
    assert mix["step_ms"] <= min(a2a["step_ms"], shadow["step_ms"]) * (1 + 1e-12)
    assert 1.0 <= mix["time_imbalance"] <= a2a["time_imbalance"]
    for r in (a2a, shadow, mix):
        assert r["planning_ms"] > 0 and r["steps"] == 1 and r["profile"].endswith("tiny.json")
        with_planning = r["balanced_ms"] / (r["step_ms"] + r["planning_ms"])
        assert r["pct_with_planning"] == pytest.approx(with_planning, rel=1e-12)
        assert (r["shape"], r["world_size"], r["num_experts"], r["top_k"]) == ("tiny", 4, 4, 1)


def test_uniform_a2a_is_the_balanced_step(cfg) -> None:
    (a2a,) = case_records(
        BalanceConfig(**{**cfg.__dict__, "strategies": ("a2a",)}), TINY, 4, "uniform"
    )
    assert a2a["pct_balanced"] == 1.0 and a2a["step_ms"] == a2a["balanced_ms"]


def test_rotating_hotspot_is_followed_every_step(cfg) -> None:
    steps = counts_source("rotate:1:1.0:3", 4, 4, T, 1, seed=cfg.seed)
    hot = [int(C.sum(0).argmax()) for C in steps]
    assert len(set(hot)) == 3  # the hot expert moves every step
    a2a, shadow, _ = case_records(cfg, TINY, 4, "rotate:1:1.0:3")
    assert shadow["steps"] == 3 and shadow["hot_steps"] == [[g] for g in hot]
    per_step = [1e3 * _a2a_step_by_hand(C.tolist()) for C in steps]
    assert a2a["step_ms_per_step"] == pytest.approx(per_step, rel=1e-12)
    assert a2a["step_ms"] == pytest.approx(sum(per_step) / 3, rel=1e-12)
    assert a2a["pct_balanced"] == pytest.approx(a2a["balanced_ms"] / a2a["step_ms"])


def test_idle_ranks_route_nothing(cfg) -> None:
    (C,) = counts_source("idle:0.5", 4, 4, T, 1, seed=cfg.seed)
    rows_W = C.sum(1).tolist()
    assert sorted(rows_W) == [0, 0, 2 * T, 2 * T]  # the total of uniform, on half the ranks
    (a2a, *_) = case_records(cfg, TINY, 4, "idle:0.5")
    assert a2a["step_ms"] == pytest.approx(1e3 * _a2a_step_by_hand(C.tolist()), rel=1e-12)


def _rec(shape, W, workload, strategy, step, balanced=10.0, planning=0.1):
    return {"shape": shape, "world_size": W, "workload": workload, "strategy": strategy,
            "step_ms": step, "balanced_ms": balanced, "pct_balanced": balanced / step,
            "imbalance": 1.5, "planning_ms": planning,
            "pct_with_planning": balanced / (step + planning)}  # fmt: skip


def test_summary_caps_each_case_and_lists_mix_slower() -> None:
    records = [
        _rec("s", 8, "uniform", "a2a", 10.0),
        _rec("s", 8, "uniform", "mix", 8.0),  # 125%: capped at 100%
        _rec("s", 8, "hot:0.5", "a2a", 40.0),
        _rec("s", 8, "hot:0.5", "shadow", 20.0),
        _rec("s", 8, "hot:0.5", "mix", 25.0),  # 40%, slower than shadow
    ]
    s = summarize(records)
    assert s["strategies"]["mix"]["mean_pct_balanced"] == pytest.approx((1.0 + 0.4) / 2)
    assert s["strategies"]["mix"]["worst_pct_balanced"] == pytest.approx(0.4)
    assert s["strategies"]["mix"]["worst_case"] == "s W=8 hot:0.5"
    assert s["strategies"]["a2a"]["mean_pct_balanced"] == pytest.approx((1.0 + 0.25) / 2)
    # the planning time on the step: 8 + 0.1 ms still under 10 (capped), 25 + 0.1
    assert s["strategies"]["mix"]["mean_pct_with_planning"] == pytest.approx((1 + 10 / 25.1) / 2)
    assert s["strategies"]["mix"]["worst_case_with_planning"] == "s W=8 hot:0.5"
    assert s["mix_slower"] == [
        {"case": "s W=8 hot:0.5", "than": "shadow", "mix_ms": 25.0, "other_ms": 20.0}
    ]


def test_summary_with_planning_names_the_case_planning_hurts_most() -> None:
    """A case at balance but planning for a third of its step is worse than a slower one."""
    records = [_rec("s", 8, "zipf:1.2", "mix", 10.0, planning=5.0),
               _rec("s", 8, "hot:0.5", "mix", 12.5, planning=0.0)]  # fmt: skip
    mix = summarize(records)["strategies"]["mix"]
    assert mix["worst_case"] == "s W=8 hot:0.5" and mix["worst_pct_balanced"] == 0.8
    assert mix["worst_case_with_planning"] == "s W=8 zipf:1.2"
    assert mix["worst_pct_with_planning"] == pytest.approx(10 / 15)
    older = [{k: v for k, v in r.items() if k != "pct_with_planning"} for r in records]
    assert "mean_pct_with_planning" not in summarize(older)["strategies"]["mix"]


def test_bench_balance_cli(tmp_path, capsys) -> None:
    out, png = tmp_path / "b.jsonl", tmp_path / "b.png"
    argv = ["bench", "balance", "--shapes", "seeds", "--world-sizes", "4", "--tokens", "256",
            "--workloads", "uniform,hot:0.5,rotate:2:0.5:2", "--repeats", "1", "--markdown",
            "--jsonl", str(out), "--png", str(png)]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "| shape | W | profile | workload | strategy | step ms | % of balanced |" in text
    assert "mix: " in text and "of force-balanced on average, worst" in text
    assert "with the planning time on the step (this CPU, one thread): " in text
    assert "mix predicted slower than a2a or shadow in 0 cases" in text
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["workload"], r["strategy"]) for r in records][:3] == [
        ("uniform", "a2a"),
        ("uniform", "shadow"),
        ("uniform", "mix"),
    ]
    assert len(records) == 9 and records[0]["environment"]["torch"] == torch.__version__
    assert records[0]["kind"] == "bench_balance" and records[0]["profile"] == "h100-nvlink"
    assert records[-1]["steps"] == 2 and png.stat().st_size > 0
    assert cli.main([*argv, "--ahead"]) == 0
    assert "mix-ahead: " in capsys.readouterr().out


def test_mix_ahead_is_the_step_befores_plan_fitted(cfg) -> None:
    """``mix-ahead``: step k's plan is ``plan_mix`` of step k - 1 fitted to step k, or step k's
    own where that fit is stale; the step before step 0 a fresh draw of step 0's popularity
    (seeded: the same every run)."""
    cfg = dataclasses.replace(cfg, ahead=True, shapes=("seeds",), tokens=2048)
    shape = layer_shape(shape_spec("seeds"), 4)
    profile = load_profile(cfg.profile)
    steps = counts_source("rotate:2:0.5:3", 4, 16, 2048, 2, seed=cfg.seed)
    *_, ahead = case_records(cfg, "seeds", 4, "rotate:2:0.5:3")
    assert ahead["strategy"] == "mix-ahead" and ahead["steps"] == 3
    before = [redrawn_counts(steps[0], cfg.seed), *steps[:-1]]
    assert not torch.equal(before[0], steps[0])
    assert before[0].sum(1).tolist() == steps[0].sum(1).tolist()  # each source's rows, again
    want = []
    for B, C in zip(before, steps, strict=True):
        made = plan_mix(B, shape, profile, cfg.max_replicas)
        fitted = carried_plan(made, B, C, shape, profile)  # None: stale, C's own plan
        plan = plan_mix(C, shape, profile, cfg.max_replicas) if fitted is None else fitted
        want.append(1e3 * plan.prediction.step_s)
    assert ahead["step_ms_per_step"] == want
    assert case_records(cfg, "seeds", 4, "rotate:2:0.5:3")[-1]["step_ms_per_step"] == want
    plain = case_records(dataclasses.replace(cfg, ahead=False), "seeds", 4, "hot:0.5")
    assert [r["strategy"] for r in plain] == ["a2a", "shadow", "mix"]


def test_planners_timed_on_counts_flushed_before_each_call(cfg, monkeypatch) -> None:
    """Cold counts: before each timed planner call the step's counts are flushed from the
    caches, and under ``mix-ahead`` the step before's too (the fit reads both); each in the
    storage its strategy's count exchange gives it (mix: by columns, its transpose flushed)."""
    made = []

    class Recorder:  # CacheEvictor's interface, counting the evictions
        how = "lines"

        def __init__(self, tensors: list[torch.Tensor]) -> None:
            self.tensors, self.evictions = tensors, 0
            made.append(self)

        def evict(self) -> None:
            self.evictions += 1

    monkeypatch.setattr(workloads, "CacheEvictor", Recorder)
    cfg = dataclasses.replace(cfg, ahead=True, repeats=2, shapes=("seeds",), tokens=256)
    steps = counts_source("rotate:2:0.5:3", 4, 16, 256, 2, seed=cfg.seed)
    records = case_records(cfg, "seeds", 4, "rotate:2:0.5:3")
    assert [r["cold_caches"] for r in records] == ["lines"] * 4
    assert len(made) == 4 * 3 and all(e.evictions == 2 for e in made)  # 4 strategies x 3 steps
    assert all(t.is_contiguous() for e in made for t in e.tensors)  # what a flush reads
    for k, e in enumerate(made[:6]):  # a2a, shadow: the step's counts, row-major
        assert len(e.tensors) == 1 and torch.equal(e.tensors[0], steps[k % 3])
    for k, e in enumerate(made[6:9]):  # mix: the step's counts, stored by columns
        assert len(e.tensors) == 1 and torch.equal(e.tensors[0].t(), steps[k])
    for k, e in enumerate(made[9:]):  # mix-ahead: the step's and the step before's
        assert torch.equal(e.tensors[0].t(), steps[k]) and len(e.tensors) == 2
        if k:
            assert torch.equal(e.tensors[1].t(), steps[k - 1])
        else:  # a fresh draw of step 0's popularity
            assert torch.equal(e.tensors[1].t(), redrawn_counts(steps[0], cfg.seed))
    made.clear()
    warm = case_records(dataclasses.replace(cfg, cold=False), "seeds", 4, "hot:0.5")
    assert not made and {r["cold_caches"] for r in warm} == {None}


def test_bench_balance_experts_override(tmp_path, capsys) -> None:
    argv = ["bench", "balance", "--shapes", "deepseek", "--world-sizes", "4", "--tokens", "64",
            "--workloads", "hot:0.5", "--strategies", "a2a", "--repeats", "1",
            "--experts-per-rank", "3", "--jsonl", str(tmp_path / "b.jsonl"), "--png", ""]  # fmt: skip
    assert cli.main(argv) == 0
    assert (
        "deepseek-E3: D2048 F1024, 3 experts/rank, top-8, bf16, SwiGLU" in capsys.readouterr().out
    )
    (r,) = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert (r["shape"], r["num_experts"], r["experts_per_rank"]) == ("deepseek-E3", 12, 3)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--workloads", "hotset:8"], "workload 'hotset:8' is not understood"),
        (["--workloads", "idle:1.0"], "workload 'idle:1.0' is not understood"),
        (["--shapes", "deepseek", "--world-sizes", "3"], "not a multiple of W=3"),
        (["--shapes", "gpt"], "shape 'gpt' is unknown"),
        (["--strategies", "local"], "strategy 'local' is not expert-parallel"),
        (["--world-sizes", "1"], "world size must be >= 2"),
        (["--world-sizes", "8,x"], "is not a comma list of integers"),
        (["--repeats", "0"], "repeats must be >= 1"),
        (["--profile", "h100-nope"], "profile 'h100-nope' is neither a preset"),
        (["--workloads", ""], "workloads is empty"),
        (["--experts-per-rank", "0"], "--experts-per-rank must be >= 1"),
        # checked before the first case runs (no progress line): the default hotset:8 at W = 2
        (
            ["--world-sizes", "2", "--shapes", "seeds"],
            "shape 'seeds' at W=2: workload hotset:8:0.5 makes 8 of the 8 experts hot",
        ),
        (
            ["--shapes", "deepseek", "--world-sizes", "8", "--workloads", "rotate:256:0.5"],
            "makes 256 of the 256 experts hot",
        ),
        (
            ["--shapes", "seeds", "--world-sizes", "4", "--workloads", "hotset:16:0.5"],
            "makes 16 of the 16 experts hot",
        ),
    ],
)
def test_bench_balance_bad_input(argv, expected, capsys) -> None:
    assert cli.main(["bench", "balance", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
