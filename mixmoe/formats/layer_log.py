"""The layer benchmark log (docs/formats.md section 1): records, reader and writer. Torch-free.

Writer: ``header_line``, ``step_line``, ``summary_line`` (typos included on purpose:
``foward_time``; existing scripts parse exactly this) and ``nominal_tflops`` (the ``perf`` field).

Reader (shared with the model log, ``mixmoe.formats.model_log``, whose STEP lines are the same).
Runs are delimited by a ``[Benchmark]`` header (layer logs), a ``[Summary]`` line (which closes
the run before it) or a ``STEP-0`` after steps. A summary's prefix names the run:
``<system> <num_local_experts>`` (layer) or ``<variant> <model> <num_local_experts>`` (model);
without a prefix the system is the file's stem and the expert count comes from the header.
Lines the reader does not know (device names, ``rank: 2, nranks: 4``, module printouts, tables)
are skipped; a ``STEP-`` line that does not parse (truncated file) raises ValueError naming
``path:line``. Which steps are steady (warm-up excluded) is analysis, not format:
``mixmoe.report.run_stats.steady_steps``.
"""

from __future__ import annotations

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
    "header_line",
    "nominal_tflops",
    "parse_runs",
    "read_layer_log",
    "step_line",
    "summary_line",
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


def parse_runs(path: str | os.PathLike[str], kind: str) -> list[BenchRun]:
    """Every run of the file in file order; ``kind`` (``"layer"`` / ``"model"``) decides how a
    summary prefix names the run (module docstring)."""
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


def group_runs(runs: list[BenchRun]) -> dict[tuple, tuple[BenchRun, ...]]:
    """``runs`` grouped by ``BenchRun.key``, keys in order of first appearance."""
    groups: dict[tuple, list[BenchRun]] = {}
    for run in runs:
        groups.setdefault(run.key, []).append(run)
    return {key: tuple(group) for key, group in groups.items()}


def read_layer_log(path: str | os.PathLike[str]) -> dict[tuple, tuple[BenchRun, ...]]:
    """Layer runs grouped by ``(system, num_local_experts)`` in order of first appearance (a
    key may repeat: its runs are kept in file order). Raises ValueError if the file has none."""
    runs = parse_runs(path, "layer")
    if not runs:
        raise ValueError(f"{os.fspath(path)}: no benchmark steps or summaries found")
    return group_runs(runs)


def detect_log_kind(path: str | os.PathLike[str]) -> str:
    """``"layer"`` if the file has a ``[Benchmark]`` header or ``perf = ... tflops`` steps,
    else ``"model"``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return "layer" if "[Benchmark]" in text or re.search(r"perf\s*=", text) else "model"


# ----------------------------------------------------------------------------- writer


def header_line(
    *,
    world_size: int,
    dtype: str,
    model_dim: int,
    hidden_size: int,
    samples: int,
    num_local_experts: int,
    top_k: int,
    device: str,
    overlap_degree: int = 1,
) -> str:
    return (
        f"[Benchmark] world_size = {world_size}, dtype = {dtype}, model_dim = {model_dim}, "
        f"hidden_size = {hidden_size}, samples = {samples}, num_local_experts = "
        f"{num_local_experts}, topK = {top_k}, a2a_ffn_overlap_degree = {overlap_degree}, "
        f"device = `{device}`"
    )


def step_line(step: int, step_ms: float, fwd_ms: float, bwd_ms: float, tflops: float) -> str:
    return (
        f"STEP-{step}: step_time = {step_ms:.6f} ms, foward_time = {fwd_ms:.6f}, "
        f"backward_time = {bwd_ms:.6f}, perf = {tflops:.2f} tflops."
    )


def summary_line(
    system: str, num_local_experts: int, step_ms: float, fwd_ms: float, bwd_ms: float
) -> str:
    """Starts with a newline (the blank line) and a space, as in the wild."""
    return (
        f"\n {system} {num_local_experts} [Summary] Average synchronized step_time = "
        f"{step_ms:g} ms, forward = {fwd_ms:g} , backward = {bwd_ms:g} ."
    )


def nominal_tflops(
    samples: int, model_dim: int, hidden_size: int, top_k: int, step_ms: float
) -> float:
    """samples * D * F * 4 * K * 3 / step time: two GEMMs at 2 FLOPs per MAC, fwd + bwd = 3x fwd."""
    if step_ms <= 0:
        return 0.0
    return samples * model_dim * hidden_size * 4 * top_k * 3 / (step_ms * 1e-3) / 1e12
