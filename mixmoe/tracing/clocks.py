"""Clocks for the trace recorder: cheap marks while running, milliseconds when flushed.

Both clocks report on the host's ``time.perf_counter`` timeline (``CLOCK_MONOTONIC`` on Linux, so
ranks on one host share it and their traces merge without offsets).

- ``CpuClock``: a mark is ``perf_counter()``; nothing to resolve.
- ``CudaClock``: a mark is a timing ``torch.cuda.Event`` recorded on the current stream. One
  reference event is anchored to the host clock at the first mark (the only synchronize before
  the flush); resolving an event waits for it and adds its elapsed time since the reference.
  So CUDA marks give device-side intervals placed on the host timeline.
"""

from __future__ import annotations

import time

import torch

__all__ = ["CpuClock", "CudaClock", "clock_for"]


class CpuClock:
    """``mark()`` -> seconds from ``perf_counter``; ``to_ms(mark)`` -> milliseconds."""

    def mark(self) -> float:
        return time.perf_counter()

    def to_ms(self, mark: float) -> float:
        return mark * 1e3


class CudaClock:
    """Marks are CUDA events on ``device``'s current stream; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ref: torch.cuda.Event | None = None
        self._ref_ms = 0.0

    def _anchor(self) -> torch.cuda.Event:
        torch.cuda.synchronize(self.device)
        ref = torch.cuda.Event(enable_timing=True)
        ref.record(torch.cuda.current_stream(self.device))
        ref.synchronize()
        # The device was idle, so the reference completed when recorded: read the host clock now.
        self._ref_ms = time.perf_counter() * 1e3
        self._ref = ref
        return ref

    def mark(self) -> torch.cuda.Event:
        if self._ref is None:
            self._anchor()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_ms(self, mark: torch.cuda.Event) -> float:
        ref = self._ref if self._ref is not None else self._anchor()
        mark.synchronize()
        return self._ref_ms + ref.elapsed_time(mark)


def clock_for(device: torch.device) -> CpuClock | CudaClock:
    """The clock measuring work on ``device`` (CUDA events for ``cuda``, else ``perf_counter``)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"TraceRecorder device={device} but CUDA is not available; use 'cpu'")
        return CudaClock(device)
    return CpuClock()
