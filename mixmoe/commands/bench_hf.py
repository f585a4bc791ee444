"""``mixmoe bench hf``: a transformers MoE model's training step under transformers' FSDP x EP
with ``all_to_all`` and each mixmoe EP implementation, uniform and skewed routing; with
``--world-size 1``, on one device under each experts implementation (``eager``, ``batched_mm``,
``grouped_mm``, ``mixmoe``). Engine: ``mixmoe.bench.hf``. Prints median step ms and the ratio to
the baseline (``all_to_all``; ``eager`` on one device, plus the ratio to the fastest of
transformers' own) per routing; on ranks with both routings, the skewed rows are followed by the
balanced bound (uniform ``all_to_all`` / skewed ``all_to_all``: what perfect balancing at zero
cost would reach); ``--jsonl`` appends the records with the environment;
``--markdown`` prints a Markdown table."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from mixmoe.bench.hf import (
    BASELINE,
    EXPERTS_DEFAULT,
    EXPERTS_IMPLEMENTATIONS,
    FAMILIES,
    IMPLEMENTATIONS,
    ROUTINGS,
    HFBenchConfig,
    HFModelShape,
    run_hf_bench,
)
from mixmoe.formats.results import append_jsonl
from mixmoe.report.text_table import render_table

__all__ = ["add_arguments", "run"]


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, s = HFBenchConfig(), HFModelShape()
    p.add_argument("--family", default=s.family, choices=FAMILIES)
    p.add_argument("--hidden-size", type=int, default=s.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=s.intermediate_size)
    p.add_argument("--num-experts", type=int, default=s.num_experts)
    p.add_argument("--top-k", type=int, default=s.top_k)
    p.add_argument("--layers", type=int, default=s.layers)
    p.add_argument("--vocab-size", type=int, default=s.vocab_size)
    p.add_argument("--heads", type=int, default=s.heads)
    p.add_argument(
        "--world-size",
        type=int,
        default=d.world_size,
        help="ranks (EP = FSDP size); 1: one device, transformers' experts implementations vs mixmoe",
    )
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument(
        "--implementations",
        default="",
        help=f"comma list, some of {IMPLEMENTATIONS} (all_to_all is the baseline); on one "
        f"device some of {EXPERTS_IMPLEMENTATIONS} (eager is the baseline) (default: all on "
        f"ranks; {','.join(EXPERTS_DEFAULT)} on one device)",
    )
    p.add_argument("--routing", default=",".join(d.routings), help=f"comma list of {ROUTINGS}")
    p.add_argument("--hot-expert", type=int, default=d.hot_expert, help="skewed: the hot expert")
    p.add_argument(
        "--hot-bias", type=float, default=d.hot_bias, help="skewed: its router logit bias"
    )
    p.add_argument("--steps", type=int, default=d.steps, help="measured steps")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (not measured)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    p.add_argument(
        "--threads", type=int, default=d.threads, help="torch threads per rank (0: leave)"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--device",
        default=d.device,
        help="one device only (--world-size 1): cpu or cuda (CUDA-event timing)",
    )
    p.add_argument(
        "--dtype",
        default=d.dtype,
        choices=("float32", "bf16"),
        help="one device only: the model's dtype (bf16 takes mixmoe's grouped-GEMM path on Hopper)",
    )
    p.add_argument(
        "--profile",
        default=d.profile,
        help="hardware profile the mixmoe_* planners use: a preset (cpu, gpu, h100-nvlink, ...) "
        "or the JSON of `mixmoe calibrate` ('' for the device's default)",
    )
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--jsonl", default=None, help="append the records (with the environment) here")


def run(args: argparse.Namespace) -> int:
    shape = HFModelShape(
        family=args.family,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        layers=args.layers,
        vocab_size=args.vocab_size,
        heads=args.heads,
    )
    cfg = HFBenchConfig(
        shape=shape,
        world_size=args.world_size,
        batch=args.batch,
        seq_len=args.seq_len,
        implementations=_names(args.implementations)
        or (EXPERTS_DEFAULT if args.world_size == 1 else IMPLEMENTATIONS),
        routings=_names(args.routing),
        hot_expert=args.hot_expert,
        hot_bias=args.hot_bias,
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        threads=args.threads,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        profile=args.profile,
    )
    records = run_hf_bench(cfg)
    if records is None:  # a torchrun rank other than 0
        return 0
    print(
        f"{shape.family}: hidden {shape.hidden_size}, intermediate {shape.intermediate_size}, "
        f"{shape.num_experts} experts, top-{shape.top_k}, {shape.layers} layers; "
        + (
            f"one device ({cfg.device}, {cfg.dtype}; experts implementations)"
            if cfg.world_size == 1
            else f"{cfg.world_size} ranks (FSDP x EP)"
        )
        + f", {cfg.batch} x {cfg.seq_len} tokens per rank; "
        f"train step (fwd+bwd+AdamW), median of {cfg.steps} after {cfg.warmup} warm-up, "
        f"{cfg.threads} thread(s) per rank"
        + (f"; mixmoe planners on profile {cfg.profile}" if cfg.profile else "")
    )
    single = cfg.world_size == 1
    pct = any("pct_balanced" in r for r in records)
    rows = [
        (
            r["routing"],
            r["implementation"],
            f"{r['median_ms']:.1f}",
            f"{r['min_ms']:.1f}",
            f"{r['ratio']:.3f}x",
            *([f"{100 * r['pct_balanced']:.1f}%" if "pct_balanced" in r else "-"] if pct else []),
            *([f"{r['vs_fastest_hf']:.3f}x"] if single else []),
            f"{r['hot_share']:.2f}",
            f"{r['replicas_per_step']:.1f}",
        )
        for r in records
    ]
    headers = [
        "routing",
        "implementation",
        "median ms",
        "min ms",
        f"vs {cfg.baseline}",
        *(["% of balanced"] if pct else []),
        *(["vs fastest hf"] if single else []),
        "hot share",
        "replicas/step",
    ]
    bound = next((r["balance_bound"] for r in records if r.get("balance_bound")), None)
    if bound is not None:
        # the last skewed row is followed by the bound, in the ratio column
        last = max(i for i, r in enumerate(records) if r["routing"] == "skewed")
        cells = ["skewed", "balanced bound*", "", "", f"{bound:.3f}x", *([""] * pct), "", ""]
        rows.insert(last + 1, tuple(cells))
    print(render_table(headers, rows, markdown=args.markdown))
    if bound is not None:
        print(
            f"* balanced bound = {BASELINE} uniform / {BASELINE} skewed step = {bound:.3f}x: "
            "the skewed ratio that perfect balancing at zero cost would reach (only the router "
            "differs between the two runs); % of balanced = "
            f"{BASELINE} uniform step / the row's step"
        )
    if args.jsonl:
        config = asdict(cfg)
        append_jsonl(args.jsonl, "bench_hf", config, torch.device(records[0]["device"]), records)
        print(f"JSONL appended to {args.jsonl}")
    return 0
