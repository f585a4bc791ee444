"""``mixmoe train``: train a GPT-2 / BERT / Transformer-XL / Mixtral / DeepSeek-style model with
mixmoe MoE FFNs on
the byte-level pydoc corpus, on one process, ``--world-size N`` gloo CPU processes, or the
``torchrun`` group. The engine is ``mixmoe.train`` (``TrainConfig``, ``train``).

Writes a progress line to stderr, ``<out>/train.jsonl`` (one record per step, with the config
and the environment) and ``<out>/loss.png``, and prints a summary table.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from mixmoe.commands.options import world_size
from mixmoe.config import STRATEGIES
from mixmoe.train.loop import DTYPES, TrainConfig, TrainResult, check_world
from mixmoe.train.presets import MODELS, PRESETS

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help=f"one of {', '.join(MODELS)}")
    p.add_argument("--preset", default=d.preset, help=f"size: {' | '.join(PRESETS)}")
    p.add_argument(
        "--moe-layers", default=d.moe_layers, help="blocks with MoE FFNs: all | every:N | 0,2,..."
    )
    p.add_argument("--num-experts", type=int, default=None, help="global number of experts N")
    p.add_argument(
        "--num-local-experts",
        type=int,
        default=None,
        help="experts per EP rank (N = this x EP size; default 2 when --num-experts is not given)",
    )
    p.add_argument(
        "--top-k", type=int, default=None, help="experts per token (default: preset's, 2 or 4)"
    )
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: preset's)")
    p.add_argument(
        "--strategy",
        default=None,
        help=f"one of {', '.join(STRATEGIES)} (default: local on one rank, mix on several)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks; spawns gloo CPU processes (default: torchrun's WORLD_SIZE or 1)",
    )
    p.add_argument(
        "--ep-size", type=int, default=None, help="ranks per expert-parallel group (default: all)"
    )
    p.add_argument(
        "--max-steps", "--steps", dest="max_steps", type=int, default=d.max_steps, help="steps"
    )
    p.add_argument(
        "--time-budget", type=float, default=None, help="stop after this many seconds (all ranks)"
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (rows)")
    p.add_argument(
        "--micro-batches", type=int, default=d.micro_batches, help="gradient accumulation per rank"
    )
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument(
        "--lr-schedule",
        default=d.lr_schedule,
        choices=["constant", "cosine", "linear"],
        help="after the warm-up: constant, or cosine / linear decay to --min-lr at --max-steps",
    )
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps")
    p.add_argument("--min-lr", type=float, default=d.min_lr, help="the decay's floor")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decay")
    p.add_argument("--clip", type=float, default=d.clip, help="global gradient norm (0: off)")
    p.add_argument(
        "--aux-loss-coef",
        type=float,
        default=None,
        help="balance loss weight (default: preset's, 0.01; deepseek 1e-4, sequence-wise)",
    )
    p.add_argument(
        "--bias-update-rate",
        type=float,
        default=None,
        help="deepseek: aux-loss-free balancing bias step per optimizer step (default 1e-3; 0: off)",
    )
    p.add_argument(
        "--router-skew",
        type=float,
        default=0.0,
        help="skewed start: added to the router bias of experts 0 .. N/2-1",
    )
    p.add_argument("--eval-every", type=int, default=10, help="eval every N steps (0: never)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="eval batches")
    p.add_argument(
        "--dtype", default=d.dtype, choices=list(DTYPES), help="bfloat16: autocast on CUDA"
    )
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the data")
    p.add_argument(
        "--save-dir",
        default=None,
        help="sharded checkpoints here (step-N directories; every rank writes its own shards)",
    )
    p.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every N steps (and at the end)"
    )
    p.add_argument(
        "--save-every-minutes", type=float, default=None, help="checkpoint every M minutes"
    )
    p.add_argument("--keep", type=int, default=None, help="keep the newest K checkpoints")
    p.add_argument(
        "--resume",
        default=None,
        help="auto (the newest complete checkpoint under --save-dir), a step-N directory, or "
        "a --save file; any world size whose EP size divides the experts",
    )
    p.add_argument(
        "--save",
        default=None,
        help="also write ONE consolidated file at the end (gathered on rank 0: small models)",
    )
    p.add_argument("--out", default="runs/train", help="directory of train.jsonl and loss.png")
    p.add_argument(
        "--data",
        default=None,
        help="your own data: a UTF-8 text file or directory (byte-level), or a pre-tokenized "
        "uint16/uint32 .bin file (or a directory with train.bin, val.bin) with --vocab-size "
        "(default: the built-in pydoc corpus)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary of a pre-tokenized --data file"
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files to <out>/tensorboard (needs tensorboard)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=TrainConfig().collective_timeout_s,
        help="seconds a rank may wait in a collective (a stalled rank fails the run after this)",
    )
    p.add_argument(
        "--plan-ahead",
        action="store_true",
        help="mix: plan each step from the step before's counts in the background and only fit "
        "that plan on the step (MoEConfig.plan_ahead)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per spawned rank")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _world(args: argparse.Namespace) -> int:
    return world_size(args.world_size)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    world = _world(args)
    ep_size = args.ep_size or world
    strategy = args.strategy or ("local" if ep_size == 1 else "mix")
    return TrainConfig(
        model=args.model,
        preset=args.preset,
        moe_layers=args.moe_layers,
        num_experts=args.num_experts,
        num_local_experts=args.num_local_experts,
        top_k=args.top_k,
        seq_len=args.seq_len,
        strategy=strategy,
        ep_size=args.ep_size,
        batch_size=args.batch_size,
        micro_batches=args.micro_batches,
        max_steps=args.max_steps,
        time_budget_s=args.time_budget,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip=args.clip,
        aux_loss_coef=args.aux_loss_coef,
        bias_update_rate=args.bias_update_rate,
        router_skew=args.router_skew,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        save=args.save,
        resume=args.resume,
        save_dir=args.save_dir,
        save_every=args.save_every,
        save_every_minutes=args.save_every_minutes,
        keep=args.keep,
        out=args.out or None,
        progress=not args.no_progress,
        tensorboard=args.tensorboard,
        collective_timeout_s=args.collective_timeout,
        data=args.data,
        vocab_size=args.vocab_size,
        plan_ahead=args.plan_ahead,
    )


def summary(result: TrainResult) -> str:
    """A one-row table: steps, first and last loss, eval loss, median tokens/s, step time and
    the step's wait for the MoE layers' planning threads (``plan_wait_ms``: the planning a
    step did not hide; 0 without an async plan) (the first step of the run, warm-up, excluded
    when there are more)."""
    from mixmoe.bench.timing import median
    from mixmoe.report.text_table import render_table

    steps = result.steps
    if not steps:
        return "no step was run (max_steps reached already or time budget 0)"
    steady = steps[1:] if len(steps) > 1 else steps
    row = [
        result.spec.model,
        result.strategy,
        result.world_size,
        len(steps),
        f"{steps[0].loss:.4f}",
        f"{steps[-1].loss:.4f}",
        None if result.final_eval_loss is None else f"{result.final_eval_loss:.4f}",
        f"{median([s.tokens_per_s for s in steady]):,.0f}",
        f"{median([s.step_ms for s in steady]):.1f}",
        f"{median([s.plan_wait_ms for s in steady]):.2f}",
    ]
    headers = ["model", "strategy", "W", "steps", "first loss", "last loss", "eval loss"]
    headers += ["tokens/s", "step ms", "plan wait ms"]
    return render_table(headers, [row])


def run(args: argparse.Namespace) -> int:
    from mixmoe.train.launch import run_training, under_torchrun

    config = config_from_args(args)
    world = _world(args)
    spec, _ = check_world(config, world)  # before any rank starts: one-line errors
    if config.data is not None:
        from mixmoe.train.sources import load_tokens

        load_tokens(config.data, config.vocab_size)  # a bad file: one line, before any rank
    if config.resume and config.resume != "auto" and not under_torchrun():
        _check_resume(config.resume, spec)
    from mixmoe.comm.launch import RanksFailed

    try:
        result = run_training(config, args.world_size, threads=args.threads)
    except RanksFailed as e:
        advice = _resume_advice(config)
        if e.local:  # torchrun: this rank's line only, with the advice on it
            e.user_lines = [f"{line}; {advice}" for line in e.user_lines]
        else:
            e.user_lines = [*e.user_lines, advice]
        raise
    if result is None:
        return 0
    print(summary(result))
    if result.stopped_by == "time_budget":
        print(f"stopped by the time budget ({config.time_budget_s} s)")
    if config.out:
        print(
            f"per-step JSONL appended to {os.path.join(config.out, 'train.jsonl')}; "
            f"loss curve {os.path.join(config.out, 'loss.png')}"
        )
    if config.save_dir:
        from mixmoe.train.sharded import latest_checkpoint

        print(f"newest checkpoint: {latest_checkpoint(config.save_dir)}")
    if config.save:
        print(f"checkpoint written to {config.save}")
    return 0


def _resume_advice(config: TrainConfig) -> str:
    """Where a failed run can resume from, and the command that does it."""
    if not config.save_dir:
        return "no checkpoint (no --save-dir): rerun with --save-dir DIR --save-every N"
    from mixmoe.comm.launch import under_torchrun
    from mixmoe.train.sharded import latest_checkpoint

    last = latest_checkpoint(config.save_dir)
    argv = list(sys.argv[1:]) if "train" in sys.argv[1:2] else ["train", "..."]
    if "--resume" in argv:
        i = argv.index("--resume")
        del argv[i : i + 2]
    prefix = ["torchrun", "...", "-m", "mixmoe"] if under_torchrun() else ["mixmoe"]
    command = shlex.join([*prefix, *argv, "--resume", "auto"])
    return f"last complete checkpoint: {last or 'none yet'}; resume: {command}"


def _check_resume(path: str, spec) -> None:
    """Check the checkpoint before any rank starts (one-line errors)."""
    if os.path.isdir(path):
        from mixmoe.train.sharded import read_marker

        read_marker(path, spec)
    else:
        from mixmoe.train.checkpoint import check_checkpoint

        check_checkpoint(path, spec)
