"""``tracing.heap.frozen_heap``: the collector's tracked objects frozen for the block (a full
collection then walks only what the block made), unfrozen after it, an error included; and the
planner benchmarks time their calls inside it."""

from __future__ import annotations

import gc

import pytest
import torch

from mixmoe.bench import planner as planner_bench
from mixmoe.simulate import workloads
from mixmoe.tracing.heap import frozen_heap


def test_the_heap_is_frozen_in_the_block_and_unfrozen_after_it() -> None:
    held = [[i] for i in range(1000)]  # tracked objects the process holds before the block
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() >= len(held)
        made = [[i] for i in range(10)]
        assert all(gc.is_tracked(x) for x in made)  # new objects: collected as usual
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyError), frozen_heap():
        raise KeyError("inside")
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    "timer",
    [
        lambda fn: workloads._timed_plans(lambda C: fn(), torch.zeros(2), 2),
        lambda fn: planner_bench._time_ms(fn, 2),
        lambda fn: planner_bench._busy_thread_ms(fn, 2),
    ],
    ids=["bench balance", "bench planner", "bench planner, busy caller"],
)
def test_the_planner_benchmarks_time_their_calls_on_a_frozen_heap(timer) -> None:
    frozen = []
    timer(lambda: frozen.append(gc.get_freeze_count()))
    assert len(frozen) == 3 and min(frozen) > 0  # the untimed call and both timed ones
    assert gc.get_freeze_count() == 0
