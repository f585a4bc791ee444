"""``mixmoe bench kernels``: the expert MLP of one MoE layer on four grouped-GEMM providers.

A sweep over (dtype, experts, rows per expert, skew); per point every provider is checked, then
timed (engine: ``mixmoe.bench.kernels``; providers: ``mixmoe.bench.kernel_providers``).
Output: a table of ms and TFLOP/s, and with ``--jsonl PATH`` one record per (point, provider)
with the configuration and the environment. Exit status 1 if a provider computed a wrong result.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from typing import Any

import torch

from mixmoe.bench.kernel_providers import PROVIDERS
from mixmoe.bench.kernels import (
    CPU_DEFAULTS,
    GPU_DEFAULTS,
    MODES,
    KernelBenchConfig,
    Point,
    run_point,
)
from mixmoe.commands.options import add_device, add_jsonl
from mixmoe.config import ACTIVATIONS
from mixmoe.formats.results import append_jsonl
from mixmoe.report.text_table import render_table

__all__ = ["add_arguments", "config_from_args", "run", "table_rows"]


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def word_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--providers",
        type=word_list,
        default=PROVIDERS,
        help=f"comma list of {', '.join(PROVIDERS)} (default: all)",
    )
    p.add_argument(
        "--rows-per-expert",
        type=int_list,
        default=None,
        help="comma list, mean routed rows per expert (default GPU: 64..8192; CPU: 64,256)",
    )
    p.add_argument(
        "--experts", type=int_list, default=None, help="comma list (default GPU: 4,16,64; CPU: 4,8)"
    )
    p.add_argument(
        "--skew",
        type=word_list,
        default=None,
        help="comma list of uniform, zipf:S, hot:P (default: uniform,zipf:1.2,hot:0.5)",
    )
    p.add_argument(
        "--dtype",
        type=word_list,
        default=None,
        help="comma list of bf16, fp16, fp32 (default GPU: bf16; CPU: fp32)",
    )
    p.add_argument("--model-dim", type=int, default=None, help="D (default GPU: 1024; CPU: 128)")
    p.add_argument("--hidden-size", type=int, default=None, help="F (default GPU: 4096; CPU: 256)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--activation", default="gelu", choices=ACTIVATIONS, help="expert activation")
    p.add_argument("--block-size", type=int, default=64, help="rows per block of the schedule")
    p.add_argument(
        "--mode", type=word_list, default=MODES, help="comma list of fwd, fwd+bwd (default: both)"
    )
    add_device(p, None, "the kernels (default: cuda if available)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed runs per provider (default GPU 5, CPU 2)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed runs per provider (default GPU 20, CPU 5)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of routing, weights and inputs")
    add_jsonl(p, None, "one record per (point, provider)")


def config_from_args(args: argparse.Namespace) -> KernelBenchConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows, experts, skews, dtypes, D, Fh, warmup, repeats = (
        GPU_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS
    )
    return KernelBenchConfig(
        rows_per_expert=args.rows_per_expert or rows,
        experts=args.experts or experts,
        skews=args.skew or skews,
        dtypes=args.dtype or dtypes,
        model_dim=args.model_dim or D,
        hidden_size=args.hidden_size or Fh,
        top_k=args.top_k,
        activation=args.activation,
        block_size=args.block_size,
        modes=args.mode,
        providers=args.providers,
        device=device,
        warmup=warmup if args.warmup is None else args.warmup,
        repeats=repeats if args.repeats is None else args.repeats,
        seed=args.seed,
        jsonl=args.jsonl,
    )


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per timed or failed (point, mode, provider); skipped providers are listed apart."""

    def key(r):
        return (r["mode"], r["dtype"], r["experts"], r["rows_per_expert"], r["skew"])

    dense_ms = {key(r): r["ms"] for r in records if r["provider"] == "dense" and "ms" in r}
    rows = []
    for r in records:
        if "skipped" in r:
            continue
        ms = r.get("ms")
        rows.append(
            {
                "mode": r["mode"],
                "dtype": r["dtype"],
                "E": r["experts"],
                "rows/E": r["rows_per_expert"],
                "skew": r["skew"],
                "max rows/E": r["max_rows_per_expert"],
                "provider": r["provider"],
                "ms": ms if ms is not None else "-",
                "TFLOP/s": r["tflops"] if ms is not None else "-",
                "% of dense": 100 * dense_ms[key(r)] / ms if ms and key(r) in dense_ms else "-",
                "check": "ok" if r.get("correct") else f"WRONG (err {r['max_abs_err']:.2g})",
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    points = [
        Point(d, e, r, s)
        for d, e, r, s in itertools.product(cfg.dtypes, cfg.experts, cfg.rows_per_expert, cfg.skews)
    ]
    print(
        f"bench kernels on {cfg.device}: D={cfg.model_dim} F={cfg.hidden_size} top-{cfg.top_k} "
        f"{cfg.activation}, block {cfg.block_size}; {len(points)} points x {len(cfg.providers)} "
        f"providers; median of {cfg.repeats} after {cfg.warmup} warm-up",
        file=sys.stderr,
    )
    records = []
    for i, point in enumerate(points):
        print(f"\r  point {i + 1}/{len(points)}", end="", file=sys.stderr, flush=True)
        records.extend(run_point(cfg, point))
    print(file=sys.stderr)
    records.sort(key=lambda r: cfg.modes.index(r["mode"]))  # stable: one table block per mode
    reasons = {r["provider"]: r["skipped"] for r in records if "skipped" in r}
    for provider, why in reasons.items():
        print(f"{provider} skipped: {why}")
    rows = table_rows(records)
    if rows:
        headers = list(rows[0])
        cells = [[f"{v:.3f}" if isinstance(v, float) else v for v in r.values()] for r in rows]
        print(render_table(headers, cells))
    else:
        print("nothing was timed")
    if cfg.jsonl:
        append_jsonl(cfg.jsonl, "bench_kernels", asdict(cfg), torch.device(cfg.device), records)
        print(f"JSONL appended to {cfg.jsonl}")
    wrong = [r for r in records if r.get("correct") is False]
    for r in wrong:
        point = Point(r["dtype"], r["experts"], r["rows_per_expert"], r["skew"])
        print(
            f"WRONG: {r['provider']} ({r['mode']}) at {point}: max abs error "
            f"{r['max_abs_err']:.3g}",
            file=sys.stderr,
        )
    return 1 if wrong else 0
