"""``plan_ahead``'s planning threads in a model of L MoE layers, on one rank of W: does each
layer's plan end before that layer's next forward, or does the step wait for it?

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/ahead_pipeline.py \
        [--layers 1,2,4] [--world 1024] [--experts 4096] [--profile h100-nvlink-ib] \
        [--routing zipf:1.2] [--iterations 12] [--device sleep|busy] [--layout columns|rows]

Legend: W ranks, N experts, L MoE layers. One dispatcher per layer, as a model has (each with
its own planning thread), at rank W // 3 of a stub communicator of W ranks. Per iteration and
layer, in order: that layer's counts (a fresh draw of the same popularity each iteration,
``gating.synthetic.redrawn_counts``; flushed from the caches, as the device's copy leaves them;
their sums given, as the device reduces them; stored by columns as the mixed strategy's count
exchange brings them, ``--layout rows``: row-major; the flush's time comes off the device time
below), the dispatcher's own ``plan_ahead`` step
(``ExpertParallelDispatcher._plan_ahead_step``: the wait for the plan its thread made from the
step before's counts, the fit, this rank's bookkeeping, the next plan submitted), then the
layer's device time: its plan's predicted step (forward and backward, the cost model),
``--device sleep``: slept, a main thread blocked on the GPU; ``busy``: spent issuing small torch
ops, a main thread launching kernels (each op releases the GIL). The layers' backwards are
folded into their own device time: a layer's thread has the rest of the iteration either way.

Printed per L, the first two iterations left out (the first plans afresh): the median and
largest wait for the planning thread per layer step (``plan_wait_ms``), the median host time
per layer step on the main thread (wait, fit and bookkeeping), the median predicted step, and
the iteration's host share. Not a timing test; the device time is the cost model's, the host
work is the layer's own code.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixmoe.config import MoEConfig
from mixmoe.dispatch.expert_parallel import ExpertParallelDispatcher
from mixmoe.gating.synthetic import RoutingSpec, redrawn_counts, synthetic_counts
from mixmoe.placement.native_cache_lines import CacheEvictor
from mixmoe.placement.native_pricing import count_sums
from mixmoe.placement.profile_io import load_profile


class _Ranks:
    """A communicator stub: the plan_ahead step reads only the rank and the world size."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def _device_time(seconds: float, how: str, x: torch.Tensor) -> None:
    if how == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x.add_(1.0)


def run(L: int, args: argparse.Namespace) -> dict:
    W, N = args.world, args.experts
    E = N // W
    profile = load_profile(args.profile)
    config = MoEConfig(model_dim=1024, hidden_dim=4096, num_experts=N, top_k=2,
                       plan_async=True, plan_ahead=True)  # fmt: skip
    layers = [ExpertParallelDispatcher(_Ranks(W // 3, W), config, "mix", profile) for _ in range(L)]
    gen = torch.Generator().manual_seed(0)
    base = synthetic_counts(RoutingSpec.parse(args.routing), W, 8192, 2, N, gen)
    draws = [redrawn_counts(base, seed) for seed in range(1, 4)]  # cycled: a new draw each step
    sums = [count_sums(C, E) for C in draws]
    if args.layout == "columns":  # the layer's (dispatch.layout): C.t() contiguous
        draws = [C.t().contiguous().t() for C in draws]
    evictors = [CacheEvictor([C.t() if args.layout == "columns" else C]) for C in draws]
    x = torch.zeros(16)
    waits, hosts, steps, iterations = [], [], [], []
    try:
        for it in range(args.iterations):
            start = time.perf_counter()
            host_s = 0.0
            for i, layer in enumerate(layers):
                k = (it + i) % len(draws)
                t = time.perf_counter()
                evictors[k].evict()  # (its time comes off the device time below)
                evicted = time.perf_counter() - t
                t = time.perf_counter()
                plan, _, _, waited = layer._plan_ahead_step(
                    draws[k], torch.float16, torch.device("cpu"), sums[k]
                )
                host = time.perf_counter() - t
                host_s += host
                if it >= 2:
                    waits.append(waited * 1e3)
                    hosts.append(host * 1e3)
                    steps.append(plan.prediction.step_s * 1e3)
                _device_time(max(0.0, plan.prediction.step_s - evicted), args.device, x)
            if it >= 2:
                iterations.append((host_s, time.perf_counter() - start))
    finally:
        for layer in layers:
            layer.close()
    return {
        "L": L,
        "wait_median_ms": statistics.median(waits),
        "wait_max_ms": max(waits),
        "host_median_ms": statistics.median(hosts),
        "step_median_ms": statistics.median(steps),
        "host_share": sum(h for h, _ in iterations) / sum(t for _, t in iterations),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="1,2,4")
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=4096)
    parser.add_argument("--profile", default="h100-nvlink-ib")
    parser.add_argument("--routing", default="zipf:1.2")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--device", choices=("sleep", "busy"), default="sleep")
    parser.add_argument("--layout", choices=("columns", "rows"), default="columns")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"W={args.world} N={args.experts} {args.routing} profile {args.profile}, "
          f"device time {args.device}, C by {args.layout}, {args.iterations} iterations "
          "(2 left out)")  # fmt: skip
    print("L  wait median ms  wait max ms  host median ms  step ms  host share")
    for L in (int(v) for v in args.layers.split(",")):
        r = run(L, args)
        print(f"{L:<2} {r['wait_median_ms']:14.3f} {r['wait_max_ms']:12.3f} "
              f"{r['host_median_ms']:15.3f} {r['step_median_ms']:8.2f} {r['host_share']:11.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
