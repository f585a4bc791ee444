"""Counts read from memory, as the device's copy leaves them: what the planning benchmarks time
(``mixmoe bench planner``, ``mixmoe bench balance``), ``native/cache_lines.cpp``'s flush.

Each step the layer's planning thread reads counts the device has just copied to the host: in
memory, not in this CPU's caches. A benchmark that plans the same counts call after call reads
them from the cache the call before filled (at W = 1024 C is 32 MiB and its hot columns stay
cached), faster than the layer would. ``CacheEvictor.evict`` drops the counts' cache lines
before each timed call (``clflush`` on x86-64, ``dc civac`` on Arm), the planner's own code and
buffers staying as warm as the calls before left them; where the flush is not built (no
compiler, another architecture) it writes a buffer of twice the last-level cache instead, which
evicts everything (a slower bound; ``how`` says which).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mixmoe.placement import native_lib

__all__ = ["CacheEvictor", "last_level_cache_bytes"]

MAX_BUFFER = 512 << 20  # the eviction buffer's cap (bytes)


def last_level_cache_bytes(base: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """This CPU's last-level cache as one core sees it (Linux sysfs), else 32 MiB."""
    sizes = []
    for entry in base.glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
            level = int((entry / "level").read_text())
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append((level, int(digits) * unit))
    return max(sizes)[1] if sizes else 32 << 20


class CacheEvictor:
    """``evict()`` drops ``tensors`` (contiguous CPU tensors: the counts the device copies to the
    host each step) from every cache level, line by line, as that copy leaves them; where the
    flush is not built (``how`` "caches"), writes a buffer of twice the last-level cache (capped
    at ``MAX_BUFFER``) instead."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
        for t in self.tensors:
            if not t.is_contiguous():
                raise ValueError("CacheEvictor flushes contiguous tensors; pass t.contiguous()")
        self.flush = native_lib.function("mixmoe_flush_lines", native_lib.I64,
                                         [native_lib.P, native_lib.I64])  # fmt: skip
        self.buffer: torch.Tensor | None = None
        if self.flush is None or self.flush(0, 0) != 0:  # 0 bytes: only whether it is built
            size = min(2 * last_level_cache_bytes(), MAX_BUFFER)
            self.buffer = torch.zeros(size // 8, dtype=torch.int64)

    @property
    def how(self) -> str:
        """ "lines": the tensors' lines flushed; "caches": every cache evicted."""
        return "caches" if self.buffer is not None else "lines"

    def evict(self) -> None:
        if self.buffer is not None:
            self.buffer.add_(1)
            return
        for t in self.tensors:
            self.flush(t.data_ptr(), t.numel() * t.element_size())
