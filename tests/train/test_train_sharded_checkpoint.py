"""Sharded checkpoints (DCP): periodic saves, atomic visibility, ``--resume auto`` at another
world size (W=1 -> 3 -> 2 -> 1) continuing the uninterrupted run exactly (float64), a crash
inside a save leaving the previous checkpoint as the one ``auto`` takes, ``keep``.

Without the balance loss (``aux_loss_coef = 0``; the loss of a shard split is then the same
global-batch mean at every world size, see ``mixmoe.train.loop``) W ranks train the model one
rank trains, to rounding. Transformer-XL: its memory is resumed too.
"""

from __future__ import annotations

import os

import pytest
import torch
from _train_helpers import run_many, tiny, train_crashing_in_save
from torch.testing import assert_close

from mixmoe.comm.launch import spawn_gloo
from mixmoe.train import sharded
from mixmoe.train.loop import TrainConfig, train
from mixmoe.train.outputs import read_log

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-10, "atol": 1e-12}


def _cfg(world: int, **kw):
    return tiny(
        model="transformer-xl",
        num_experts=6,
        batch_size=6,
        aux_loss_coef=0.0,
        strategy="local" if world == 1 else "mix",
        **kw,
    )


def _curve(rows) -> torch.Tensor:
    return torch.tensor([(r["loss"], r["grad_norm"]) for r in rows])


