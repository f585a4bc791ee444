"""``mixmoe bench model``: time whole training steps of GPT-2 / BERT / Transformer-XL with MoE
FFNs, per variant (``naive`` dense FFN model and one per strategy), several models in one run.

Writes the docs/formats.md section 2 log (STEP lines and ``<variant> <model> <E> [Summary]
...`` per run) to stdout (or ``--log``), a progress line to stderr, then a table with the ratios
to ``naive`` and to ``a2a``, and a JSONL record per run. ``mixmoe report`` reads the log. The
engine is ``mixmoe.bench.model`` (which runs ``mixmoe.train``'s training step).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from mixmoe.bench.model import (
    NAIVE,
    ModelBenchConfig,
    VariantResult,
    jsonl_records,
    run_distributed,
    run_rank,
    summary_rows,
    write_log,
)
from mixmoe.commands.options import add_device, add_jsonl, world_size
from mixmoe.formats.results import append_jsonl
from mixmoe.report.text_table import render_table
from mixmoe.train.loop import DTYPES

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ModelBenchConfig()
    p.add_argument("--models", default="gpt2", help="comma list of gpt2, bert, transformer-xl")
    p.add_argument(
        "--variants",
        default=None,
        help="comma list of naive, local, a2a, shadow, mix "
        "(default: naive,local on one rank, naive,a2a,shadow,mix on several)",
    )
    p.add_argument("--preset", default=d.preset, help="tiny | base")
    p.add_argument(
        "--num-local-experts", type=int, default=d.num_local_experts, help="experts per rank"
    )
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (rows)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: preset's)")
    p.add_argument("--steps", type=int, default=d.steps, help="steps per run (warm-up included)")
    p.add_argument(
        "--average-last",
        type=int,
        default=None,
        help="average the last N steps (default: the last 60%%, as the legacy tool: 60 of 100)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks; on CPU spawns gloo processes (default: torchrun's WORLD_SIZE or 1)",
    )
    p.add_argument("--dtype", default=d.dtype, choices=list(DTYPES), help="bfloat16: CUDA autocast")
    add_device(p, d.device, "the models")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the data")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: leave)")
    p.add_argument("--log", default=None, help="write the section 2 log here instead of stdout")
    add_jsonl(p, "runs/bench-model.jsonl", "one record per variant")


def _list(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def config_from_args(args: argparse.Namespace) -> ModelBenchConfig:
    world = world_size(args.world_size)
    default = f"{NAIVE},local" if world == 1 else f"{NAIVE},a2a,shadow,mix"
    return ModelBenchConfig(
        models=_list(args.models),
        variants=_list(args.variants or default),
        preset=args.preset,
        num_local_experts=args.num_local_experts,
        top_k=args.top_k,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        average_last=args.average_last,
        world_size=world,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        lr=args.lr,
        threads=args.threads,
        jsonl=args.jsonl or None,
    )


def report(cfg: ModelBenchConfig, results: list[VariantResult], log: str | None = None) -> None:
    """The log, the table and the JSONL records of one benchmark."""
    if log:
        with open(log, "w", encoding="utf-8") as f:
            write_log(cfg, results, f)
        print(f"model log written to {log}")
    else:
        write_log(cfg, results)
    print(
        f"W = {cfg.world_size}, E = {cfg.num_local_experts} per rank; mean of the last "
        f"{cfg.averaged} of {cfg.steps} steps (synchronised: the slowest rank)"
    )
    rows = summary_rows(cfg, results)
    headers = list(rows[0])
    cells = [
        [f"{v:.3f}" if isinstance(v, float) else v for v in (row[k] for k in headers)]
        for row in rows
    ]
    print(render_table(headers, cells))
    if cfg.jsonl:
        import torch

        append_jsonl(
            cfg.jsonl,
            "bench_model",
            asdict(cfg),
            torch.device(cfg.device),
            jsonl_records(cfg, results),
        )
        print(f"JSONL appended to {cfg.jsonl}")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    results = run_distributed(cfg) if cfg.world_size > 1 else run_rank(cfg)
    if results is not None:
        report(cfg, results, args.log)
    return 0
