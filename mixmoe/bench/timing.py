"""Step timers: CUDA events on GPU (no sync inside the step), perf_counter after a sync on CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class StageTimer:
    """``mark()`` after each stage; ``elapsed_ms()`` returns the stage durations in ms."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def elapsed_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]


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
