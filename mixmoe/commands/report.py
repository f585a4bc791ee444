"""``mixmoe report LOG...``: tables (and plots) from layer and model benchmark logs.

Each file is read as a layer log (docs/formats.md section 1) or a model log (section 2), detected
from its content; runs with the same key across files are pooled. Prints one table per kind:
median/mean step, forward and backward over the steady steps (rule: ``run_stats.steady_steps``), the log's
own summary average and the speedup against ``--baseline`` (default, or when a table lacks that
system: the table's first system).
``--markdown`` prints Markdown tables; ``--plots DIR`` writes ``layer_step_vs_experts.png``,
``layer_forward_backward.png`` and ``model_step_time.png`` there.

A ``train.jsonl`` of ``mixmoe train`` (detected from its records) gives, per run, the loss and
one row per MoE layer of expert balance (busiest expert / mean at the first, middle and last
step, the last step's coefficient of variation, dead experts and bias range, replicas per step);
``--plots DIR`` adds ``<name>_run<i>_load_heatmap.png`` (expert x step load heat-map). Its
``loss.png`` is redrawn beside it (or in ``--plots DIR``), from a killed run's partial log too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mixmoe.formats.layer_log import BenchRun, detect_log_kind, read_layer_log
from mixmoe.formats.model_log import read_model_log
from mixmoe.formats.train_log import is_train_log, read_train_runs
from mixmoe.report.run_stats import RunStats, run_stats, stats_table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="layer or model benchmark logs, or train.jsonl of mixmoe train",
    )
    parser.add_argument(
        "--baseline",
        help="system (or model variant) to compare against (default: the first one seen)",
    )
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument(
        "--plots", metavar="DIR", help="write PNG plots to this directory (needs matplotlib)"
    )


def _load(paths: list[str]) -> dict[str, dict[tuple, list[BenchRun]]]:
    kinds: dict[str, dict[tuple, list[BenchRun]]] = {"layer": {}, "model": {}}
    for path in paths:
        kind = detect_log_kind(path)
        groups = read_layer_log(path) if kind == "layer" else read_model_log(path)
        for key, runs in groups.items():
            kinds[kind].setdefault(key, []).extend(runs)
    return kinds


def _baseline(stats: list[RunStats], wanted: str | None) -> str:
    """``wanted`` if these logs have it, else their first system (a layer baseline such as
    ``fast_moe`` is no model variant)."""
    systems = list(dict.fromkeys(s.system for s in stats))
    return wanted if wanted in systems else systems[0]


def _train_reports(paths: list[str], args: argparse.Namespace) -> None:
    from mixmoe.report.load_balance import balance_table, plot_load_heatmap
    from mixmoe.train.outputs import PNG_NAME, plot_log

    for path in paths:
        png = Path(args.plots) / PNG_NAME if args.plots else Path(path).with_name(PNG_NAME)
        print(f"loss curve: {plot_log(path, png)}")
        for i, steps in enumerate(read_train_runs(path)):
            cfg = steps[0].get("config") or {}
            last = steps[-1]
            evals = [s["eval_loss"] for s in steps if s.get("eval_loss") is not None]
            print(
                f"{'## ' if args.markdown else ''}{path} run {i}: {cfg.get('model')} "
                f"{last.get('strategy')} W={last.get('world_size')}, steps "
                f"{steps[0]['step']}..{last['step']}, loss {steps[0]['loss']:.4f} -> "
                f"{last['loss']:.4f}" + (f", eval {evals[-1]:.4f}" if evals else "") + "\n"
            )
            print(balance_table(steps, markdown=args.markdown))
            print()
            if args.plots and any(s.get("moe") for s in steps):
                out = Path(args.plots) / f"{Path(path).stem}_run{i}_load_heatmap.png"
                print(f"plot: {plot_load_heatmap(steps, out, f'{path} run {i}')}")


def run(args: argparse.Namespace) -> int:
    train_logs = [p for p in args.logs if is_train_log(p)]
    if train_logs:
        _train_reports(train_logs, args)
    bench_logs = [p for p in args.logs if p not in train_logs]
    if not bench_logs:
        return 0
    kinds = _load(bench_logs)
    tables = {kind: run_stats(groups) for kind, groups in kinds.items() if groups}
    if args.baseline is not None and not any(
        args.baseline in {s.system for s in stats} for stats in tables.values()
    ):
        found = sorted({s.system for stats in tables.values() for s in stats})
        raise ValueError(
            f"--baseline {args.baseline!r} is not in these logs; choose one of {found}"
        )
    for kind, stats in tables.items():
        title = {"layer": "layer benchmarks", "model": "model benchmarks"}[kind]
        print(
            f"{'## ' if args.markdown else ''}{title}: ms over the steady steps "
            "(warm-up = steps dropped per run, and how that was decided)\n"
        )
        print(stats_table(stats, _baseline(stats, args.baseline), markdown=args.markdown))
        print()
    if args.plots:
        from mixmoe.report import bench_plots

        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        if "layer" in tables:
            written.append(
                bench_plots.plot_step_vs_experts(tables["layer"], out / "layer_step_vs_experts.png")
            )
            if any(s.median_forward_ms is not None for s in tables["layer"]):
                written.append(
                    bench_plots.plot_forward_backward(
                        tables["layer"], out / "layer_forward_backward.png"
                    )
                )
        if "model" in tables:
            written.append(
                bench_plots.plot_model_bars(tables["model"], out / "model_step_time.png")
            )
        print("plots: " + ", ".join(str(p) for p in written))
    return 0
