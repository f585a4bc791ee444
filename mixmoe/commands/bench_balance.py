"""``mixmoe bench balance``: the imbalance workloads (uniform, zipf, hot experts, a hot expert
set, a hot rank, idle ranks, a rotating hotspot) for a2a / shadow / mix at several W and two layer
shapes, by the planners' own cost model (nothing is measured but the planning time).

Per case: the predicted step, % of force-balanced (``a2a`` under uniform routing / the step),
rank imbalance after the plan (max / mean rows computed, and max / mean predicted seconds per
rank), replica bytes moved per step, the planning time (median, one CPU thread). Output: a text or Markdown table, one summary line per
strategy (average and worst % of force-balanced, each case capped at 100%), the cases where
``mix`` is predicted slower than ``a2a`` or ``shadow``, one JSONL record per case with the
environment, and one PNG. The engine is ``mixmoe.simulate.workloads``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import Any

from mixmoe.commands.options import add_jsonl
from mixmoe.report.text_table import render_table
from mixmoe.simulate.workloads import SHAPES, BalanceConfig, shape_spec

__all__ = ["add_arguments", "config_from_args", "run", "summary_lines", "table_rows"]


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of integers, e.g. 8,64,256"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BalanceConfig()
    p.add_argument(
        "--workloads",
        type=_words,
        default=d.workloads,
        help="comma list of uniform, zipf:S, hot:P, hotset:H:P (H experts share P of the rows), "
        "hotrank:P (one rank's experts share P), idle:F (a fraction F of ranks route nothing), "
        "rotate:H:P[:S] (a hot set of H moving every step, S steps) (default: "
        + ",".join(d.workloads)
        + ")",
    )
    p.add_argument(
        "--world-sizes", type=_ints, default=d.worlds, help="comma list of W (default: 8,64,256)"
    )
    p.add_argument(
        "--shapes",
        type=_words,
        default=d.shapes,
        help="comma list of layer shapes: "
        + "; ".join(s.describe() for s in SHAPES.values())
        + " (default: seeds,deepseek)",
    )
    p.add_argument(
        "--strategies", type=_words, default=d.strategies, help="default: a2a,shadow,mix"
    )
    p.add_argument(
        "--profile",
        default=None,
        help="a preset or the JSON of `mixmoe calibrate` for every W (default: h100-nvlink at "
        "W <= 8, h100-ib above)",
    )
    p.add_argument(
        "--experts-per-rank",
        type=int,
        default=None,
        help="override every shape's experts: E per rank, N = E x W (e.g. 16 at W=256: 4096 "
        "experts; default: each shape's own)",
    )
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank")
    p.add_argument("--max-replicas", type=int, default=d.max_replicas, help="mix: slots per rank")
    p.add_argument(
        "--repeats", type=int, default=d.repeats, help="timed planner calls per step (median)"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the count matrices")
    p.add_argument(
        "--ahead",
        action="store_true",
        help="add mix-ahead: each step planned from the step before's counts, fitted to its own "
        "(placement.refit; the step before a one-step workload: a fresh draw of its popularity)",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="time the planners with warm caches (the counts read from the cache the call "
        "before filled) instead of flushing the counts before each call",
    )
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    add_jsonl(p, "runs/bench-balance.jsonl", "one record per case")
    p.add_argument("--png", default="runs/bench-balance.png", help="the plot here ('' for none)")


def config_from_args(args: argparse.Namespace) -> BalanceConfig:
    shapes: tuple = args.shapes
    if args.experts_per_rank is not None:
        from dataclasses import replace

        from mixmoe.validation import check_int

        check_int("--experts-per-rank", args.experts_per_rank, 1)
        E = args.experts_per_rank
        shapes = tuple(
            replace(shape_spec(s), name=f"{s}-E{E}", experts_per_rank=E, experts=None)
            for s in args.shapes
        )
    return BalanceConfig(
        shapes=shapes,
        worlds=args.world_sizes,
        workloads=args.workloads,
        strategies=args.strategies,
        tokens=args.tokens,
        max_replicas=args.max_replicas,
        repeats=args.repeats,
        seed=args.seed,
        profile=args.profile,
        ahead=args.ahead,
        cold=not args.warm,
    )


def table_rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["shape", "W", "profile", "workload", "strategy", "step ms", "% of balanced",
               "imbalance", "time imb.", "replica MB", "replicas", "plan ms",
               "% with plan"]  # fmt: skip
    rows = [
        [
            r["shape"],
            str(r["world_size"]),
            r["profile"],
            r["workload"],
            r["strategy"],
            f"{r['step_ms']:.2f}",
            f"{100 * r['pct_balanced']:.1f}%",
            f"{r['imbalance']:.2f}",
            f"{r['time_imbalance']:.2f}",
            f"{r['replica_bytes'] / 1e6:.1f}",
            f"{r['replicas']:g}",
            f"{r['planning_ms']:.3f}",
            f"{100 * r['pct_with_planning']:.1f}%",
        ]
        for r in records
    ]
    return headers, rows


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for name, s in summary["strategies"].items():
        lines.append(
            f"{name}: {100 * s['mean_pct_balanced']:.1f}% of force-balanced on average, worst "
            f"{100 * s['worst_pct_balanced']:.1f}% ({s['worst_case']}), over {s['cases']} cases "
            f"(each capped at 100%); max imbalance {s['max_imbalance']:.2f} (rows), "
            f"{s['max_time_imbalance']:.2f} (seconds); slowest planning "
            f"{s['max_planning_ms']:.3f} ms"
        )
        if "mean_pct_with_planning" in s:
            lines.append(
                f"  with the planning time on the step (this CPU, one thread): "
                f"{100 * s['mean_pct_with_planning']:.1f}% on average, worst "
                f"{100 * s['worst_pct_with_planning']:.1f}% ({s['worst_case_with_planning']})"
            )
    slower = summary["mix_slower"]
    if "mix" in summary["strategies"]:
        lines.append(f"mix predicted slower than a2a or shadow in {len(slower)} cases" +
                     (":" if slower else ""))  # fmt: skip
        lines += [
            f"  {c['case']}: mix {c['mix_ms']:.2f} ms > {c['than']} {c['other_ms']:.2f} ms"
            for c in slower
        ]
    return lines


def run(args: argparse.Namespace) -> int:
    from mixmoe.simulate.workloads import case_records, summarize

    cfg = config_from_args(args)
    jobs = [(s, W, w) for s in cfg.shapes for W in cfg.worlds for w in cfg.workloads]
    print(
        f"bench balance: predicted by the planners' cost model; {cfg.tokens} tokens per rank, "
        f"max_replicas {cfg.max_replicas}, seed {cfg.seed}; planning: median of {cfg.repeats} "
        "calls per step on one CPU thread, "
        + ("the counts flushed from the caches before each" if cfg.cold else "warm caches"),
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    records = []
    for i, (shape, W, workload) in enumerate(jobs):
        print(f"\r  case {i + 1}/{len(jobs)}: {shape} W={W} {workload}        ", end="",
              file=sys.stderr, flush=True)  # fmt: skip
        records += case_records(cfg, shape, W, workload)
    print(file=sys.stderr)
    for shape in cfg.shapes:
        print(shape_spec(shape).describe())
    headers, rows = table_rows(records)
    print(render_table(headers, rows, markdown=args.markdown))
    summary = summarize(records)
    print()
    for line in summary_lines(summary):
        print(line)
    if args.jsonl:
        import torch

        from mixmoe.formats.results import append_jsonl

        config = asdict(cfg)
        config["shapes"] = [asdict(shape_spec(s)) for s in cfg.shapes]
        append_jsonl(args.jsonl, "bench_balance", config, torch.device("cpu"), records)
        print(f"JSONL appended to {args.jsonl}")
    if args.png:
        from mixmoe.simulate.plots import plot_balance

        print(f"plot: {plot_balance(records, args.png)}")
    print(f"ran in {time.perf_counter() - t0:.1f} s")
    return 0
