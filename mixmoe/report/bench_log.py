"""Readers of layer and model benchmark logs (FORMATS.md sections 1 and 2), torch-free.

Runs are delimited by a ``[Benchmark]`` header (layer logs), a ``[Summary]`` line (which closes
the run before it) or a ``STEP-0`` after steps. A summary's prefix names the run:
``<system> <num_local_experts>`` (layer) or ``<variant> <model> <num_local_experts>`` (model);
without a prefix the system is the file's stem and the expert count comes from the header.
Lines the reader does not know (device names, ``rank: 2, nranks: 4``, module printouts, tables)
are skipped; a ``STEP-`` line that does not parse (truncated file) raises ValueError naming
``path:line``.

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
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BenchRun",
    "StepRow",
    "Summary",
    "detect_log_kind",
    "read_layer_log",
    "read_model_log",
    "steady_steps",
]

_NUM = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_STEP = re.compile(
    rf"STEP-(\d+):\s*step_time\s*=\s*{_NUM}\s*ms"
    rf"(?:\s*,\s*for?ward_time\s*=\s*{_NUM})?(?:\s*,\s*backward_time\s*=\s*{_NUM})?"
    rf"(?:\s*,\s*perf\s*=\s*{_NUM}\s*tflops)?"
)
_SUMMARY = re.compile(
    rf"^\s*(.*?)\s*\[Summary\]\s*Average synchronized step_time\s*=\s*{_NUM}\s*ms\s*,?"
    rf"(?:\s*forward\s*=\s*{_NUM}\s*,?)?(?:\s*backward\s*=\s*{_NUM})?"
)
_HEADER = re.compile(r"\[Benchmark\]\s*(.*)$")


@dataclass(frozen=True)
class StepRow:
    step: int
    step_ms: float
    forward_ms: float | None
    backward_ms: float | None
    tflops: float | None
    line_no: int


@dataclass(frozen=True)
class Summary:
    step_ms: float
    forward_ms: float | None
    backward_ms: float | None
    line_no: int


@dataclass(frozen=True)
class BenchRun:
    """One run. ``kind`` is ``"layer"`` or ``"model"``; ``model`` is None for layer runs;
    ``header`` holds the ``[Benchmark]`` fields (ints where they parse, backticks stripped)."""

    kind: str
    system: str
    model: str | None
    num_local_experts: int | None
    header: Mapping[str, int | str]
    steps: tuple[StepRow, ...]
    summary: Summary | None
    source: str

    @property
    def key(self) -> tuple:
        """``(system, E)`` for layer runs, ``(variant, model, E)`` for model runs."""
        if self.kind == "layer":
            return (self.system, self.num_local_experts)
        return (self.system, self.model, self.num_local_experts)


def _header_fields(text: str) -> dict[str, int | str]:
    fields: dict[str, int | str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            continue
        value = value.strip().strip("`")
        fields[key.strip()] = int(value) if re.fullmatch(r"-?\d+", value) else value
    return fields


def _f(x: str | None) -> float | None:
    return None if x is None else float(x)


def _parse(path: str | os.PathLike[str], kind: str) -> list[BenchRun]:
    source = os.fspath(path)
    stem = Path(source).stem
    runs: list[BenchRun] = []
    header: dict[str, int | str] = {}
    steps: list[StepRow] = []
    start_line = 1

    def close(summary: Summary | None, prefix: str) -> None:
        words = prefix.split()
        experts = header.get("num_local_experts")
        system, model = stem, None
        if words and re.fullmatch(r"\d+", words[-1]):
            experts = int(words[-1])
            words = words[:-1]
        if kind == "model" and len(words) >= 2:
            system, model = words[0], " ".join(words[1:])
        elif words:
            system = " ".join(words)
        runs.append(
            BenchRun(
                kind,
                system,
                model,
                experts if isinstance(experts, int) else None,
                dict(header),
                tuple(steps),
                summary,
                f"{source}:{start_line}",
            )
        )

    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if (m := _HEADER.search(line)) is not None:
                if steps:
                    close(None, "")
                header, steps, start_line = _header_fields(m.group(1)), [], line_no
            elif (m := _SUMMARY.match(line)) is not None:
                summary = Summary(float(m.group(2)), _f(m.group(3)), _f(m.group(4)), line_no)
                close(summary, m.group(1))
                steps, start_line = [], line_no + 1
            elif "STEP-" in line:
                m = _STEP.search(line)
                if m is None:
                    raise ValueError(
                        f"{source}:{line_no}: unreadable step line {line.strip()[:80]!r} "
                        "(truncated file?); fix or delete that line"
                    )
                if int(m.group(1)) == 0 and steps:
                    close(None, "")
                    steps, start_line = [], line_no
                steps.append(
                    StepRow(
                        int(m.group(1)),
                        float(m.group(2)),
                        _f(m.group(3)),
                        _f(m.group(4)),
                        _f(m.group(5)),
                        line_no,
                    )
                )
    if steps:
        close(None, "")
    return runs


def _grouped(runs: list[BenchRun]) -> dict[tuple, tuple[BenchRun, ...]]:
    groups: dict[tuple, list[BenchRun]] = {}
    for run in runs:
        groups.setdefault(run.key, []).append(run)
    return {key: tuple(group) for key, group in groups.items()}


def read_layer_log(path: str | os.PathLike[str]) -> dict[tuple, tuple[BenchRun, ...]]:
    """Layer runs grouped by ``(system, num_local_experts)`` in order of first appearance (a
    key may repeat: its runs are kept in file order)."""
    runs = _parse(path, "layer")
    if not runs:
        raise ValueError(f"{os.fspath(path)}: no benchmark steps or summaries found")
    return _grouped(runs)


def read_model_log(path: str | os.PathLike[str]) -> dict[tuple, tuple[BenchRun, ...]]:
    """Model runs grouped by ``(variant, model, num_local_experts)``; see ``read_layer_log``."""
    runs = _parse(path, "model")
    if not runs:
        raise ValueError(f"{os.fspath(path)}: no benchmark steps or summaries found")
    return _grouped(runs)


def detect_log_kind(path: str | os.PathLike[str]) -> str:
    """``"layer"`` if the file has a ``[Benchmark]`` header or ``perf = ... tflops`` steps,
    else ``"model"``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return "layer" if "[Benchmark]" in text or re.search(r"perf\s*=", text) else "model"


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
