"""``mixmoe simulate``: predict a2a / shadow / mix for a layer shape, a routing and a profile.

Per strategy: the predicted forward / backward / step time, the bottleneck rank's compute, token
and replica communication and what overlap hides, the replicas the planner would choose and the
speedup over a2a; ``--per-rank`` adds one row per rank. ``--vs-world`` / ``--vs-routing`` sweep W
or the routing (table and ``--sweep-png``); ``--layers`` etc. add the model-level step
(``mixmoe.simulate.model``). ``--replay TRACE`` replays one rank of a CMD trace under
``--profile`` (``--replay-strategy``: and under each strategy, from the one ``--routing`` source's
count matrices; ``mixmoe.simulate.replay``). ``--validate FILE`` compares the simulator with stored ``bench
layer`` measurements (``--remeasure`` regenerates them on this machine first). The engine is
``mixmoe.simulate``; every second comes from the planner's cost model.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from mixmoe.commands.options import add_jsonl
from mixmoe.report.text_table import render_table

__all__ = ["add_arguments", "run"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of integers, e.g. 8,64,1024"
        ) from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dim", type=int, default=1024, help="D")
    p.add_argument("--hidden-size", type=int, default=4096, help="F, the expert hidden size")
    p.add_argument("--experts-per-rank", type=int, default=None, help="E (or give --experts)")
    p.add_argument(
        "--experts", type=int, default=None, help="N experts in all (a multiple of W; default 4 W)"
    )
    p.add_argument("--world-size", type=int, default=4, help="W, ranks in the EP group")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument(
        "--dtype", default="fp16", choices=["fp32", "fp16", "bf16"], help="wire / weight dtype"
    )
    p.add_argument("--swiglu", action="store_true", help="3-GEMM SwiGLU experts (default 2-GEMM)")
    p.add_argument(
        "--routing",
        type=_words,
        default=("uniform", "zipf:1.2", "hot:0.4"),
        help="comma list of uniform, zipf:S, hot:P, counts:PATH (bench layer --save-counts), "
        "trace:PATH (a trace file or the directory of bench layer --trace)",
    )
    p.add_argument(
        "--profile",
        default="h100-nvlink",
        help="preset (cpu, gpu, h100-nvlink, a100-nvlink, h100-pcie, a100-pcie, h100-ib, a100-ib,"
        " h100-nvlink-ib, a100-nvlink-ib,"
        " v100-pcie, v100-nvlink) or the JSON of `mixmoe calibrate`",
    )
    p.add_argument(
        "--strategy",
        type=_words,
        default=(),
        help="strategies (default a2a,shadow,mix; local at --world-size 1: one device, no "
        "communication)",
    )
    p.add_argument("--max-replicas", type=int, default=4, help="mix: replica slots per rank")
    p.add_argument(
        "--contiguous-experts",
        action="store_true",
        help="hottest experts all on rank 0 (as bench layer's synthetic ids) instead of shuffled",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic counts")
    p.add_argument("--fixed-ms", type=float, default=0.0, help="placement-free ms added per step")
    p.add_argument("--per-rank", action="store_true", help="also print one row per rank")
    p.add_argument(
        "--shared-processors",
        action="store_true",
        help="ranks share saturated cores (gloo ranks on a busy CPU host): step = mean over "
        "ranks, not max",
    )
    p.add_argument(
        "--processors",
        type=int,
        default=None,
        help="ranks share this many cores (gloo ranks on a CPU host with fewer cores than "
        "ranks): processor sharing, a rank that waits gives its core to the others; also adds "
        "its figures to --validate (records that store their calibration runs re-fitted under "
        "it) and is given to --remeasure's calibration",
    )
    p.add_argument("--vs-world", type=_ints, default=(), help="sweep W (comma list)")
    p.add_argument("--vs-routing", type=_words, default=(), help="sweep the routing (comma list)")
    p.add_argument("--png", default="", help="per-rank stacked bars of the first routing here")
    p.add_argument("--sweep-png", default="", help="step vs the swept quantity here")
    p.add_argument("--layers", type=int, default=0, help="model level: MoE layers (0: off)")
    p.add_argument("--dense-params", type=int, default=0, help="model level: dense parameters")
    p.add_argument("--pipeline-stages", type=int, default=1, help="model level: stages P")
    p.add_argument("--microbatches", type=int, default=1, help="model level: micro-batches M")
    p.add_argument("--dp", type=int, default=1, help="model level: data-parallel replicas")
    p.add_argument("--edp", type=int, default=1, help="model level: expert-data-parallel")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables")
    add_jsonl(p, "", "one record per prediction")
    p.add_argument(
        "--validate",
        default="",
        help="compare with the bench layer measurements stored in this JSONL file",
    )
    p.add_argument(
        "--replay",
        default="",
        help="replay this CMD trace with its MoE all_to_alls re-predicted under --profile "
        "(and under --replay-strategy)",
    )
    p.add_argument(
        "--replay-strategy",
        type=_words,
        default=(),
        help="--replay: also re-predict the MoE communication under these strategies (comma "
        "list of a2a, shadow, mix) from the count matrices of the one --routing source "
        "(trace:PATH or counts:FILE) and the layer shape flags (--world-size is the EP group)",
    )
    p.add_argument(
        "--ep-size", type=int, default=2, help="--replay (profile only): expert-parallel group size"
    )
    p.add_argument(
        "--trace-rank", type=int, default=None, help="--replay: the rank to replay (first)"
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="with --validate: first calibrate and measure on this machine (appends; minutes)",
    )
    p.add_argument(
        "--validate-world",
        type=_ints,
        default=(2, 4),
        help="with --remeasure: the W of the cases to measure (comma list; 1: one device, "
        "bench layer --world-size 1 against the simulator's local step)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="with --remeasure: cpu, or cuda for one-device cases (--validate-world 1)",
    )


def _shape(args: argparse.Namespace, world: int):
    from mixmoe.placement.cost_model import LayerShape

    if args.experts_per_rank is not None and args.experts is not None:
        raise ValueError("give --experts-per-rank or --experts, not both")
    if args.experts is not None:
        if args.experts < 1 or args.experts % world:
            raise ValueError(
                f"--experts {args.experts} is not a positive multiple of --world-size {world}; "
                f"use a multiple of {world}"
            )
        E = args.experts // world
    else:
        E = 4 if args.experts_per_rank is None else args.experts_per_rank
    return LayerShape(
        model_dim=args.model_dim,
        hidden_dim=args.hidden_size,
        experts_per_rank=E,
        world_size=world,
        bytes_per_element=4 if args.dtype == "fp32" else 2,
        gemms_per_expert=3 if args.swiglu else 2,
    )


def _strategies(args: argparse.Namespace, world: int) -> tuple[str, ...]:
    """--strategy, or its default on ``world`` ranks: a2a, shadow, mix; local on one rank."""
    if args.strategy:
        return tuple(args.strategy)
    return ("local",) if world == 1 else ("a2a", "shadow", "mix")


def _counts(args: argparse.Namespace, shape, routing: str):
    """The count matrices of ``routing`` for this shape (the source's per-step list)."""
    from mixmoe.simulate.routing import counts_source

    return counts_source(
        routing,
        shape.world_size,
        shape.num_experts,
        args.tokens,
        args.top_k,
        seed=args.seed,
        contiguous=args.contiguous_experts,
    )


def _mean_preds(args, shape, profile, routing: str):
    """Predictions averaged over the source's steps (per-rank detail of the first step)."""
    from mixmoe.simulate.layer import predict_layer

    steps = _counts(args, shape, routing)
    every = [
        predict_layer(
            C,
            shape,
            profile,
            top_k=args.top_k,
            max_replicas=args.max_replicas,
            strategies=_strategies(args, shape.world_size),
            fixed_s=args.fixed_ms / 1e3,
            shared=args.shared_processors,
            processors=args.processors,
        )
        for C in steps
    ]
    if len(every) == 1:
        return every[0]
    import dataclasses

    return {
        s: dataclasses.replace(
            p,
            step_s=sum(e[s].step_s for e in every) / len(every),
            fwd_s=sum(e[s].fwd_s for e in every) / len(every),
            bwd_s=sum(e[s].bwd_s for e in every) / len(every),
        )
        for s, p in every[0].items()
    }


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.4g}"