def _as_rows(result) -> list[dict]:
    return [{"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm} for s in result.steps]


def _listing(d) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.slow
def test_resume_auto_across_world_sizes_and_crashed_saves(tmp_path, monkeypatch):
    ref = _as_rows(train(_cfg(1, max_steps=8)))
    d, log = tmp_path / "ckpt", tmp_path / "run"
    # W=1: saves step 2; the save of step 4 dies after DCP wrote everything, before the commit
    real, calls = sharded.save_flat, []

    def dies_before_commit(state, path, comm):
        real(state, path, comm)
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("simulated crash before the commit")

    monkeypatch.setattr(sharded, "save_flat", dies_before_commit)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(_cfg(1, max_steps=8, save_dir=str(d), save_every=2))
    monkeypatch.undo()
    assert _listing(d) == [".step-00000004.tmp", "step-00000002"]
    assert (d / ".step-00000004.tmp" / ".metadata").is_file()  # complete but never committed
    assert sharded.latest_checkpoint(d).name == "step-00000002"
    # W=3 resumes step 2, saves step 4; its last save (step 6) dies on rank 1 after its shard
    w3 = _cfg(3, max_steps=6, save_dir=str(d), save_every=2, resume="auto", out=str(log))
    errors = spawn_gloo(train_crashing_in_save, 3, w3, 1, 2)
    assert all("simulated crash after this rank's shards" in e for e in errors), errors
    assert sharded.latest_checkpoint(d).name == "step-00000004"
    logged = read_log(log / "train.jsonl")  # the log of the crashed run is intact
    assert [r["step"] for r in logged] == [2, 3, 4, 5]
    assert_close(_curve(logged), _curve(ref[2:6]), **TOL)
    # W=2 resumes step 4 (written by 3 ranks), keeps the newest 2 checkpoints
    (w2,) = spawn_gloo(run_many, 2, [_cfg(2, max_steps=6, save_dir=str(d), resume="auto", keep=2)])[
        0
    ]
    assert w2.start_step == 4
    assert_close(_curve(_as_rows(w2)), _curve(ref[4:6]), **TOL)
    assert _listing(d) == ["step-00000004", "step-00000006"]
    # W=1 resumes step 6 (written by 2 ranks)
    w1 = train(_cfg(1, max_steps=8, save_dir=str(d), resume="auto"))
    assert w1.start_step == 6
    assert_close(_curve(_as_rows(w1)), _curve(ref[6:8]), **TOL)


def test_auto_without_a_checkpoint_starts_at_step_0_and_bad_ones_are_refused(tmp_path):
    d = tmp_path / "none"
    got = train(_cfg(1, max_steps=1, save_dir=str(d), resume="auto"))
    assert got.start_step == 0 and _listing(d) == ["step-00000001"]
    with pytest.raises(ValueError, match="num_experts=6 .this run: 4"):
        train(tiny(model="transformer-xl", max_steps=2, resume=str(d / "step-00000001")))
    with pytest.raises(ValueError, match="not a complete mixmoe checkpoint"):
        train(_cfg(1, max_steps=2, resume=str(tmp_path)))
    with pytest.raises(ValueError, match="give --save-dir"):
        _cfg(1, resume="auto")
    with pytest.raises(ValueError, match="need --save-dir"):
        _cfg(1, save_every=3)


def test_consolidate_and_shard_round_trip(tmp_path, capsys):
    """A sharded checkpoint consolidated is the --save file of the same run, tensor for tensor;
    sharded back, it resumes the run exactly."""
    from mixmoe import cli

    cfg = _cfg(1, max_steps=2, save_dir=str(tmp_path / "a"), save=str(tmp_path / "saved.pt"))
    train(cfg)
    step2 = tmp_path / "a" / "step-00000002"
    one = tmp_path / "one.pt"
    assert cli.main(["checkpoint", "consolidate", str(step2), str(one)]) == 0
    got = torch.load(one, weights_only=True)
    want = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert got["step"] == want["step"] == 2 and got["spec"] == want["spec"]
    assert sorted(got["model"]) == sorted(want["model"])
    for k, v in want["model"].items():
        assert_close(got["model"][k], v, rtol=0, atol=0, msg=k)
    assert sorted(got["optimizer"]["state"]) == sorted(want["optimizer"]["state"])
    for name, entry in want["optimizer"]["state"].items():
        for key, v in entry.items():
            assert_close(got["optimizer"]["state"][name][key], v, rtol=0, atol=0)
    for a, b in zip(got["mems"], want["mems"], strict=True):
        assert_close(a, b, rtol=0, atol=0)
    assert cli.main(["checkpoint", "shard", str(one), str(tmp_path / "b")]) == 0
    assert "step-00000002" in capsys.readouterr().out
    ref = train(_cfg(1, max_steps=4, resume=str(step2)))
    back = train(_cfg(1, max_steps=4, resume=str(tmp_path / "b" / "step-00000002")))
    assert_close(_curve(_as_rows(back)), _curve(_as_rows(ref)), rtol=0, atol=0)
    assert cli.main(["checkpoint", "consolidate", str(tmp_path), str(one)]) == 2


def test_save_every_minutes_and_keep(tmp_path):
    d = tmp_path / "ck"
    train(_cfg(1, max_steps=3, save_dir=str(d), save_every_minutes=1e-9))  # due after every step
    assert _listing(d) == ["step-00000001", "step-00000002", "step-00000003"]
    train(_cfg(1, max_steps=5, save_dir=str(d), resume="auto", save_every=1, keep=1))
    assert _listing(d) == ["step-00000005"]


def test_deepseek_resumes_its_balancing_biases_exactly(tmp_path):
    """The aux-loss-free selection biases are buffers: a resumed run continues them."""
    kw = {"model": "deepseek", "batch_size": 2, "seq_len": 16, "dtype": "float64",
          "progress": False, "router_skew": 1.0}  # fmt: skip
    full = train(TrainConfig(max_steps=4, **kw))
    d = str(tmp_path / "ck")
    train(TrainConfig(max_steps=4, save_dir=d, save_every=2, **kw))
    resumed = train(TrainConfig(max_steps=4, resume=f"{d}/step-00000002", **kw))
    assert [s.loss for s in resumed.steps] == [s.loss for s in full.steps[2:]]

    # loads and bias ranges continue (the dead-expert window restarts: a metric, not state)
    def biases(steps):
        return [[(m["load"], m["bias_min"], m["bias_max"]) for m in s.moe] for s in steps]

    assert biases(resumed.steps) == biases(full.steps[2:])
