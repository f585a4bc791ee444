"""What leveling the rows computed per rank costs the mixed strategy's step, by the cost model.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/rows_tradeoff.py \
        [--cases seeds:64:zipf:1.2,deepseek:8:hotrank:0.5] [--speedups 1,1.5,2,3,4,8,16,10000] \
        [--tolerances 0.01,0.03,0.1] [--profile NAME]

Legend: W ranks; rows imbalance = max / mean over ranks of the rows computed after the plan
(``bench balance``'s "imbalance"); step: the plan's predicted step (``bench balance``'s
"step_ms").

``plan_mix`` levels each rank's predicted seconds, not its rows: a rank that sends fewer rows
(an idle rank, a hot expert's owner) computes more in the same time. To see what leveling rows
would cost, each case (``bench balance``'s shapes, W, workloads and seed; the first step of a
workload that has several) is planned by ``mix`` under its profile with every link k times
faster (bandwidths times k, latencies over k; k = 1: the profile itself, the plan ``bench
balance`` reports), and each plan is priced under the profile itself (``predict_plan``). A large
k plans as if transfers were free, which levels the rows. Printed per case, a Markdown row: the
real plan's rows imbalance and step, the lowest rows imbalance among the plans whose step is
within each tolerance of the real plan's, and the largest k's rows imbalance and step change.
These plans are points the planner can make, not the best trade-off a planner aiming at both
could find: an upper bound on what a given rows imbalance costs.
"""

from __future__ import annotations

import argparse
import dataclasses

from mixmoe.gating.imbalance import check_workload
from mixmoe.placement.cost_model import predict_plan
from mixmoe.placement.profile_io import load_profile
from mixmoe.simulate.workloads import (
    BalanceConfig,
    first_step_mix,
    layer_shape,
    profile_name,
    shape_spec,
)

CASES = (
    "seeds:64:zipf:1.2,seeds:64:zipf:2.0,seeds:64:hotset:8:0.5,seeds:256:zipf:1.2,"
    "seeds:256:zipf:2.0,seeds:256:hotset:8:0.5,deepseek:8:hotrank:0.5,deepseek:64:zipf:1.2,"
    "deepseek:64:zipf:2.0,deepseek:64:idle:0.25,deepseek:256:zipf:1.2,deepseek:256:zipf:2.0,"
    "deepseek:256:idle:0.25"
)  # bench balance's one-link cases whose rows imbalance exceeds 1.10 (rotate: hotset's first step)


def faster(profile, k: float):
    """``profile`` with every link ``k`` times faster (itself at k = 1)."""
    if k == 1:
        return profile
    changes = {
        "link_bandwidth": profile.link_bandwidth * k,
        "link_latency": profile.link_latency / k,
    }
    if profile.inter_node_bandwidth is not None:
        changes["inter_node_bandwidth"] = profile.inter_node_bandwidth * k
    if profile.inter_node_latency is not None:
        changes["inter_node_latency"] = profile.inter_node_latency / k
    return dataclasses.replace(profile, name=f"{profile.name} links x{k:g}", **changes)


def rows_imbalance(rows_W) -> float:
    return max(rows_W) * len(rows_W) / sum(rows_W)


def case_points(cfg: BalanceConfig, shape: str, world_size: int, workload: str, speedups):
    """(step ms, rows imbalance) of the mix plan made with the links ``k`` times faster, priced
    under the case's profile, for each k of ``speedups``."""
    layer, profile, C_WN, mix = first_step_mix(cfg, shape, world_size, workload)
    points = []
    for k in speedups:
        plan = mix(faster(profile, k))
        priced = predict_plan(C_WN, plan, layer, profile, True)
        points.append((1e3 * priced.step_s, rows_imbalance(priced.rows)))
    return points


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        msg = f"{name} must be comma-separated numbers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="shape:W:workload, comma-separated")
    ap.add_argument("--speedups", default="1,1.5,2,3,4,8,16,10000")
    ap.add_argument("--tolerances", default="0.01,0.03,0.1")
    ap.add_argument(
        "--profile", default=None, help="a profile for every W (default: bench balance's)"
    )
    args = ap.parse_args(argv)
    try:
        speedups = _floats(args.speedups, "--speedups")
        tolerances = _floats(args.tolerances, "--tolerances")
        if speedups[0] != 1 or any(k < 1 for k in speedups):
            raise argparse.ArgumentTypeError(f"--speedups must start at 1, each >= 1: {speedups}")
        if any(t < 0 for t in tolerances):
            raise argparse.ArgumentTypeError(f"--tolerances must be >= 0: {tolerances}")
        cases = []
        for case in args.cases.split(","):
            parts = case.split(":", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                raise argparse.ArgumentTypeError(
                    f"case {case!r} is not shape:W:workload (W an int)"
                )
            shape, world, workload = parts
            spec = shape_spec(shape)
            layer = layer_shape(spec, int(world))
            check_workload(workload, int(world), spec.top_k, layer.num_experts)
            cases.append((shape, int(world), workload))
        cfg = BalanceConfig(profile=args.profile)
        for world in {w for _, w, _ in cases}:
            load_profile(profile_name(cfg, world))
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    head = " | ".join(f"rows within +{100 * t:g}%" for t in tolerances)
    print(
        f"| shape | W | workload | rows | step ms | {head} | links x{speedups[-1]:g}: rows (step) |"
    )
    print("|---|---:|---|---:|---:|" + "---:|" * len(tolerances) + "---|")
    for shape, world, workload in cases:
        points = case_points(cfg, shape, world, workload, speedups)
        step0, rows0 = points[0]
        best = [min(r for s, r in points if s <= step0 * (1 + t)) for t in tolerances]
        step_k, rows_k = points[-1]
        within = " | ".join(f"{r:.2f}" for r in best)
        print(f"| {shape} | {world} | {workload} | {rows0:.2f} | {step0:.3f} | {within} | "
              f"{rows_k:.2f} ({100 * (step_k / step0 - 1):+.1f}%) |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