def _strategy_rows(routing: str, preds, base: str | None) -> list[list[Any]]:
    rows = []
    for s, p in preds.items():
        b = p.bottleneck
        rows.append(
            [
                routing,
                s,
                _fmt_ms(p.fwd_s),
                _fmt_ms(p.bwd_s),
                _fmt_ms(p.step_s),
                b,
                _fmt_ms(p.compute_W[b]),
                _fmt_ms(p.token_W[b]),
                _fmt_ms(p.weight_W[b]),
                _fmt_ms(p.hidden_W[b]),
                len(p.hot),
                p.replicas,
                f"{preds[base].step_s / p.step_s:.3f}" if base else "-",
            ]
        )
    return rows


HEADERS = [
    "routing",
    "strategy",
    "fwd ms",
    "bwd ms",
    "step ms",
    "bottleneck",
    "compute ms",
    "token ms",
    "replica ms",
    "hidden ms",
    "hot",
    "replicas",
    "vs a2a",
]


def _validate(args: argparse.Namespace) -> int:
    from mixmoe.bench.simulator_runs import measure
    from mixmoe.simulate.agreement import cases_for, compare, read_records, summarize

    if args.remeasure:
        cases = cases_for(args.validate_world, args.device)
        measure(args.validate, cases, processors=args.processors)
    rows = compare(read_records(args.validate), fixed_ms=args.fixed_ms, processors=args.processors)
    headers = [
        "case",
        "strategy",
        "measured ms",
        "predicted ms",
        "error",
        "ratio meas",
        "ratio pred",
        "ratio err pts",
        "shared ms",
        "shared err",
        "shared ratio",
        "shared ratio err",
        "replicas meas/pred",
    ]
    cells = [
        [
            r["case"],
            r["strategy"],
            f"{r['measured_ms']:.2f}",
            f"{r['predicted_ms']:.2f}",
            f"{100 * r['error']:.1f}%",
            f"{r['ratio_measured']:.3f}" if "ratio_measured" in r else "-",
            f"{r['ratio_predicted']:.3f}" if "ratio_predicted" in r else "-",
            f"{r['ratio_error_points']:.1f}" if "ratio_error_points" in r else "-",
            f"{r['predicted_shared_ms']:.2f}",
            f"{100 * r['error_shared']:.1f}%",
            f"{r['ratio_shared']:.3f}" if "ratio_shared" in r else "-",
            f"{r['ratio_error_shared_points']:.1f}" if "ratio_shared" in r else "-",
            f"{r['replicas_measured']}/{r['replicas_predicted']}",
        ]
        for r in rows
    ]
    if args.processors is not None:  # the processor-sharing columns
        headers[-1:-1] = ["ps ms", "ps err", "ps ratio", "ps ratio err"]
        for row, r in zip(cells, rows, strict=True):
            row[-1:-1] = [
                f"{r['predicted_ps_ms']:.2f}",
                f"{100 * r['error_ps']:.1f}%",
                f"{r['ratio_ps']:.3f}" if "ratio_ps" in r else "-",
                f"{r['ratio_error_ps_points']:.1f}" if "ratio_ps" in r else "-",
            ]
    print(render_table(headers, cells, markdown=args.markdown))
    s = summarize(rows)
    print(
        f"\nstep error: median {100 * s['step_error_median']:.1f}%, max "
        f"{100 * s['step_error_max']:.1f}%, {s['within_10pct']}/{s['cases']} within 10%; "
        f"ratio error: median {s['ratio_error_median_points']:.1f} points, max "
        f"{s['ratio_error_max_points']:.1f}, {s['ratios_within_5_points']}/{s['ratios']} within 5; "
        f"replica sets agree in {s['replicas_agree']}/{s['cases']}"
    )
    print(
        f"shared processors (mean over ranks): step error median "
        f"{100 * s['shared_step_error_median']:.1f}%, {s['shared_within_10pct']}/{s['cases']} "
        f"within 10%; ratio error median {s['shared_ratio_error_median_points']:.1f} points, "
        f"{s['shared_ratios_within_5_points']}/{s['ratios']} within 5"
    )
    if args.processors is not None:
        print(
            f"processor sharing ({args.processors} cores): step error median "
            f"{100 * s['ps_step_error_median']:.1f}%, {s['ps_within_10pct']}/{s['cases']} within "
            f"10%; ratio error median {s['ps_ratio_error_median_points']:.1f} points, "
            f"{s['ps_ratios_within_5_points']}/{s['ratios']} within 5; fastest right in "
            f"{s['ps_fastest_agree']}/{s['case_count']}; fixed costs re-fitted under processor "
            f"sharing in {s['ps_refit_cases']}/{s['case_count']} cases (the others keep the "
            "stored profile: their records hold no calibration runs)"
        )
        for W, w in sorted(s["ps_by_world"].items()):
            print(
                f"  W={W}: step error median {100 * w['step']:.1f}% (max over ranks "
                f"{100 * w['step_max']:.1f}%), ratio error median {w['ratio']:.1f} points "
                f"(max over ranks {w['ratio_max']:.1f})"
            )
    print(
        f"fastest strategy predicted = measured in {s['fastest_agree']}/{s['case_count']} cases "
        f"(shared: {s['shared_fastest_agree']}/{s['case_count']}); measured fastest is a2a in "
        f"{s['measured_fastest_a2a']}/{s['case_count']}"
    )
    return 0


