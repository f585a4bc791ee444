"""The replica fetch's cost on one GPU at the planner's plans (issue 26): the relay plan's
build (planning thread) and the fetch's forward and backward at one rank, the all_to_all
stood in by a no-cost op that returns a buffer of the right size, so what is timed is the
rank's own work: its host bookkeeping and the copies it launches.

    python scripts/gpu/relay_fetch.py [--device cuda] [--old PATH] [--worlds 64,256,1024]

zipf:1.2, N = 4 W, under ``h100-nvlink-ib`` (8 ranks per node), rank W // 3, packed rows of
D = 1024, F = 4096 (gelu, no bias) in bf16 on the GPU. ``--old PATH``: a folder holding an
earlier tree as the package ``mixmoe_s5`` (af7e0cd), timed in the same loop, interleaved.
Prints medians (ms): host = until the call returns, device = until the GPU is done.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import LayerShape, plan_mix
from mixmoe.placement.profile_io import load_profile

D, F = 1024, 4096


class _StandIn(torch.autograd.Function):  # the all_to_all: a buffer of the received size
    @staticmethod
    def forward(ctx, x, total):
        ctx.n = x.numel()
        return x.new_zeros(total)

    @staticmethod
    def backward(ctx, g):
        return g.new_zeros(ctx.n), None


def _package(name: str):
    replicas = importlib.import_module(f"{name}.dispatch.replicas")
    replicas.cached_all_to_all = lambda comm, send, out_splits, in_splits, hit, trace: (
        _StandIn.apply(send, sum(out_splits))
    )
    weights = importlib.import_module(f"{name}.ops.expert_mlp").ExpertWeights
    relay = importlib.import_module(f"{name}.placement.relay")
    return replicas, weights, relay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--old", default=None)
    ap.add_argument("--worlds", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    names = ["mixmoe"]
    if args.old:
        sys.path.insert(0, args.old)
        names.insert(0, "mixmoe_s5")
    packages = {n: _package(n) for n in names}
    prof = load_profile("h100-nvlink-ib")
    print(f"device {args.device} torch {torch.__version__}; medians of {args.repeats}")
    print("| W | tree | build ms | forward host ms | forward device ms | backward ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for W in (int(x) for x in args.worlds.split(",")):
        E = 4
        C = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, W * E,
                             torch.Generator().manual_seed(0), shuffle_experts=True)  # fmt: skip
        plan = plan_mix(C, LayerShape(D, F, E, W, bytes_per_element=2), prof, 4)
        r = W // 3
        owned = {}
        for n, (_, weights, _) in packages.items():
            w1 = torch.randn(E, D, F, device=device, dtype=torch.bfloat16, requires_grad=True)
            w2 = torch.randn(E, F, D, device=device, dtype=torch.bfloat16, requires_grad=True)
            owned[n] = weights(w1_SDF=w1, w2_SFD=w2)
        times = {n: ([], [], [], []) for n in names}
        fetches = {}
        for rep in range(args.repeats + 2):
            for n, (replicas, _, relay) in packages.items():
                distance = relay.node_distance(prof)
                t0 = time.perf_counter()
                fetch = replicas.RelayPlan.build(plan.replicas, r, W, E, distance, relay=plan.relay)
                t1 = time.perf_counter()
                _sync(device)
                t2 = time.perf_counter()
                rows, _ = replicas.fetch_replicas(None, owned[n], fetch, None)
                t3 = time.perf_counter()
                _sync(device)
                t4 = time.perf_counter()
                rows.float().sum().backward()
                _sync(device)
                t5 = time.perf_counter()
                fetches[n] = rows.detach()
                if rep >= 2:
                    for v, x in zip(times[n], (t1 - t0, t3 - t2, t4 - t2, t5 - t4), strict=True):
                        v.append(x * 1e3)
        if len(fetches) == 2:  # the same replicas both ways
            assert torch.equal(fetches["mixmoe"], fetches["mixmoe_s5"])
        for n in names:
            b, fh, fd, bw = (statistics.median(v) for v in times[n])
            tree = "af7e0cd" if n == "mixmoe_s5" else "now"
            print(f"| {W} | {tree} | {b:.3f} | {fh:.3f} | {fd:.3f} | {bw:.3f} |", flush=True)
        del owned, fetches
    return 0


if __name__ == "__main__":
    sys.exit(main())
