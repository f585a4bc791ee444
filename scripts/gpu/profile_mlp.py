"""Where the time goes in one expert-MLP fwd+bwd: torch.profiler kernel table per provider.

Usage (GPU): python scripts/gpu/profile_mlp.py --experts 16 --rows-per-expert 4096 [--block-size 64]
Uses the problem and providers of ``mixmoe bench kernels`` (same tensors, same closures).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mixmoe.bench.kernels import KernelBenchConfig, Point, Problem, _forward_fn, _leaves, _step_fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--rows-per-expert", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--activation", default="gelu")
    p.add_argument("--providers", default="mixmoe,torch-grouped")
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    cfg = KernelBenchConfig(
        rows_per_expert=(a.rows_per_expert,),
        experts=(a.experts,),
        skews=("uniform",),
        dtypes=("bf16",),
        model_dim=1024,
        hidden_size=4096,
        activation=a.activation,
        block_size=a.block_size,
        device="cuda",
    )
    prob = Problem(cfg, Point("bf16", a.experts, a.rows_per_expert, "uniform"))
    for provider in a.providers.split(","):
        t = _leaves(provider, prob)
        step = _step_fn(_forward_fn(provider, prob, cfg, t), t, prob.dy_TD, "fwd+bwd")
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(
            f"\n##### {provider}: E={a.experts} rows/E={a.rows_per_expert} block={a.block_size}"
            " (5 fwd+bwd steps)"
        )
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=70
            )
        )


if __name__ == "__main__":
    main()
