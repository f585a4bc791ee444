"""Per-tensor errors of the grouped-GEMM path vs the Triton kernels and the CPU fp32 reference, on
the shapes of test_gpu.py's compile and fused-MLP tests (GPU). Usage: python scripts/gpu/diag_grouped.py"""

from __future__ import annotations

import os

import torch

from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.gating.synthetic import RoutingSpec, synthetic_ids
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.token_expert_mlp import token_expert_mlp


def case(name, T, K, N, D, F, skew, activation, bias, w3):
    ids = synthetic_ids(RoutingSpec.parse(skew), T, K, N, torch.Generator().manual_seed(2))
    lay_cuda = expert_row_layout(ids.cuda(), N, 64)
    lay_cpu = expert_row_layout(ids, N, 64)
    g = torch.Generator().manual_seed(3)
    cpu = {
        "x": torch.randn(T, D, generator=g),
        "g": torch.rand(T, K, generator=g),
        "w1": torch.randn(N, D, F, generator=g) * D**-0.5,
        "w2": torch.randn(N, F, D, generator=g) * F**-0.5,
    }
    if bias:
        cpu["b1"], cpu["b2"] = torch.randn(N, F, generator=g), torch.randn(N, D, generator=g)
    if w3:
        cpu["w3"] = torch.randn(N, D, F, generator=g) * D**-0.5
    dy = torch.randn(T, D, generator=g)

    def run(device, dtype, mode, fused=True):
        os.environ["MIXMOE_GROUPED_MM"] = mode
        t = {
            k: v.to(device, dtype if k != "g" else v.dtype).requires_grad_() for k, v in cpu.items()
        }
        lay = lay_cuda if device == "cuda" else lay_cpu
        ew = ExpertWeights(t["w1"], t["w2"], t.get("b1"), t.get("b2"), t.get("w3"))
        y = token_expert_mlp(
            t["x"], lay.token_P, lay.pos_TK, t["g"], ew, lay.schedule, activation, fused=fused
        )
        gr = torch.autograd.grad(y, list(t.values()), dy.to(device, y.dtype))
        return {"y": y, **{"d" + k: v for k, v in zip(t, gr, strict=True)}}, type(
            y.grad_fn
        ).__name__

    ref, _ = run("cpu", torch.float32, "1", fused=False)
    grp, pg = run("cuda", torch.bfloat16, "1")
    tri, pt = run("cuda", torch.bfloat16, "0")
    print(f"## {name}: grouped={pg} triton={pt}")
    for k in ref:
        r = ref[k].double()
        eg = (grp[k].double().cpu() - r).abs().max().item()
        et = (tri[k].double().cpu() - r).abs().max().item()
        print(
            f"{k:4s} max|ref| {r.abs().max().item():9.3g}  err grouped {eg:9.3g}  err triton {et:9.3g}"
        )


case("compile-test shape", 512, 2, 4, 128, 256, "uniform", "gelu", False, False)
case("fused-test shape", 2048, 2, 8, 512, 1024, "zipf:1.2", "swiglu", True, True)
case("fused-test shape gelu", 2048, 2, 8, 512, 1024, "zipf:1.2", "gelu", True, False)
