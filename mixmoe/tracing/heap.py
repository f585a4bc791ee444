"""``frozen_heap()``: while a benchmark times calls, the objects the process already holds are
frozen out of the garbage collector (``gc.freeze``; unfrozen after).

A benchmark's process keeps what it made before (records, count matrices, earlier plans). Its
heap grows case after case, so a full (generation-2) collection comes now and then and walks
all of it, inside whichever call allocates at that moment: a timed planner call took ~70 ms
instead of ~1 ms in ``mixmoe bench balance`` (one such collection per run, the 2026-11-27
measurement). A layer's long-running training process reaches a steady heap and made no full
collection inside a step in 150 (``docs/results/2026-11-27-cold-counts.md``). Frozen, such a
collection walks only what the timed calls themselves made, so the calls' own collections
still count.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen_heap"]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the collector's tracked objects for the block (untimed: O(1) list moves)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
