"""``mixmoe bench planner``: what planning the mixed strategy costs next to the step it plans.

For every (routing, W x N) case: today's planner and the restructured one on the same counts
tensor, timed on one CPU thread, with the predicted mix step, the planner / step ratio, the
issue-15 target and both planners' predicted mix / a2a. Output: a text or Markdown table, and
one JSONL record per case with the configuration and the environment. The engine is
``mixmoe.bench.planner``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

import torch

from mixmoe.bench.planner import LAYOUTS, PlannerBenchConfig, run_case
from mixmoe.commands.options import add_jsonl
from mixmoe.formats.results import append_jsonl
from mixmoe.report.text_table import render_table
from mixmoe.validation import DTYPE_NAMES

__all__ = ["add_arguments", "config_from_args", "parse_cases", "run", "table_rows"]


def parse_cases(text: str) -> tuple[tuple[int, int], ...]:
    """``8x64,1024x4096`` -> ((8, 64), (1024, 4096))."""
    cases = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        W, sep, N = item.lower().partition("x")
        if not sep or not W.isdigit() or not N.isdigit():
            # argparse shows an ArgumentTypeError's message (a ValueError's only as "invalid")
            raise argparse.ArgumentTypeError(
                f"case {item!r} is not understood; write WxN, e.g. 64x512"
            )
        cases.append((int(W), int(N)))
    return tuple(cases)


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = PlannerBenchConfig()
    p.add_argument(
        "--cases",
        type=parse_cases,
        default=d.cases,
        help="comma list of WxN (ranks x experts) (default: 8x64,64x512,256x2048,1024x4096)",
    )
    p.add_argument(
        "--routing",
        type=_words,
        default=d.routings,
        help="comma list of uniform, zipf:S, hot:P (default: uniform,zipf:1.2,hot:0.3)",
    )
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    p.add_argument("--model-dim", type=int, default=d.model_dim, help="D")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size, help="F")
    p.add_argument("--dtype", default=d.dtype, choices=list(DTYPE_NAMES), help="wire dtype")
    p.add_argument(
        "--profile",
        default=d.profile,
        help="cost model hardware profile: a preset (gpu, cpu, h100-nvlink, ...) or the JSON of "
        "`mixmoe calibrate`",
    )
    p.add_argument("--max-replicas", type=int, default=d.max_replicas, help="replicas per rank")
    p.add_argument(
        "--search-width",
        type=int,
        default=d.search_width,
        help="candidates the new planner evaluates per round",
    )
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed calls (median)")
    p.add_argument(
        "--old-repeats", type=int, default=d.old_repeats, help="timed calls of today's planner"
    )
    p.add_argument(
        "--old-max-world",
        type=int,
        default=d.old_max_world,
        help="run today's planner only up to this many ranks (0: never)",
    )
    p.add_argument(
        "--contiguous-experts",
        action="store_true",
        help="hottest experts first (all on rank 0) instead of a shuffled popularity order",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the counts")
    p.add_argument(
        "--warm",
        action="store_true",
        help="time with warm caches (C read from the cache the call before filled) instead of "
        "flushing C from the caches before each timed call, as it arrives from the device",
    )
    p.add_argument(
        "--layout",
        default=d.layout,
        choices=list(LAYOUTS),
        help="C's storage: by columns, as the mixed strategy's count exchange brings it, or "
        "row-major",
    )
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    add_jsonl(p, "runs/bench-planner.jsonl", "one record per case")


def config_from_args(args: argparse.Namespace) -> PlannerBenchConfig:
    return PlannerBenchConfig(
        cases=args.cases,
        routings=args.routing,
        tokens=args.tokens,
        top_k=args.top_k,
        model_dim=args.model_dim,
        hidden_size=args.hidden_size,
        dtype=args.dtype,
        profile=args.profile,
        max_replicas=args.max_replicas,
        search_width=args.search_width,
        repeats=args.repeats,
        old_repeats=args.old_repeats,
        old_max_world=args.old_max_world,
        shuffle_experts=not args.contiguous_experts,
        seed=args.seed,
        cold=not args.warm,
        layout=args.layout,
        jsonl=args.jsonl or None,
    )


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table_rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = [
        "routing",
        "W",
        "N",
        "planner ms",
        "mix step ms",
        "planner/step",
        "target ms",
        "ok",
        "sums ms",
        "planner, sums given ms",
        "ok given",
        "bookkeeping ms",
        "thread ms",
        "thread, device sums ms",
        "overlap ms",
        "exposed ms",
        "fit ms",
        "ahead exposed ms",
        "ahead thread ms",
        "ahead thread, busy caller ms",
        "ahead layers",
        "fit/fresh step",
        "today ms",
        "mix/a2a",
        "today mix/a2a",
        "hot",
        "today hot",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                r["routing"],
                str(r["world_size"]),
                str(r["num_experts"]),
                _num(r["planner_ms"], ".3f"),
                _num(r["step_ms"], ".2f"),
                _num(r["planner_over_step"] and 100 * r["planner_over_step"], ".1f") + "%",
                _num(r["target_ms"], ".2f"),
                "yes" if r["meets_target"] else "NO",
                _num(r["sums_ms"], ".3f"),
                _num(r["planner_given_ms"], ".3f"),
                "yes" if r["meets_target_given"] else "NO",
                _num(r["bookkeeping_ms"], ".3f"),
                _num(r["host_ms"], ".3f"),
                _num(r["host_device_sums_ms"], ".3f"),
                _num(r["overlap_ms"], ".3f"),
                _num(r["exposed_ms"], ".3f"),
                _num(r["fit_ms"], ".3f"),
                _num(r["ahead_exposed_ms"], ".3f"),
                _num(r["ahead_thread_ms"], ".3f"),
                _num(r["ahead_thread_busy_ms"], ".3f"),
                _num(r["ahead_layers"], "d"),
                _num(r["fit_over_fresh_step"], ".3f"),
                _num(r["old_planner_ms"], ".1f"),
                _num(r["mix_over_a2a"], ".3f"),
                _num(r["old_mix_over_a2a"], ".3f"),
                str(r["hot"]),
                _num(r["old_hot"], "d"),
            ]
        )
    return headers, rows


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    jobs = [(routing, W, N) for routing in cfg.routings for W, N in cfg.cases]
    print(
        f"bench planner: D={cfg.model_dim} F={cfg.hidden_size} {cfg.dtype}, {cfg.tokens} tokens "
        f"per rank, top-{cfg.top_k}, profile {cfg.profile}, max_replicas {cfg.max_replicas}, "
        f"search width {cfg.search_width}; one CPU thread, median of {cfg.repeats} calls "
        f"(today's planner: {cfg.old_repeats}), "
        + ("counts flushed from the caches before each call" if cfg.cold else "warm caches"),
        file=sys.stderr,
    )
    from mixmoe.placement import native_lib  # the library is built here, before any timing

    how = "compiled" if native_lib.available() else f"Python ({native_lib.unavailable_reason()})"
    print(f"  level fill: {how}", file=sys.stderr)
    records = []
    for i, (routing, W, N) in enumerate(jobs):
        print(
            f"\r  case {i + 1}/{len(jobs)}: {routing} {W}x{N}   ",
            end="",
            file=sys.stderr,
            flush=True,
        )
        records.append(run_case(cfg, routing, W, N))
    print(file=sys.stderr)
    headers, rows = table_rows(records)
    print(render_table(headers, rows, markdown=args.markdown))
    if cfg.jsonl:
        append_jsonl(cfg.jsonl, "bench_planner", asdict(cfg), torch.device("cpu"), records)
        print(f"JSONL appended to {cfg.jsonl}", file=sys.stderr)
    return 0
