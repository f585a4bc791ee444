"""``mixmoe report LOG...``: tables (and plots) from layer and model benchmark logs.

Each file is read as a layer log (docs/formats.md section 1) or a model log (section 2), detected
from its content; runs with the same key across files are pooled. Prints one table per kind:
median/mean step, forward and backward over the steady steps (rule: ``run_stats.steady_steps``), the log's
own summary average and the speedup against ``--baseline`` (default, or when a table lacks that
system: the table's first system).
A ``train.jsonl`` of ``mixmoe train`` (even the partial log of a killed run) is redrawn as
``loss.png`` beside it (or in ``--plots DIR``), with a line of its steps and last loss.
``--markdown`` prints Markdown tables; ``--plots DIR`` writes ``layer_step_vs_experts.png``,
``layer_forward_backward.png`` and ``model_step_time.png`` there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mixmoe.formats.layer_log import BenchRun, detect_log_kind, read_layer_log
from mixmoe.formats.model_log import read_model_log
from mixmoe.report.run_stats import RunStats, run_stats, stats_table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG", help="layer or model benchmark logs")
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


def _is_train_log(path: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline()
    return first.startswith("{") and '"kind": "train"' in first


def _redraw_train_log(path: str, plots: str | None) -> None:
    from mixmoe.train.outputs import PNG_NAME, latest_per_step, plot_log, read_log

    png = Path(plots) / PNG_NAME if plots else Path(path).with_name(PNG_NAME)
    records = latest_per_step(read_log(path))
    plot_log(path, png)
    last = records[-1]
    print(f"{path}: steps {records[0]['step']}..{last['step']}, last loss {last['loss']:.4f}")
    print(f"loss curve: {png}")


def run(args: argparse.Namespace) -> int:
    train_logs = [p for p in args.logs if _is_train_log(p)]
    for path in train_logs:
        _redraw_train_log(path, args.plots)
    args.logs = [p for p in args.logs if p not in train_logs]
    if not args.logs:
        return 0
    kinds = _load(args.logs)
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
