"""``mixmoe bench peers``: mixmoe vs transformers' Mixtral block on the same weights, CPU
(engine: ``mixmoe.bench.peers``). Prints median/min fwd+bwd ms and the ratio to the fastest
transformers provider; ``--jsonl`` appends the result with the environment."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from mixmoe.bench.peers import PROVIDERS, PeerBenchConfig, run_peers
from mixmoe.commands.options import add_jsonl
from mixmoe.formats.results import append_jsonl
from mixmoe.report.text_table import render_table

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = PeerBenchConfig()
    p.add_argument("--model-dim", type=int, default=d.model_dim)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-experts", type=int, default=d.num_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--tokens", type=int, default=d.tokens)
    p.add_argument("--steps", type=int, default=d.steps, help="measured steps")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (not measured)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: leave)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--providers", default=",".join(d.providers), help=f"comma list, some of {PROVIDERS}"
    )
    add_jsonl(p, None, "the result")


def run(args: argparse.Namespace) -> int:
    cfg = PeerBenchConfig(
        model_dim=args.model_dim,
        hidden_size=args.hidden_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        tokens=args.tokens,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        seed=args.seed,
        providers=tuple(s.strip() for s in args.providers.split(",") if s.strip()),
    )
    result = run_peers(cfg)
    best_peer = min(
        (r["median_ms"] for p, r in result.items() if p != "mixmoe"), default=float("nan")
    )
    print(
        f"fwd+bwd, D={cfg.model_dim} F={cfg.hidden_size} N={cfg.num_experts} K={cfg.top_k} "
        f"T={cfg.tokens}, {cfg.threads} thread(s), {cfg.steps} steps after {cfg.warmup} warm-up"
    )
    rows = [
        (p, f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['median_ms'] / best_peer:.2f}x")
        for p, r in result.items()
    ]
    print(render_table(["provider", "median ms", "min ms", "vs fastest hf"], rows))
    if args.jsonl:
        records = [{"provider": p, **r} for p, r in result.items()]
        append_jsonl(args.jsonl, "bench_peers", asdict(cfg), torch.device("cpu"), records)
        print(f"JSONL appended to {args.jsonl}")
    return 0
