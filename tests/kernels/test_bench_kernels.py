"""``mixmoe bench kernels`` end to end at toy sizes (CPU: torch providers; GPU tier: all four)."""

from __future__ import annotations

import json

import pytest
import torch

from mixmoe.cli import main

TOY = [
    "bench",
    "kernels",
    "--experts",
    "4",
    "--rows-per-expert",
    "32",
    "--skew",
    "uniform,hot:0.5",
    "--model-dim",
    "16",
    "--hidden-size",
    "32",
    "--warmup",
    "0",
    "--repeats",
    "2",
]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cpu_runs_torch_providers_and_says_why_not_triton(tmp_path, capsys):
    out = tmp_path / "kernels.jsonl"
    assert main([*TOY, "--device", "cpu", "--jsonl", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mixmoe skipped: the Triton kernels need a CUDA device" in text
    for provider in ("torch-loop", "torch-grouped", "dense"):
        assert provider in text
    records = _records(out)
    assert len(records) == 2 * 2 * 4  # skews x modes x providers
    timed = [r for r in records if "ms" in r]
    assert {r["provider"] for r in timed} >= {"torch-loop", "dense"}
    for r in timed:
        assert r["correct"] and r["ms"] > 0 and r["tflops"] > 0 and len(r["times_ms"]) == 2
        assert r["environment"]["torch"] == torch.__version__ and r["config"]["model_dim"] == 16
    flops_fwd = 2 * 2 * records[0]["rows"] * 16 * 32
    r = next(r for r in timed if r["mode"] == "fwd" and r["provider"] == "dense")
    assert r["tflops"] == pytest.approx(flops_fwd / (r["ms"] * 1e-3) / 1e12)


def test_rejects_unknown_provider(capsys):
    assert main([*TOY, "--device", "cpu", "--providers", "cublas"]) == 2
    assert "mixmoe: error: provider 'cublas' is unknown" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_runs_all_providers(tmp_path, capsys):
    pytest.importorskip("triton")
    out = tmp_path / "kernels.jsonl"
    assert main([*TOY, "--device", "cuda", "--dtype", "bf16", "--jsonl", str(out)]) == 0
    records = _records(out)
    mixmoe = [r for r in records if r["provider"] == "mixmoe"]
    assert mixmoe and all(r.get("correct") and r["ms"] > 0 for r in mixmoe)