def _replay(args: argparse.Namespace) -> int:
    from mixmoe.placement.profile_io import describe, load_profile
    from mixmoe.simulate.replay import replay_trace

    profile = load_profile(args.profile)
    r = replay_trace(args.replay, profile, args.ep_size, args.trace_rank)
    print(f"replay of {args.replay} under {profile.name} ({describe(args.profile)[0]})")
    print(
        render_table(
            ["iteration ms", "MoE a2a measured ms", "MoE a2a predicted ms", "replayed ms",
             "a2a calls", "skipped"],
            [[f"{r.iteration_ms:.3f}", f"{r.a2a_measured_ms:.3f}", f"{r.a2a_predicted_ms:.3f}",
              f"{r.replayed_ms:.3f}", r.a2a_calls, r.skipped]],
            markdown=args.markdown,
        )
    )  # fmt: skip
    if args.replay_strategy:
        _replay_strategies(args, profile)
    return 0


def _replay_strategies(args: argparse.Namespace, profile) -> None:
    from mixmoe.simulate.replay import replay_strategies, token_calls_note
    from mixmoe.validation import check_int

    if len(args.routing) != 1:
        raise ValueError(
            f"--replay-strategy needs one --routing source, got {list(args.routing)}; pass "
            "--routing trace:PATH (the run's traces) or counts:FILE (bench layer --save-counts)"
        )
    for name in ("world_size", "tokens", "top_k", "model_dim", "hidden_size"):
        check_int(f"--{name.replace('_', '-')}", getattr(args, name), 1)
    check_int("--max-replicas", args.max_replicas, 0)
    shape = _shape(args, args.world_size)
    routing = args.routing[0]
    counts = _counts(args, shape, routing)
    results = replay_strategies(
        args.replay,
        counts,
        shape,
        profile,
        top_k=args.top_k,
        max_replicas=args.max_replicas,
        strategies=args.replay_strategy,
        rank=args.trace_rank,
    )
    first = results[0]
    print(
        f"\nrank {first.rank} (group rank {first.rank % shape.world_size}) re-predicted per "
        f"strategy: {first.layer_steps} MoE layer steps (count exchanges), {len(counts)} count "
        f"matrices from {routing}"
        + (" (one matrix for every layer step)" if len(counts) == 1 < first.layer_steps else "")
        + f"; layer D={shape.model_dim} F={shape.hidden_dim} W={shape.world_size} "
        f"E={shape.experts_per_rank} K={args.top_k} {args.dtype}"
    )
    base = next((r for r in results if r.strategy == "a2a"), None)
    print(
        render_table(
            ["strategy", "iteration ms", "MoE a2a measured ms", "a2a calls",
             "predicted collectives ms", "of which wait ms", "replicas", "replayed ms",
             "vs a2a"],
            [[r.strategy, f"{r.iteration_ms:.3f}", f"{r.a2a_measured_ms:.3f}", r.a2a_calls,
              f"{r.collective_ms:.3f}", f"{r.wait_ms:.3f}", r.replicas, f"{r.replayed_ms:.3f}",
              f"{base.replayed_ms / r.replayed_ms:.3f}" if base else "-"]
             for r in results],
            markdown=args.markdown,
        )
    )  # fmt: skip
    print(
        "assumed: replayed = iteration - the rank's measured MoE all-to-alls + per layer step "
        "(step - this rank's compute) of the strategy's plan on the planners' cost model "
        "(exposed token all-to-alls after overlap, replica transfer, and the wait for the slowest "
        "rank); everything else is kept as measured, the rank's expert compute included (rows a "
        "strategy moves between ranks are not re-timed)"
    )
    note = token_calls_note(first)
    if note:
        print(note)


