"""Statistics and tables over benchmark runs: one row per (system[, model], experts).

Each row pools the steady steps (``steady_steps``) of every run with that key and gives the
median and mean of step, forward and backward time, the log's own summary average (mean over the
runs that have one) and the speedup against a baseline system:
``baseline median step / this median step`` for the same model and expert count (> 1 = faster).

Steady steps (what statistics use; warm-up steps are never averaged):

- layer logs: the steps the log's own summary averaged, i.e. all steps after the first ``w``
  for the smallest ``w`` whose step/forward/backward means equal the summary to its printed
  precision (``mixmoe bench layer`` averages everything after its warm-up). Without a summary,
  or if no ``w`` matches, drop the first ``max(1, ceil(n / 10))`` steps (STEP-0 and the first
  10%).
- model logs: the last ``round(0.6 n)`` steps (the last 60 of 100, as the model benchmarks do).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mixmoe.formats.layer_log import BenchRun, StepRow
from mixmoe.report.text_table import render_table

__all__ = ["RunStats", "run_stats", "speedups", "stats_table", "steady_steps"]


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known and len(known) == len(values) else None


def _close(mean: float | None, printed: float | None) -> bool:
    """``mean`` equals ``printed`` to the precision summaries are printed with (3 decimals,
    6 significant digits); a side that is missing does not disagree."""
    if mean is None or printed is None:
        return True
    return abs(mean - printed) <= 6e-4 + 1e-5 * abs(printed)


def steady_steps(run: BenchRun) -> tuple[tuple[StepRow, ...], str]:
    """The run's steady steps and the rule that chose them: ``"summary"``, ``"first 10%"`` or
    ``"last 60%"`` (see the module docstring)."""
    steps, n = run.steps, len(run.steps)
    if run.kind == "model":
        keep = max(1, round(0.6 * n)) if n else 0
        return steps[n - keep :], "last 60%"
    if run.summary is not None:
        s = run.summary
        wanted = (s.step_ms, s.forward_ms, s.backward_ms)
        for w in range(n):
            tail = steps[w:]
            means = (
                _mean([r.step_ms for r in tail]),
                _mean([r.forward_ms for r in tail]),
                _mean([r.backward_ms for r in tail]),
            )
            if all(_close(m, want) for m, want in zip(means, wanted, strict=True)):
                return tail, "summary"
    w = min(n, max(1, math.ceil(n / 10)))
    return steps[w:], "first 10%"


@dataclass(frozen=True)
class RunStats:
    """Times in ms; forward/backward are None when the log has no such column."""

    kind: str
    system: str
    model: str | None
    experts: int | None
    runs: int
    steps: int
    warmup: str
    median_step_ms: float
    mean_step_ms: float
    median_forward_ms: float | None
    mean_forward_ms: float | None
    median_backward_ms: float | None
    mean_backward_ms: float | None
    log_step_ms: float | None

    @property
    def peer_key(self) -> tuple[str | None, int | None]:
        """Rows with the same peer key are comparable (same model and expert count)."""
        return (self.model, self.experts)


def _med_mean(values: list[float | None]) -> tuple[float | None, float | None]:
    known = [v for v in values if v is not None]
    if not known or len(known) != len(values):
        return None, None
    return statistics.median(known), statistics.fmean(known)


def run_stats(groups: Mapping[tuple, Sequence[BenchRun]]) -> list[RunStats]:
    """One ``RunStats`` per key, sorted by (model, experts) then order of first appearance.

    ``warmup`` tells, per run, how many steps were dropped and by which rule (``"2 (summary)"``).
    A key whose runs have no steady step but a summary uses the summary's averages (``steps``
    is then 0); a key with neither is skipped.
    """
    out: list[tuple[tuple, RunStats]] = []
    for order, runs in enumerate(groups.values()):
        rows, rules = [], []
        for run in runs:
            steady, rule = steady_steps(run)
            rows.extend(steady)
            rules.append(f"{len(run.steps) - len(steady)} ({rule})")
        summaries = [r.summary for r in runs if r.summary is not None]
        log_step = statistics.fmean(s.step_ms for s in summaries) if summaries else None
        head = runs[0]
        if rows:
            step = _med_mean([r.step_ms for r in rows])
            fwd = _med_mean([r.forward_ms for r in rows])
            bwd = _med_mean([r.backward_ms for r in rows])
            rule = ", ".join(dict.fromkeys(rules))
        elif summaries:
            s = summaries[0]
            step, fwd, bwd = (s.step_ms, s.step_ms), (s.forward_ms,) * 2, (s.backward_ms,) * 2
            rule = "- (summary only)"
        else:
            continue
        assert step[0] is not None and step[1] is not None
        stats = RunStats(
            head.kind,
            head.system,
            head.model,
            head.num_local_experts,
            len(runs),
            len(rows),
            rule,
            step[0],
            step[1],
            fwd[0],
            fwd[1],
            bwd[0],
            bwd[1],
            log_step,
        )
        sort_key = (head.model or "", head.num_local_experts or 0, order)
        out.append((sort_key, stats))
    return [stats for _, stats in sorted(out, key=lambda item: item[0])]


def speedups(stats: Sequence[RunStats], baseline: str) -> list[float | None]:
    """Per row: baseline median step / row median step for the same model and experts (None if
    the baseline has no such row). Raises ValueError naming the systems if ``baseline`` is absent.
    """
    systems = list(dict.fromkeys(s.system for s in stats))
    if baseline not in systems:
        raise ValueError(f"baseline {baseline!r} is not in the logs; choose one of {systems}")
    base = {s.peer_key: s.median_step_ms for s in stats if s.system == baseline}
    return [
        base[s.peer_key] / s.median_step_ms if s.peer_key in base and s.median_step_ms > 0 else None
        for s in stats
    ]


def _ms(x: float | None) -> str | None:
    return None if x is None else f"{x:.3f}"


def stats_table(stats: Sequence[RunStats], baseline: str | None, markdown: bool = False) -> str:
    """The table of ``stats`` (all of one kind); ``baseline`` None leaves out the speedup."""
    ratio = speedups(stats, baseline) if baseline is not None else [None] * len(stats)
    model_col = any(s.model is not None for s in stats)
    headers = ["system"] + (["model"] if model_col else []) + ["experts", "steps", "warm-up"]
    headers += ["step med", "step mean", "fwd med", "fwd mean", "bwd med", "bwd mean", "log avg"]
    if baseline is not None:
        headers.append(f"speedup vs {baseline}")
    rows = []
    for s, r in zip(stats, ratio, strict=True):
        row: list[object] = [s.system] + ([s.model] if model_col else [])
        row += [s.experts, s.steps, s.warmup]
        row += [
            _ms(s.median_step_ms),
            _ms(s.mean_step_ms),
            _ms(s.median_forward_ms),
            _ms(s.mean_forward_ms),
            _ms(s.median_backward_ms),
            _ms(s.mean_backward_ms),
            _ms(s.log_step_ms),
        ]
        if baseline is not None:
            row.append(None if r is None else f"{r:.2f}x")
        rows.append(row)
    return render_table(headers, rows, markdown=markdown)
