"""``mixmoe bench layer``: time one MoE layer per strategy on identical inputs.

Writes, per strategy, the docs/formats.md section 1 log (system name ``mixmoe-<strategy>``) to
stdout, a progress bar to stderr, then one comparison table of medians and a JSONL record per
strategy (config, environment, per-step times). The engine is ``mixmoe.bench.layer``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from mixmoe.bench.layer import (
    BALANCED,
    LayerBenchConfig,
    StrategyResult,
    jsonl_records,
    run_rank,
    summary_rows,
    write_logs,
)
from mixmoe.commands.options import add_device, add_jsonl, world_size
from mixmoe.formats.results import append_jsonl
from mixmoe.report.text_table import render_table
from mixmoe.validation import DTYPE_NAMES

# --plan: (MoEConfig.plan_async, MoEConfig.plan_ahead)
PLAN_MODES = {"auto": (None, False), "async": (True, False), "sync": (False, False),
              "ahead": (None, True)}  # fmt: skip
BALANCED_MODES = ("auto", "on", "off")

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LayerBenchConfig()
    p.add_argument("--model-dim", type=int, default=d.model_dim, help="D, the model dimension")
    p.add_argument(
        "--hidden-size", type=int, default=d.hidden_size, help="F, the expert hidden size"
    )
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank (samples)")
    p.add_argument(
        "--num-local-experts", type=int, default=d.num_local_experts, help="experts per rank"
    )
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    p.add_argument(
        "--dtype", default=d.dtype, choices=list(DTYPE_NAMES), help="parameter and input dtype"
    )
    add_device(p, d.device, "every rank's layer")
    p.add_argument("--steps", type=int, default=d.steps, help="measured steps")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (not measured)")
    p.add_argument("--routing", default=d.routing, help="gate | uniform | zipf:S | hot:P")
    p.add_argument(
        "--strategy",
        default=None,
        help="comma list of local, a2a, shadow, mix (default: local, or mix,a2a,shadow with >1 rank)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks; on CPU spawns gloo processes (default: torchrun's WORLD_SIZE or 1)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: leave as is)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of parameters and inputs")
    add_jsonl(p, "runs/bench-layer.jsonl", "one record per strategy")
    p.add_argument(
        "--profile",
        default="",
        help="hardware profile for the planners: a preset (cpu, gpu, h100-nvlink, ...) or the "
        "JSON of `mixmoe calibrate` ('' for the device's default)",
    )
    p.add_argument(
        "--plan",
        choices=tuple(PLAN_MODES),
        default="auto",
        help="mix: where the plan is made (MoEConfig.plan_async): 'async' on a background thread "
        "while the own rows compute, 'sync' on the caller before them, 'auto' async on CUDA "
        "only; 'ahead': from the step before's counts on the background thread, fitted to the "
        "step's (MoEConfig.plan_ahead) (default: auto)",
    )
    p.add_argument(
        "--balanced",
        choices=BALANCED_MODES,
        default="auto",
        help="also time a2a under uniform routing in the same run (the force-balanced bound) and "
        "report every strategy's %% of balanced = that step / its step; 'auto': on with more "
        "than one rank (default: auto)",
    )
    p.add_argument(
        "--save-counts",
        default="",
        help="write the first forward's count matrix [W][N] here (for `mixmoe simulate "
        "--routing counts:PATH`; '' for none)",
    )
    p.add_argument(
        "--trace",
        default="",
        help="write every rank's CMD trace of the timed steps to DIR/trace_rank{R}.txt (the "
        "count exchanges carry per-expert counts: `mixmoe simulate --routing trace:DIR`; '' "
        "for none)",
    )


def config_from_args(args: argparse.Namespace) -> LayerBenchConfig:
    world = world_size(args.world_size)
    default = "local" if world == 1 else "mix,a2a,shadow"
    strategies = tuple(s.strip() for s in (args.strategy or default).split(",") if s.strip())
    return LayerBenchConfig(
        model_dim=args.model_dim,
        hidden_size=args.hidden_size,
        tokens=args.tokens,
        num_local_experts=args.num_local_experts,
        top_k=args.top_k,
        dtype=args.dtype,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        routing=args.routing,
        strategies=strategies,
        world_size=world,
        threads=args.threads,
        seed=args.seed,
        jsonl=args.jsonl or None,
        profile=args.profile,
        plan_async=PLAN_MODES[args.plan][0],
        plan_ahead=PLAN_MODES[args.plan][1],
        trace=args.trace,
        balanced=args.balanced == "on" or (args.balanced == "auto" and world > 1),
    )


def report(cfg: LayerBenchConfig, results: list[StrategyResult], save_counts: str = "") -> None:
    """Logs, the table of medians and the JSONL records of one benchmark."""
    write_logs(cfg, results)
    print(f"routing = {cfg.routing}; medians over {cfg.steps} steps after {cfg.warmup} warm-up")
    if cfg.balanced:
        print(
            f"balanced bound: {BALANCED} = a2a under uniform routing, timed in the same run; "
            "pct_balanced = its median step / the strategy's"
        )
    rows = summary_rows(cfg, results)
    headers = list(dict.fromkeys(k for row in rows for k in row))
    cells = [
        [f"{v:.3f}" if isinstance(v, float) else v for v in (row.get(k) for k in headers)]
        for row in rows
    ]
    print(render_table(headers, cells))
    if cfg.trace:
        print(f"traces written to {cfg.trace}/trace_rank{{0..{cfg.world_size - 1}}}.txt")
    if save_counts and results and results[0].counts_WN is not None:
        from mixmoe.formats.counts import write_counts

        out = write_counts(
            save_counts,
            [results[0].counts_WN],
            source="mixmoe bench layer, first forward",
            config=asdict(cfg),
        )
        print(f"counts written to {out}")
    if cfg.jsonl:
        import torch

        append_jsonl(
            cfg.jsonl,
            "bench_layer",
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
    if cfg.world_size > 1:
        from mixmoe.bench.multiprocess import run_distributed

        results = run_distributed(cfg)
        if results is not None:
            report(cfg, results, args.save_counts)
        return 0
    report(cfg, run_rank(cfg), args.save_counts)
    return 0
