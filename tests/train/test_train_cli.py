"""``mixmoe train`` end to end (a tiny GPT-2 on the CPU) and its one-line errors; the API's
ValueErrors for bad configurations."""

from __future__ import annotations

import json
import math

import pytest

from mixmoe import cli
from mixmoe.train.loop import TrainConfig, check_world

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--no-progress"]


def test_cli_smoke_writes_jsonl_png_and_a_checkpoint(tmp_path, capsys):
    out, ckpt = tmp_path / "run", tmp_path / "c.pt"
    argv = ["train", "--model", "gpt2", *TINY, "--max-steps", "3", "--eval-every", "2"]
    assert cli.main([*argv, "--out", str(out), "--save", str(ckpt)]) == 0
    printed = capsys.readouterr().out
    assert "first loss" in printed and "tokens/s" in printed and "plan wait ms" in printed
    lines = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    for r in lines:
        assert r["kind"] == "train" and r["strategy"] == "local" and r["world_size"] == 1
        assert r["plan_wait_ms"] == 0.0  # one device: no planning thread
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and "torch" in r["environment"]
    assert lines[1]["eval_loss"] is not None and math.isfinite(lines[1]["eval_loss"])
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # resume one more step from the checkpoint
    assert cli.main([*argv[:-4], "--max-steps", "4", "--resume", str(ckpt), "--out", ""]) == 0
    assert "first loss" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--model", "gpt3"], "model 'gpt3' is unknown"),
        (["--preset", "huge"], "preset 'huge' is unknown"),
        (["--moe-layers", "0,5"], "block indices [5] are out of range"),
        (["--moe-layers", "every:0"], "N must be >= 1"),
        (["--world-size", "2", "--num-experts", "3"], "num_experts=3 is not divisible"),
        (["--world-size", "2", "--strategy", "local"], "strategy 'local' keeps every expert"),
        (["--strategy", "a2a"], "needs an expert-parallel group"),
        (["--batch-size", "3", "--world-size", "2"], "batch_size=3 (global) does not split"),
        (["--dtype", "bfloat16"], "bfloat16 (autocast) is for CUDA"),
        (["--model", "mixtral", "--moe-layers", "0"], "every Mixtral block is a MoE block"),
        (["--resume", "/nonexistent/ckpt.pt"], "does not exist"),
        (["--world-size", "0"], "--world-size must be >= 1, got 0"),  # was a spawn traceback
        (["--device", "nope"], "device 'nope' is not understood"),  # these three were tracebacks
        (["--device", "mps"], "mixmoe runs on cpu or cuda"),
        (["--device", "cuda:99"], "device 'cuda:99': "),  # no CUDA here, or not 100 GPUs
        (["--lr", "inf"], "lr must be finite, got inf"),  # these trained to a NaN loss
        (["--router-skew", "nan"], "router_skew must be a finite number, got nan"),
        (["--collective-timeout", "0"], "collective_timeout_s must be > 0"),
        (["--world-size", "2", "--threads", "0"], "threads must be >= 1, got 0"),  # before spawning
    ],
)
def test_bad_input_is_one_line(extra, expected, capsys):
    argv = ["train", "--model", "gpt2", *TINY, "--max-steps", "1", "--out", "", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixmoe: error: ") and "\n" not in err and "Traceback" not in err, err
    assert expected in err, err


def test_corrupt_checkpoint_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00garbage" * 50)
    argv = ["train", "--model", "gpt2", *TINY, "--max-steps", "1", "--out", ""]
    assert cli.main([*argv, "--resume", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixmoe: error: checkpoint") and "corrupt" in err and "\n" not in err


def test_api_value_errors():
    with pytest.raises(ValueError, match="use one of gpt2, bert, transformer-xl, mixtral"):
        TrainConfig(model="llama")
    # types the API took without a word (a NaN flag read as True, a number for a path)
    with pytest.raises(TypeError, match="dense must be True or False, got nan"):
        TrainConfig(dense=float("nan"))
    with pytest.raises(TypeError, match="out must be a path"):
        TrainConfig(out=float("inf"))
    with pytest.raises(TypeError, match="router_skew must be a float, got True"):
        TrainConfig(router_skew=True)
    with pytest.raises(TypeError, match="profile must be a HardwareProfile"):
        TrainConfig(profile="gpu")
    with pytest.raises(ValueError, match="out of range"):
        TrainConfig(model="transformer-xl", moe_layers=[0, 2])
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(num_experts=4, num_local_experts=2)
    with pytest.raises(TypeError, match="max_steps must be an int"):
        TrainConfig(max_steps=2.5)
    with pytest.raises(ValueError, match="ep_size=3 does not divide the world size 4"):
        check_world(TrainConfig(strategy="a2a", ep_size=3), 4)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the EP size 4"):
        check_world(TrainConfig(strategy="mix", num_experts=6), 4)
    spec, ep = check_world(TrainConfig(strategy="mix", num_local_experts=3, ep_size=2), 4)
    assert (spec.num_experts, ep) == (6, 2)
    with pytest.raises(TypeError, match="TrainConfig"):
        from mixmoe.train.loop import train

        train({"model": "gpt2"})
