"""Where the time goes in one expert-MLP fwd+bwd: torch.profiler kernel table per provider.

Usage (GPU): python scripts/gpu/profile_mlp.py --experts 16 --rows-per-expert 4096 [--block-size 64]
Uses the problem and providers of ``mixmoe bench kernels`` (same tensors, same closures).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mixmoe.bench.kernel_providers import Problem, forward_fn, leaves, step_fn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--rows-per-expert", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--activation", default="gelu")
    p.add_argument("--providers", default="mixmoe,torch-grouped")
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    prob = Problem(
        dtype="bf16",
        experts=a.experts,
        rows_per_expert=a.rows_per_expert,
        skew="uniform",
        top_k=2,
        model_dim=1024,
        hidden_size=4096,
        activation=a.activation,
        block_size=a.block_size,
        device="cuda",
        seed=0,
    )
    for provider in a.providers.split(","):
        t = leaves(provider, prob)
        step = step_fn(forward_fn(provider, prob, a.activation, t), t, prob.dy_TD, "fwd+bwd")
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
