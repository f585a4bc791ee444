"""``mixmoe bench hf`` on ranks, end to end at a tiny size: spawned gloo ranks (the CLI's default
launch) and ``torchrun`` over two "hosts" (two torchrun node processes on this machine, each with
its own temporary directory, as two machines would have). Checks the records' structure and
what they must say (every implementation, both routings, the balanced bound, replicas counted),
never a time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mixmoe import cli  # noqa: E402
from mixmoe.bench.hf import IMPLEMENTATIONS  # noqa: E402
from mixmoe.placement.profile import HardwareProfile  # noqa: E402
from mixmoe.placement.profile_io import profile_record, save_profile  # noqa: E402

pytestmark = pytest.mark.dist

TINY = [
    "--hidden-size", "32", "--intermediate-size", "64", "--num-experts", "4", "--layers", "1",
    "--vocab-size", "64", "--heads", "2", "--batch", "1", "--seq-len", "16",
    "--steps", "2", "--warmup", "1",
]  # fmt: skip


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bench_hf_on_two_spawned_ranks_reports_every_implementation_and_routing(tmp_path):
    out = tmp_path / "hf.jsonl"
    assert cli.main(["bench", "hf", "--world-size", "2", *TINY, "--jsonl", str(out)]) == 0
    records = _records(out)
    seen = {(r["routing"], r["implementation"]) for r in records}
    assert seen == {(r, i) for r in ("uniform", "skewed") for i in IMPLEMENTATIONS}
    for r in records:
        assert len(r["step_ms"]) == 2 and r["median_ms"] > 0 and r["environment"]
        if r["implementation"] in ("all_to_all", "mixmoe_a2a"):
            assert r["replicas_per_step"] == 0
        if r["implementation"] == "all_to_all":
            assert r["ratio"] == 1.0
        if r["implementation"] == "mixmoe_mix":  # the CPU profile never copies a 32-wide expert
            assert r["replicas_per_step"] == 0
    skewed = [r for r in records if r["routing"] == "skewed"]
    uniform = [r for r in records if r["routing"] == "uniform"]
    # the skew hook sends about half of all slots to the hot expert; the uniform run does not
    assert min(r["hot_share"] for r in skewed) > 0.4 > max(r["hot_share"] for r in uniform)
    assert all(r["balance_bound"] > 0 for r in skewed)


def test_bench_hf_profile_reaches_the_mixmoe_planners(tmp_path):
    """``--profile``: the mixmoe implementations plan with it. A compute-bound profile makes a
    replica of the hot expert pay where the default CPU profile never copies one (above)."""
    path = save_profile(
        tmp_path / "compute_bound.json",
        profile_record(
            HardwareProfile(
                "compute-bound", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
            ),
            source="test",
            measured=False,
        ),
    )
    out = tmp_path / "hf.jsonl"
    argv = ["bench", "hf", "--world-size", "2", *TINY, "--routing", "skewed"]
    argv += ["--implementations", "all_to_all,mixmoe_mix", "--profile", str(path)]
    assert cli.main([*argv, "--jsonl", str(out)]) == 0
    mix = next(r for r in _records(out) if r["implementation"] == "mixmoe_mix")
    assert mix["replicas_per_step"] > 0
    assert mix["config"]["profile"] == str(path)


def test_bench_hf_profile_errors_are_one_line(tmp_path, capsys):
    argv = ["bench", "hf", "--world-size", "2", *TINY, "--profile", str(tmp_path / "no.json")]
    assert cli.main(argv) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["bench", "hf", "--world-size", "1", "--profile", "cpu"]) == 2
    assert "one device has no planner" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_hf_under_torchrun_on_two_hosts_each_with_its_own_temp_dir(tmp_path):
    """Each "host" sees only its own temporary directory: the model must be written on every
    host (by its first local rank), not only by global rank 0, and removed afterwards."""
    port, out = _free_port(), tmp_path / "hf.jsonl"
    procs = []
    for node in (0, 1):
        tmp = tmp_path / f"host{node}"
        tmp.mkdir()
        env = dict(os.environ, TMPDIR=str(tmp), OMP_NUM_THREADS="1")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "mixmoe", "bench", "hf", "--world-size", "2",
            *TINY, "--routing", "uniform", "--implementations", "all_to_all,mixmoe_mix",
            "--jsonl", str(out),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    try:
        logs = [p.communicate(timeout=300)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"host {node}:\n{log[-3000:]}"
    records = _records(out)  # written once, by global rank 0
    assert [r["implementation"] for r in records] == ["all_to_all", "mixmoe_mix"]
    for node in (0, 1):  # the model directory is gone from both hosts
        assert not [p for p in (tmp_path / f"host{node}").iterdir() if "bench-hf" in p.name]
