"""Learning-rate schedules: linear warm-up then constant / cosine / linear decay to the floor,
against the closed form; a resumed run continues the sequence exactly; the rate reaches AdamW."""

from __future__ import annotations

import math

import pytest
from _train_helpers import tiny

from mixmoe.train.loop import train
from mixmoe.train.lr_schedule import lr_at


def _closed_form(schedule: str, step: int, lr=1e-3, floor=1e-4, warm=3, total=11) -> float:
    if step < warm:
        return lr * (step + 1) / warm
    p = min(1.0, (step - warm) / (total - warm))
    return {
        "constant": lr,
        "cosine": floor + (lr - floor) * (1 + math.cos(math.pi * p)) / 2,
        "linear": floor + (lr - floor) * (1 - p),
    }[schedule]


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_at_is_the_closed_form(schedule):
    got = [
        lr_at(s, lr=1e-3, min_lr=1e-4, warmup_steps=3, total_steps=11, schedule=schedule)
        for s in range(14)
    ]
    assert got == pytest.approx([_closed_form(schedule, s) for s in range(14)], rel=1e-12)
    assert got[0] == pytest.approx(1e-3 / 3) and got[2] == pytest.approx(1e-3)
    if schedule != "constant":
        assert got[11:] == pytest.approx([1e-4] * 3)  # the floor at and past max_steps
    with pytest.raises(ValueError, match="unknown"):
        lr_at(0, lr=1.0, schedule="step")


def test_train_follows_the_schedule_and_resumes_it_exactly(tmp_path):
    kw = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 3, "lr_schedule": "cosine"}
    d = tmp_path / "ck"
    full = train(tiny(max_steps=11, save_dir=str(d), save_every=5, **kw))
    assert [s.lr for s in full.steps] == pytest.approx(
        [_closed_form("cosine", s) for s in range(11)], rel=1e-12
    )
    resumed = train(tiny(max_steps=11, resume=str(d / "step-00000005"), **kw))
    assert resumed.start_step == 5
    assert [s.lr for s in resumed.steps] == [s.lr for s in full.steps[5:]]
    assert [s.loss for s in resumed.steps] == [s.loss for s in full.steps[5:]]
    with pytest.raises(ValueError, match="min_lr=0.1 is above lr=0.01"):
        tiny(lr=0.01, min_lr=0.1)
