"""``mixmoe bench model``: the section 2 log (read back by the format reader and by ``mixmoe
report``), the averaging rule, the ratios, the JSONL; bad configurations."""

from __future__ import annotations

import json

import pytest

from mixmoe import cli
from mixmoe.bench.model import ModelBenchConfig
from mixmoe.formats.model_log import read_model_log


def test_log_table_jsonl_and_report(tmp_path, capsys):
    log, jsonl = tmp_path / "model.log", tmp_path / "b.jsonl"
    argv = ["bench", "model", "--models", "gpt2,transformer-xl", "--steps", "4"]
    argv += ["--average-last", "2", "--seq-len", "16", "--batch-size", "2"]
    assert cli.main([*argv, "--log", str(log), "--jsonl", str(jsonl)]) == 0
    printed = capsys.readouterr().out
    assert "vs_naive" in printed and "vs_a2a" in printed
    groups = read_model_log(log)
    assert list(groups) == [
        ("naive", "gpt2", 2),
        ("local", "gpt2", 2),
        ("naive", "transformer-xl", 2),
        ("local", "transformer-xl", 2),
    ]
    for (run,) in groups.values():
        assert len(run.steps) == 4
        mean = sum(s.step_ms for s in run.steps[-2:]) / 2
        assert run.summary.step_ms == pytest.approx(mean, rel=1e-4, abs=1e-3)
        for s in run.steps:
            assert s.step_ms == pytest.approx(s.forward_ms + s.backward_ms, rel=1e-6, abs=1e-5)
    records = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [(r["model"], r["variant"]) for r in records] == [k[1::-1] for k in groups]
    assert all(r["kind"] == "bench_model" and len(r["step_ms"]) == 4 for r in records)
    assert cli.main(["report", str(log)]) == 0
    table = capsys.readouterr().out
    assert "transformer-xl" in table and "naive" in table and "local" in table


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"models": ("mixtral",)}, "model 'mixtral' is not benchmarked"),
        ({"variants": ("naive", "fast")}, "variant 'fast' is unknown"),
        ({"variants": ("a2a",)}, "need --world-size > 1"),
        ({"variants": ("local",), "world_size": 2}, "variant 'local' runs on one rank"),
        ({"steps": 4, "average_last": 5}, "average_last=5 exceeds steps=4"),
        ({"variants": ("a2a",), "world_size": 2, "batch_size": 3}, "batch_size=3"),
    ],
)
def test_bad_configs(kw, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        ModelBenchConfig(**kw)


def test_cli_error_is_one_line(capsys):
    assert cli.main(["bench", "model", "--models", "gpt2,llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixmoe: error: model 'llama'") and "\n" not in err
