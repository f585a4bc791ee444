"""Does planning in the background slow the GPU step? (issue 26: ``MoEConfig.plan_ahead``)

Under ``plan_ahead`` each MoE layer's plan of the step before's counts runs on the layer's
planning thread for the whole step, while the main thread launches the step's kernels. The plan
is compiled C++ (the GIL released) with some Python around it (its output decoded, the replica
route built), so the question for the default is whether that thread delays the main thread's
launches. This times a one-device MoE layer's forward + backward (``--tokens`` rows of
``--model-dim``, ``--experts`` experts, top-2: many small kernels) alone, then while a thread
plans W ranks' counts (N = 4 W experts, zipf:1.2, the layer's planner given the sums, then the
route) back to back (an upper bound: a layer plans once a step), on ``--layers`` threads (one per
MoE layer). Prints the medians (ms) of
``--steps`` steps after ``--warmup``, each step synchronised, their ratio, and the plans made.
Runs on the CPU too (``--device cpu``: the script's own check; CPU timings mean little).

    python scripts/gpu/plan_overlap.py [--device cuda] [--world 256,1024] [--layers 1]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from mixmoe import MoE, MoEConfig
from mixmoe.dispatch.replicas import RelayPlan
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import GPU_PROFILE, LayerShape, plan_mix
from mixmoe.placement.native_pricing import count_sums


def _step_ms(layer: MoE, x: torch.Tensor, steps: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        y, aux = layer(x)
        (y.float().square().mean() + (0 if aux is None else aux.loss)).backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t) * 1e3)
        layer.zero_grad(set_to_none=True)
    return times


def _planning(W: int, stop: threading.Event, made: list[int]) -> None:
    """Plan W ranks' counts (and this rank's route) back to back until ``stop``."""
    N = 4 * W
    gen = torch.Generator().manual_seed(0)
    C = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, N, gen, shuffle_experts=True)
    shape = LayerShape(1024, 4096, 4, W, 2)
    sums = count_sums(C, 4)
    while not stop.is_set():
        plan = plan_mix(C, shape, GPU_PROFILE, 4, sums=sums)
        RelayPlan.build(plan.replicas, W // 3, W, 4, None, relay=plan.relay)
        made[0] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--world", default="256,1024", help="comma list of W planned in the background")
    p.add_argument("--layers", type=int, default=1, help="planning threads (one per MoE layer)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--model-dim", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = MoEConfig(model_dim=args.model_dim, hidden_dim=args.hidden_size,
                    num_experts=args.experts, top_k=2)  # fmt: skip
    layer = MoE(cfg, dtype=dtype).to(device)
    x = torch.randn(args.tokens, args.model_dim, device=device, dtype=dtype)
    alone = statistics.median(_step_ms(layer, x, args.steps, args.warmup))
    print(f"{device}: layer step alone {alone:.3f} ms (median of {args.steps})")
    for W in (int(w) for w in args.world.split(",")):
        stop, made = threading.Event(), [0]
        threads = [threading.Thread(target=_planning, args=(W, stop, made), daemon=True)
                   for _ in range(args.layers)]  # fmt: skip
        for t in threads:
            t.start()
        try:
            busy = statistics.median(_step_ms(layer, x, args.steps, args.warmup))
        finally:
            stop.set()
            for t in threads:
                t.join()
        print(f"{device}: with {args.layers} thread(s) planning W = {W} back to back: "
              f"{busy:.3f} ms, {busy / alone:.3f}x alone ({made[0]} plans)")  # fmt: skip


if __name__ == "__main__":
    main()
