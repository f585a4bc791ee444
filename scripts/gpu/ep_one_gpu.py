"""Expert parallelism on CUDA tensors with one GPU: W gloo processes share the one device.

NCCL refuses two ranks on one GPU, so this runs every strategy over gloo with CUDA tensors
(functional only, no timing): ``a2a``, ``shadow`` and ``mix`` with replicas forced (a
compute-bound profile), background planning on, against the single-rank layer from the same seed:
forward and every gradient, ||got - ref|| / ||ref||. float32 cases are compared with the layer in
float64 on the CPU; bfloat16 cases with the single-rank layer in bfloat16 on the same device (a
float64 reference would count bf16 routing ties, not the strategy), and their expert counts must
agree (a routing flip is reported as such).

    python scripts/gpu/ep_one_gpu.py [--world 2,3] [--device cuda] [--dtypes float32,bfloat16]

Prints one line per case and a summary; exit 1 when any case fails. ``--device cpu`` runs the same
cases on gloo CPU ranks (the script's own check on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import sys

import torch

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.comm.launch import spawn_gloo
from mixmoe.parallel import parallelize_moe
from mixmoe.placement.profile import HardwareProfile

D, F = 128, 256
# replication always pays under this profile, so shadow and mix really fetch replicas
REPLICATE = HardwareProfile(
    "force-replicas", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)
# relative error bounds by dtype: fp32 on the GPU may use tf32 matrix units; bf16: two bf16 runs
TOL = {torch.float64: 1e-9, torch.float32: 5e-3, torch.bfloat16: 5e-2}


def _layer(case: dict, dtype: torch.dtype, device: str) -> MoE:
    torch.manual_seed(case["seed"])
    cfg = MoEConfig(
        model_dim=D,
        hidden_dim=F,
        num_experts=case["experts"],
        top_k=case["top_k"],
        activation=case["activation"],
        gate=GateConfig(type="topk"),
        max_replicas=4,
        plan_async=True,
        plan_ahead=case.get("plan_ahead", False),
    )
    layer = MoE(cfg, dtype=torch.float64)
    with torch.no_grad():  # experts 0 and 1 (both on rank 0) hot: replicas pay
        layer.gate.wg.bias.zero_()
        layer.gate.wg.bias[0] = 2.0
        layer.gate.wg.bias[1] = 1.5
    return layer.to(device=device, dtype=dtype)


def _inputs(case: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"] * 100 + rank)
    T = case["tokens"][rank]
    return torch.randn(T, D, generator=gen, dtype=torch.float64), torch.randn(
        T, D, generator=gen, dtype=torch.float64
    )


def _grads(layer: MoE, x: torch.Tensor, y: torch.Tensor) -> dict:
    out = {"y": y.detach(), "dx": x.grad}
    out["gate_w"], out["gate_b"] = layer.gate.wg.weight.grad, layer.gate.wg.bias.grad
    out.update({f"d{n}": p.grad for n, p in layer.experts.named_expert_parameters()})
    return {k: v.detach().double().cpu() for k, v in out.items()}


def _rank(comm, cases: list[dict], device: str) -> list[dict]:
    if device.startswith("cuda"):
        torch.cuda.set_device(0)
    results = []
    for case in cases:
        try:
            layer = _layer(case, case["dtype"], device)
            parallelize_moe(layer, comm, case["strategy"], profile=REPLICATE)
            layer.dispatcher.check_plans = True  # plans, and the device's C sums, against C
            x, dy = _inputs(case, comm.rank)
            x = x.to(device=device, dtype=case["dtype"]).requires_grad_(True)
            if case.get("plan_ahead"):  # a first step plans afresh; the checked one fits it
                layer(x)[0].sum().backward()
                layer.zero_grad()
                x.grad = None
            y, aux = layer(x)
            (y.double() * dy.to(device)).sum().backward()
            got = _grads(layer, x, y)
            got["fitted"] = bool((aux.stats or {}).get("plan_fitted", False))
            got["replicas"] = int((aux.stats or {}).get("replicas", 0))
            got["shares"] = int((aux.stats or {}).get("shares", 0))
            got["counts"] = aux.counts_N.detach().cpu()
            got["on"] = str(y.device)
            results.append(got)
        except Exception as e:  # noqa: BLE001 - report the case, keep the collectives aligned
            results.append({"error": f"{type(e).__name__}: {e}"})
            break  # a failed rank may have left a collective half done: stop this world
    return results


def _reference(case: dict, world: int, device: str) -> dict:
    dtype = torch.float64 if case["dtype"] != torch.bfloat16 else torch.bfloat16
    device = "cpu" if dtype == torch.float64 else device
    layer = _layer(case, dtype, device)
    xs, dys = zip(*(_inputs(case, r) for r in range(world)), strict=True)
    x = torch.cat(xs).to(device=device, dtype=dtype).requires_grad_(True)
    y, aux = layer(x)
    (y.double() * torch.cat(dys).to(device)).sum().backward()
    out = _grads(layer, x, y)
    out["counts"] = aux.counts_N.detach().cpu()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(case: dict, got: list[dict], world: int, device: str) -> tuple[float, str]:
    ref = _reference(case, world, device)
    if not torch.equal(sum(g["counts"] for g in got), ref.pop("counts")):
        return float("inf"), "expert counts differ from the single-rank layer (routing flip)"
    worst, where = 0.0, ""
    for key in ref:
        if key in ("gate_w", "gate_b"):  # data-parallel gate: the reference sees the summed grad
            mine = sum(g[key] for g in got)
        else:  # rows in rank order; each expert's grad on its owner, replica grads reduced in
            mine = torch.cat([g[key] for g in got])
        err = _rel(mine, ref[key])
        if not err <= worst:  # NaN counts as the worst
            worst, where = err, key
    return worst, where


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default="2,3", help="comma list of 2, 3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--plan-ahead",
        action="store_true",
        help="mix under MoEConfig.plan_ahead: a first step, then the checked one fits its plan",
    )
    args = p.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    failed = 0
    any_fitted: dict[int, bool] = {}  # --plan-ahead: per world, whether some mix step fitted
    for world in (int(w) for w in args.world.split(",")):
        # a rank with zero rows in every world; the hot experts' owner (rank 0) gets rows from others
        tokens = {2: ([130, 300], [0, 300]), 3: ([257, 64, 0], [0, 64, 257])}[world]
        cases = [
            {
                "strategy": strategy,
                "dtype": dtype,
                "top_k": top_k,
                "activation": act,
                "experts": 2 * world,
                "tokens": list(tokens[i % 2]),
                "seed": 7000 + 100 * world + i,
                "plan_ahead": args.plan_ahead and strategy == "mix",
            }
            for i, (strategy, dtype, top_k, act) in enumerate(
                (s, d, k, a)
                for s in ("a2a", "shadow", "mix")
                for d in dtypes
                for k, a in ((2, "gelu"), (1, "swiglu"))
            )
        ]
        per_rank = spawn_gloo(_rank, world, cases, args.device, timeout_s=240)
        for i, case in enumerate(cases):
            got = [
                per_rank[r][i] if i < len(per_rank[r]) else {"error": "not run"}
                for r in range(world)
            ]
            errors = [g["error"] for g in got if "error" in g]
            name = (
                f"W={world} {case['strategy']:6s} {str(case['dtype'])[6:]:8s} "
                f"top{case['top_k']} {case['activation']:6s} tokens={case['tokens']}"
            )
            if errors:
                failed += 1
                print(f"FAIL {name}: {errors[0]}")
                continue
            worst, where = _compare(case, got, world, args.device)
            ok = worst <= TOL[case["dtype"]]
            reps = max(g["replicas"] for g in got)
            shares = max(g["shares"] for g in got)
            if case["strategy"] != "a2a" and reps == 0:
                ok = False
                where += " (no replica used)"
            fitted = all(g["fitted"] for g in got)
            any_fitted[world] = any_fitted.get(world, False) or fitted
            failed += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {name} on={got[0]['on']} replicas={reps} shares={shares} "
                f"{'fitted ' if fitted else ''}max rel err {worst:.2e} ({where})"
            )
        if args.plan_ahead and not any_fitted.get(world):  # the fit's path must have run
            failed += 1
            print(f"FAIL W={world}: no mix case fitted the plan of its first step")
    print(f"ep_one_gpu: {'all passed' if not failed else f'{failed} case(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
