"""mixmoe's MoE layer vs Hugging Face's Mixtral sparse-MoE block on the same work (GPU).

Same weights (Mixtral's router, gate_up_proj and down_proj copied into a mixmoe layer with a
bias-free top-k gate, softmax-then-renormalise, SwiGLU, no expert bias), same input, forward +
backward of the output. Providers, timed interleaved (each iteration runs every provider once):

    mixmoe         MoE(local strategy): Triton grouped GEMMs over the 64-row block layout
    hf-grouped_mm  MixtralSparseMoeBlock with experts implementation "grouped_mm"
    hf-eager       the same block with the per-expert loop (experts <= 16 only)
    dense          one SwiGLU MLP (3 GEMMs) over all T*K rows: the same FLOPs without routing

Medians of CUDA-event times after warm-up. Usage:
    python scripts/gpu/hf_mixtral_vs_mixmoe.py --experts 4,16,64 [--tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


def build(E: int, D: int, Fh: int, K: int, dtype: torch.dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from mixmoe import GateConfig, MoE, MoEConfig

    cfg = MixtralConfig(
        hidden_size=D, intermediate_size=Fh, num_local_experts=E, num_experts_per_tok=K
    )
    torch.manual_seed(0)
    hf = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        hf.gate.weight.normal_(0, D**-0.5)
        hf.experts.gate_up_proj.normal_(0, D**-0.5)
        hf.experts.down_proj.normal_(0, Fh**-0.5)
    hf = hf.to("cuda", dtype)
    mcfg = MoEConfig(
        model_dim=D,
        hidden_dim=Fh,
        num_experts=E,
        top_k=K,
        activation="swiglu",
        bias=False,
        gate=GateConfig(type="topk", normalize="softmax_renorm", bias=False),
        aux_loss_coef=0.0,
    )
    mm = MoE(mcfg, device="cuda", dtype=dtype)
    with torch.no_grad():
        gu = hf.experts.gate_up_proj  # [E, 2F, D]: gate rows first, then up
        mm.gate.wg.weight.copy_(hf.gate.weight)
        mm.experts.w1.copy_(gu[:, :Fh, :].transpose(1, 2))
        mm.experts.w3.copy_(gu[:, Fh:, :].transpose(1, 2))
        mm.experts.w2.copy_(hf.experts.down_proj.transpose(1, 2))
    return hf, mm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", default="4,16,64")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--model-dim", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    dtype, T, D, Fh, K = torch.bfloat16, a.tokens, a.model_dim, a.hidden_size, a.top_k
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16, T={T} D={D} F={Fh} "
        f"top-{K}; fwd+bwd medians of {a.repeats} after {a.warmup} warm-up (CUDA events)"
    )
    rows = []
    for E in (int(e) for e in a.experts.split(",")):
        hf, mm = build(E, D, Fh, K, dtype)
        x = torch.randn(1, T, D, device="cuda", dtype=dtype)
        dy = torch.randn(1, T, D, device="cuda", dtype=dtype)
        w_dense = [torch.randn(D, Fh, device="cuda", dtype=dtype) * D**-0.5 for _ in range(2)]
        w_dense.append(torch.randn(Fh, D, device="cuda", dtype=dtype) * Fh**-0.5)
        w_dense = [w.requires_grad_() for w in w_dense]
        x_rows = torch.randn(T * K, D, device="cuda", dtype=dtype)

        def run_hf(impl):
            def f():
                hf.experts.config._experts_implementation = impl
                xi = x.detach().requires_grad_()
                y = hf(xi)
                y.backward(dy)
                return y

            return f

        def run_mixmoe():
            xi = x.detach().requires_grad_()
            y, _ = mm(xi)
            y.backward(dy)
            return y

        def run_dense():
            xi = x_rows.detach().requires_grad_()
            h = F.silu(xi @ w_dense[0]) * (xi @ w_dense[1])
            y = h @ w_dense[2]
            y.backward(torch.ones_like(y))
            return y

        providers = {"mixmoe": run_mixmoe, "hf-grouped_mm": run_hf("grouped_mm")}
        if E <= 16:
            providers["hf-eager"] = run_hf("eager")
        providers["dense"] = run_dense
        # correctness first: same forward (both bf16; relative Frobenius error)
        with torch.no_grad():
            hf.experts.config._experts_implementation = "grouped_mm"
            y_hf = hf(x).float()
            y_mm = mm(x)[0].float()
        rel = ((y_mm - y_hf).norm() / y_hf.norm()).item()
        assert rel < 2e-2, f"E={E}: mixmoe vs hf forward relative error {rel:.3g}"
        times = {n: [] for n in providers}
        for i in range(a.warmup + a.repeats):
            for name, f in providers.items():
                for prm in [*hf.parameters(), *mm.parameters(), *w_dense]:
                    prm.grad = None
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                f()
                end.record()
                torch.cuda.synchronize()
                if i >= a.warmup:
                    times[name].append(start.elapsed_time(end))
        med = {n: statistics.median(t) for n, t in times.items()}
        flops = 3 * 2.0 * T * K * D * Fh * 3  # 3 GEMMs, fwd + bwd = 3x fwd
        for name, ms in med.items():
            rows.append(
                (
                    E,
                    name,
                    ms,
                    flops / ms / 1e9,
                    med["hf-grouped_mm"] / ms,
                    100 * med["dense"] / ms,
                    rel,
                )
            )
        del hf, mm
        torch.cuda.empty_cache()
    print(
        f"{'E':>3} {'provider':>14} {'ms':>8} {'TFLOP/s':>8} {'vs hf-grouped_mm':>17}"
        f" {'% of dense':>10} {'fwd rel err':>11}"
    )
    for E, name, ms, tf, ratio, dense_pct, rel in rows:
        print(
            f"{E:>3} {name:>14} {ms:>8.3f} {tf:>8.1f} {ratio:>16.2f}x {dense_pct:>10.1f}"
            f" {rel:>11.2e}"
        )


if __name__ == "__main__":
    main()