# options read only in another option's mode: (flag, attribute, default, the mode's flag and its
# attribute): given without that mode they were ignored without a word
_MODE_OPTIONS = (
    *(
        (f"--{name.replace('_', '-')}", name, default, "--layers N", "layers")
        for name, default in (
            ("dense_params", 0),
            ("pipeline_stages", 1),
            ("microbatches", 1),
            ("dp", 1),
            ("edp", 1),
        )
    ),  # fmt: skip
    ("--ep-size", "ep_size", 2, "--replay TRACE", "replay"),
    ("--trace-rank", "trace_rank", None, "--replay TRACE", "replay"),
    ("--remeasure", "remeasure", False, "--validate FILE", "validate"),
    ("--validate-world", "validate_world", (2, 4), "--remeasure", "remeasure"),
    ("--device", "device", "cpu", "--remeasure", "remeasure"),
)


def _check_modes(args: argparse.Namespace) -> None:
    """A one-line error for an option given without the mode that reads it."""
    for flag, name, default, mode, needs in _MODE_OPTIONS:
        if getattr(args, name) != default and not getattr(args, needs):
            raise ValueError(f"{flag} is read only with {mode}; add it, or drop {flag}")


def run(args: argparse.Namespace) -> int:
    from mixmoe.placement.profile_io import describe, load_profile
    from mixmoe.validation import check_int

    _check_modes(args)

    if args.replay_strategy:
        from mixmoe.dispatch.strategies import strategy_spec

        for name in args.replay_strategy:
            strategy_spec(name)  # a clear error for a strategy that is not a2a, shadow or mix
        if not args.replay:
            raise ValueError(
                "--replay-strategy re-predicts a trace: give the trace with --replay TRACE"
            )
    if args.validate:
        return _validate(args)
    if args.replay:
        return _replay(args)
    for name in ("world_size", "tokens", "top_k", "model_dim", "hidden_size"):
        check_int(f"--{name.replace('_', '-')}", getattr(args, name), 1)
    check_int("--max-replicas", args.max_replicas, 0)
    profile = load_profile(args.profile)
    source, measured = describe(args.profile)
    shape = _shape(args, args.world_size)
    t0 = time.perf_counter()
    base = "a2a" if "a2a" in _strategies(args, shape.world_size) else None
    cells, records, first = [], [], None
    for routing in args.routing:
        preds = _mean_preds(args, shape, profile, routing)
        first = first or (routing, preds)
        cells += _strategy_rows(routing, preds, base)
        records += [(routing, shape.world_size, p) for p in preds.values()]
    print(
        f"layer: D={shape.model_dim} F={shape.hidden_dim} W={shape.world_size} "
        f"E={shape.experts_per_rank} N={shape.num_experts} T={args.tokens}/rank K={args.top_k} "
        f"{args.dtype}; profile {profile.name} ({source})"
    )
    print(render_table(HEADERS, cells, markdown=args.markdown))
    if args.per_rank and first is not None:
        routing, preds = first
        print(f"\nper rank ({routing})")
        rank_cells = [
            [s, r, p.rows_W[r], *(_fmt_ms(v[r]) for v in (p.compute_W, p.token_W, p.weight_W,
                                                          p.hidden_W, p.exposed_W))]
            for s, p in preds.items()
            for r in range(len(p.rows_W))
        ]  # fmt: skip
        print(
            render_table(
                ["strategy", "rank", "rows", "compute ms", "token ms", "replica ms", "hidden ms",
                 "exposed ms"],
                rank_cells,
                markdown=args.markdown,
            )
        )  # fmt: skip
    sweep: list[tuple[str, str, float]] = []
    if args.vs_world:
        for W in args.vs_world:
            sw = _shape(args, W)
            for p in _mean_preds(args, sw, profile, args.routing[0]).values():
                sweep.append((str(W), p.strategy, p.step_s))
                records.append((args.routing[0], W, p))
    if args.vs_routing:
        for routing in args.vs_routing:
            for p in _mean_preds(args, shape, profile, routing).values():
                sweep.append((routing, p.strategy, p.step_s))
                records.append((routing, shape.world_size, p))
    if sweep:
        xs = list(dict.fromkeys(x for x, _, _ in sweep))
        strategies = list(dict.fromkeys(s for _, s, _ in sweep))
        got = {(x, s): t for x, s, t in sweep}
        label = "W" if args.vs_world else "routing"
        print(f"\npredicted step ms vs {label}")
        print(
            render_table(
                [label, *strategies],
                [
                    [x, *(_fmt_ms(got[(x, s)]) if (x, s) in got else "-" for s in strategies)]
                    for x in xs
                ],
                markdown=args.markdown,
            )
        )
        if args.sweep_png:
            from mixmoe.simulate.plots import plot_sweep

            print(f"sweep plot: {plot_sweep(sweep, label, args.sweep_png)}")
    if args.layers:
        from mixmoe.simulate.model import ModelShape, predict_model

        model = ModelShape(
            layers=args.layers,
            dense_params=args.dense_params,
            tokens=args.tokens,
            pipeline_stages=args.pipeline_stages,
            microbatches=args.microbatches,
            dp=args.dp,
            edp=args.edp,
        )
        routing, preds = first
        mcells = []
        for s, p in preds.items():
            m = predict_model(p.step_s, shape, model, profile)
            mcells.append(
                [s, _fmt_ms(m.microbatch_s), _fmt_ms(m.pipeline_s), f"{m.bubble_fraction:.3f}",
                 _fmt_ms(m.dense_allreduce_s), _fmt_ms(m.expert_allreduce_s), _fmt_ms(m.step_s)]
            )  # fmt: skip
        print(f"\nmodel: {args.layers} MoE layers, {args.dense_params} dense params, P="
              f"{args.pipeline_stages}, M={args.microbatches}, dp={args.dp}, edp={args.edp} "
              f"({routing})")  # fmt: skip
        print(
            render_table(
                ["strategy", "microbatch ms", "pipeline ms", "bubble", "dp allreduce ms",
                 "edp allreduce ms", "step ms"],
                mcells,
                markdown=args.markdown,
            )
        )  # fmt: skip
    if args.png and first is not None:
        from mixmoe.simulate.plots import plot_rank_bars

        routing, preds = first
        title = f"{routing}, W={shape.world_size}, N={shape.num_experts}, {profile.name}"
        print(f"per-rank plot: {plot_rank_bars(preds, args.png, title)}")
    if args.jsonl:
        import dataclasses

        import torch

        from mixmoe.formats.results import append_jsonl

        config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        config["profile_figures"] = dataclasses.asdict(profile)
        append_jsonl(
            args.jsonl,
            "simulate",
            config,
            torch.device("cpu"),
            [{"routing": r, "world_size": W, **dataclasses.asdict(p)} for r, W, p in records],
        )
        print(f"JSONL appended to {args.jsonl}")
    print(f"simulated in {time.perf_counter() - t0:.2f} s")
    return 0
