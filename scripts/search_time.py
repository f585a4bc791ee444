"""Planning time of the source-replica search: Python vs compiled (``native_search``).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/search_time.py [REPEATS] [search|mix|both]

For each point (zipf:1.2, hot:0.3, uniform routing; W = 8, 64, 256, 1024; 8192 tokens per rank,
top-2, 4 experts per rank, D1024 F4096 bf16, GPU_PROFILE) it times ``plan_replicas`` on the inputs
``plan_mix`` passes it (its counted sums, its baseline loads, its replica slots) and ``plan_mix``
itself, with the compiled search off (the Python paths; the other compiled parts stay on) and on,
interleaved call by call, and prints process_time medians in ms on one thread. Each point first
checks that both give the same plan.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import GPU_PROFILE, LayerShape, native_search, plan_mix
from mixmoe.placement.counts import baseline_loads, counts_with_sums
from mixmoe.placement.planner import replica_slots
from mixmoe.placement.replica_search import LIST_LIMIT, plan_replicas


def main() -> None:
    torch.set_num_threads(1)
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    which = sys.argv[2] if len(sys.argv) > 2 else "both"
    compiled = native_search.available

    def use_compiled(on: bool) -> None:  # the search only: plan_replicas asks available()
        native_search.available = compiled if on else (lambda model: False)

    for routing in ("zipf:1.2", "hot:0.3", "uniform"):
        for W in (8, 64, 256, 1024):
            E, N = 4, 4 * W
            gen = torch.Generator().manual_seed(0)
            C = synthetic_counts(RoutingSpec.parse(routing), W, 8192, 2, N, gen)
            shape = LayerShape(1024, 4096, E, W, 2)
            counted = counts_with_sums(C, shape)
            base = baseline_loads(counted[0], E, counted[1:]) if W * N > LIST_LIMIT else None
            slots = replica_slots(4, E)
            runs = {
                "plan_replicas": functools.partial(
                    plan_replicas, C, shape, GPU_PROFILE, slots, counted=counted, baseline=base
                ),
                "plan_mix": functools.partial(plan_mix, C, shape, GPU_PROFILE, 4),
            }
            for name, run in runs.items():
                if which not in ("both", "search" if name == "plan_replicas" else "mix"):
                    continue
                use_compiled(False)
                python_plan = run()
                use_compiled(True)
                assert run() == python_plan, (name, routing, W)
                times: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(repeats):
                    for on in (False, True):
                        use_compiled(on)
                        start = time.process_time()
                        run()
                        times[on].append(time.process_time() - start)
                use_compiled(True)
                py, cc = (statistics.median(times[on]) * 1e3 for on in (False, True))
                print(f"{name:14s} {routing:8s} W={W:5d}  python {py:7.3f} ms  compiled "
                      f"{cc:7.3f} ms  x{py / cc:4.1f}  hot={len(python_plan.hot)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
