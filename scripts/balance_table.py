"""Issue 26's workload table by the planners' own cost model (a stand-in until
``mixmoe simulate --workloads`` lands): a2a, shadow and mix predicted steps, mix as % of
force-balanced (the uniform a2a step of the same shape, W and profile), rank imbalance after the
plan (max / mean rows computed) and planning time.

Run: PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/balance_table.py [--worlds 8,64,256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.planner import plan_mix, plan_none, plan_shadow
from mixmoe.placement.profile_io import load_profile

SHAPES = {  # name: (D, F, experts per rank at W or total experts, top-k, bytes, gemms)
    "seeds": dict(D=1024, F=4096, per_rank=4, K=2, bytes=2, gemms=2),
    "deepseek": dict(D=2048, F=1024, total=256, K=8, bytes=2, gemms=3),
}
WORKLOADS = (
    "uniform",
    "zipf:1.2",
    "zipf:2.0",
    "hot:0.2",
    "hot:0.5",
    "hotset",
    "hotrank",
    "idle",
    "rotate",
)


def _hot_set(W, T, K, N, hot, share, gen):
    H = len(hot)
    hot_rows = min(H * T, round(share * T * K))
    C = torch.zeros(W, N, dtype=torch.int64)
    per = torch.full((H,), hot_rows // H, dtype=torch.int64)
    per[: hot_rows % H] += 1
    C[:, hot] = per
    cold = torch.ones(N, dtype=torch.bool)
    cold[hot] = False
    cold_M = cold.nonzero().squeeze(1)
    draws = torch.randint(0, len(cold_M), (W, T * K - hot_rows), generator=gen)
    C[:, cold_M] += torch.zeros(W, len(cold_M), dtype=torch.int64).scatter_add_(
        1, draws, torch.ones_like(draws)
    )
    return C


def counts(workload, W, T, K, N, seed=0):
    """One or more count matrices [W, N] (rotate: 4 steps)."""
    gen = torch.Generator().manual_seed(seed)
    E = N // W
    if workload.split(":")[0] in ("uniform", "zipf", "hot"):
        return [synthetic_counts(RoutingSpec.parse(workload), W, T, K, N, gen)]
    if workload == "hotset":  # 4 hot experts (a hot expert set) take 30% of the rows
        return [_hot_set(W, T, K, N, torch.randperm(N, generator=gen)[:4], 0.3, gen)]
    if workload == "hotrank":  # one rank's experts take 30% of the rows
        r = int(torch.randint(0, W, (1,), generator=gen))
        return [_hot_set(W, T, K, N, torch.arange(r * E, (r + 1) * E), 0.3, gen)]
    if workload == "idle":  # a quarter of the ranks route nothing
        idle = max(1, W // 4)
        active = torch.randperm(W, generator=gen)[idle:].sort().values
        C = torch.zeros(W, N, dtype=torch.int64)
        C[active] = synthetic_counts(
            RoutingSpec("uniform"), len(active), W * T // len(active), K, N, gen
        )
        return [C]
    if workload == "rotate":  # hotset moving every step
        order = torch.randperm(N, generator=gen)
        return [
            _hot_set(W, T, K, N, order[(4 * t + torch.arange(4)) % N], 0.3, gen) for t in range(4)
        ]
    raise ValueError(workload)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", default="8,64,256")
    p.add_argument("--shapes", default="seeds,deepseek")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--profile", default="h100-ib")
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args()
    profile = load_profile(args.profile)
    fractions, worst, slower = [], (2.0, ""), []
    print(
        "| shape | W | workload | a2a ms | shadow ms | mix ms | mix % fb | imb a2a | imb mix |"
        " reps | plan ms |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape_name in args.shapes.split(","):
        sh = SHAPES[shape_name]
        for W in (int(w) for w in args.worlds.split(",")):
            E = sh.get("per_rank") or max(1, sh["total"] // W)
            N = E * W
            shape = LayerShape(sh["D"], sh["F"], E, W, sh["bytes"], sh["gemms"])
            fb = plan_none(
                counts("uniform", W, args.tokens, sh["K"], N)[0], shape, profile
            ).prediction.step_s
            for wl in args.workloads.split(","):
                res = []
                for C in counts(wl, W, args.tokens, sh["K"], N):
                    a = plan_none(C, shape, profile).prediction.step_s
                    s = plan_shadow(C, shape, profile).prediction.step_s
                    t0 = time.perf_counter()
                    mp = plan_mix(C, shape, profile, 4)
                    dt = time.perf_counter() - t0
                    rows = torch.tensor(mp.prediction.rows, dtype=torch.float64)
                    base_rows = torch.tensor(mp.baseline.rows, dtype=torch.float64)
                    reps = sum(len(h) for _, h in mp.replicas)
                    res.append(
                        (
                            a,
                            s,
                            mp.prediction.step_s,
                            float(base_rows.max() / base_rows.mean()),
                            float(rows.max() / rows.mean()),
                            reps,
                            dt,
                        )
                    )
                a, s, m, ia, im, reps, dt = (statistics.mean(r[i] for r in res) for i in range(7))
                frac = min(1.0, fb / m)
                fractions.append(frac)
                if frac < worst[0]:
                    worst = (frac, f"{shape_name} W={W} {wl}")
                if m > min(a, s) * (1 + 1e-9):
                    slower.append(f"{shape_name} W={W} {wl}")
                print(
                    f"| {shape_name} | {W} | {wl} | {a * 1e3:.2f} | {s * 1e3:.2f} | {m * 1e3:.2f} | "
                    f"{100 * frac:.0f}% | {ia:.2f} | {im:.2f} | {reps:.0f} | {dt * 1e3:.2f} |",
                    flush=True,
                )
    print(
        f"\nmix % of force-balanced: mean {100 * statistics.mean(fractions):.1f}%, worst "
        f"{100 * worst[0]:.1f}% ({worst[1]}); mix slower than a2a or shadow in: {slower or 'none'}"
    )


if __name__ == "__main__":
    main()
