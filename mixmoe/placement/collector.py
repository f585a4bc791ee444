"""Python's cyclic garbage collector paused around host work that allocates in bursts.

The planner's balance search and the replica fetch's bookkeeping create tens of thousands of
small tuples, lists and dicts that die by reference counting. The collector counts them as they
are created, and in a process that holds torch's objects the collections they trigger cost
more than the work itself (W = 1024: ~120 of ~490 ms of a Python plan; ~1.2 of 3.4 ms of a
far holder's relay plan under nodes). That work creates no reference cycles, so nothing is
left for the collector to free.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside, then as it was. Process-wide state: another thread leaving
    the same block re-enables it early (harmless: collections resume); it stays off when it was
    off on entry."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
