"""Streamed outputs: every step's JSONL line is on disk as soon as the step ends (a run that dies
keeps the log of the steps it finished), ``mixmoe report`` redraws loss.png from such a partial
log, and ``tensorboard=True`` writes event files with the step's numbers."""

from __future__ import annotations

import json

import pytest
from _train_helpers import tiny

from mixmoe import cli
from mixmoe.train import loop
from mixmoe.train.loop import train
from mixmoe.train.outputs import latest_per_step, read_log

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_run_that_dies_keeps_its_log_and_report_redraws_it(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_step = loop.Trainer.step
    seen_on_disk = []

    def step(self, i):
        # each earlier step is already on disk while this one runs
        lines = (out / "train.jsonl").read_text().splitlines()
        seen_on_disk.append(len(lines))
        if i == 3:
            raise RuntimeError("simulated crash in step 3")
        return real_step(self, i)

    monkeypatch.setattr(loop.Trainer, "step", step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny(max_steps=10, out=str(out)))
    assert seen_on_disk == [0, 1, 2, 3]
    records = read_log(out / "train.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert not (out / "loss.png").exists()
    # a torn last line (killed while writing) is skipped
    with open(out / "train.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')
    assert cli.main(["report", str(out / "train.jsonl")]) == 0
    printed = capsys.readouterr().out
    assert "steps 0..2" in printed and "loss.png" in printed
    assert (out / "loss.png").read_bytes()[:8] == PNG


def test_resumed_steps_replace_the_earlier_lines():
    recs = [{"step": s, "loss": float(s)} for s in (0, 1, 2, 1, 2, 3)]
    recs[3]["loss"] = 10.0
    assert [(r["step"], r["loss"]) for r in latest_per_step(recs)] == [
        (0, 0.0),
        (1, 10.0),
        (2, 2.0),
        (3, 3.0),
    ]


def test_tensorboard_event_files_hold_the_step_numbers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = train(tiny(max_steps=2, out=str(out), tensorboard=True))
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("loss", "lr", "tokens_per_s", "aux_loss", "grad_norm"):
        assert f"train/{tag}" in tags, tags
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(s.step, pytest.approx(s.loss, rel=1e-6)) for s in result.steps]
    lines = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]


def test_tensorboard_needs_an_output_directory():
    with pytest.raises(ValueError, match="--out DIR"):
        tiny(tensorboard=True)
