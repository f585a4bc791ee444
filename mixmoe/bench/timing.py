"""Stage timers for benchmarks, on the trace recorder's clocks (``mixmoe.tracing.clocks``): CUDA
events on GPU (no sync inside the step), ``perf_counter`` on CPU. One clock abstraction serves
both the traces and the benchmark timings."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from mixmoe.tracing.clocks import clock_for


class StageTimer:
    """``mark()`` after each stage; ``elapsed_ms()`` returns the stage durations in ms (it waits
    for the last mark on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.clock = clock_for(device)
        self.marks: list = []

    def mark(self) -> None:
        self.marks.append(self.clock.mark())

    def elapsed_ms(self) -> list[float]:
        ms = [self.clock.to_ms(m) for m in self.marks]
        return [b - a for a, b in zip(ms, ms[1:], strict=False)]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def time_repeated(
    step: Callable[[], object], device: torch.device, warmup: int, repeats: int
) -> list[float]:
    """``step()`` run ``warmup`` times untimed, then ``repeats`` times timed; the times in ms."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        timer = StageTimer(device)
        timer.mark()
        step()
        timer.mark()
        times.append(timer.elapsed_ms()[0])
    return times
