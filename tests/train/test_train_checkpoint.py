"""Checkpoints: save at W=2, resume at W=1 (and W=1 -> W=2, Transformer-XL memory included);
the resumed steps equal the uninterrupted run's (parameters AND AdamW states resharded). A
corrupt or mismatched checkpoint is a ValueError on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch
from _train_helpers import checkpoint_jobs, tiny
from torch.testing import assert_close

from mixmoe.comm import LocalCommunicator
from mixmoe.comm.launch import spawn_gloo
from mixmoe.train.checkpoint import read_checkpoint
from mixmoe.train.loop import train

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-10, "atol": 1e-12}


def _losses(result) -> torch.Tensor:
    return torch.tensor([(s.loss, s.aux_loss, s.grad_norm) for s in result.steps])


def test_resume_at_another_world_size_continues_the_run(tmp_path):
    gpt2_ckpt, txl_ckpt = str(tmp_path / "gpt2.pt"), str(tmp_path / "txl.pt")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint at all" * 10)
    # Transformer-XL saved at W=1 (micro-batches 2: the twin of 2 ranks), resumed below at W=2
    train(tiny(model="transformer-xl", micro_batches=2, max_steps=2, save=txl_ckpt))
    gpt2_good = str(tmp_path / "gpt2-w1.pt")  # readable at W=2 (N = 4 experts)
    train(tiny(model="gpt2", max_steps=1, save=gpt2_good))
    out = spawn_gloo(
        checkpoint_jobs,
        2,
        [
            tiny(model="gpt2", strategy="a2a", max_steps=2, save=gpt2_ckpt),
            tiny(model="transformer-xl", strategy="mix", max_steps=4, resume=txl_ckpt),
        ],
        tiny(model="gpt2", strategy="a2a", max_steps=4, resume=str(corrupt)),
        (gpt2_good, str(corrupt)),
    )
    # GPT-2 saved at W=2, resumed at W=1
    resumed = train(tiny(model="gpt2", micro_batches=2, max_steps=4, resume=gpt2_ckpt))
    for model, got in (("gpt2", resumed), ("transformer-xl", out[0]["results"][1])):
        ref = train(tiny(model=model, micro_batches=2, max_steps=4))
        assert got.start_step == 2 and [s.step for s in got.steps] == [2, 3]
        assert_close(_losses(got), _losses(ref)[2:], **TOL, msg=lambda m, n=model: f"{n}: {m}")
    for rank in range(2):
        error = out[rank]["error"]
        assert error.startswith("ValueError") and "corrupt" in error, (rank, error)
    # rank 0 read a good file, rank 1 a corrupt one: both raise (the verdict is agreed)
    assert "could not be read on another rank" in out[0]["split_error"], out[0]["split_error"]
    assert "corrupt" in out[1]["split_error"], out[1]["split_error"]


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    path = str(tmp_path / "c.pt")
    train(tiny(model="gpt2", max_steps=1, save=path))
    spec = tiny(model="gpt2", num_experts=8).model_spec(1)
    with pytest.raises(ValueError, match="num_experts=4 .this run: 8"):
        read_checkpoint(path, spec, LocalCommunicator())
    with pytest.raises(ValueError, match="model='gpt2' .this run: 'bert'"):
        train(tiny(model="bert", max_steps=2, resume=path))
    with pytest.raises(ValueError, match="does not exist"):
        train(tiny(model="gpt2", max_steps=2, resume=str(tmp_path / "missing.pt")))
