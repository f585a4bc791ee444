"""Shared pieces of the distributed tests: building identical layers on every rank and in the
parent (the single-rank reference), and the per-rank inputs."""

from __future__ import annotations

import torch

from mixmoe import GateConfig, MoE, MoEConfig

D, F = 12, 20


def make_config(case: dict) -> MoEConfig:
    return MoEConfig(
        model_dim=D,
        hidden_dim=F,
        num_experts=case["num_experts"],
        top_k=case["top_k"],
        activation=case.get("activation", "gelu"),
        gate=GateConfig(type=case.get("gate", "topk")),
        block_size=case.get("block_size", 16),
        max_replicas=case.get("max_replicas", 4),
        plan_async=case.get("plan_async", True),
        plan_ahead=case.get("plan_ahead", False),
    )


def make_layer(case: dict) -> MoE:
    """Same seed, same parameters everywhere; ``skew`` biases the gate towards experts 0 (and 1)."""
    torch.manual_seed(case["seed"])
    layer = MoE(make_config(case), dtype=case["dtype"])
    skew = case.get("skew")
    with torch.no_grad():
        if skew == "one":  # every row wants expert 0
            layer.gate.wg.weight.mul_(0.01)
            layer.gate.wg.bias.zero_()
            layer.gate.wg.bias[0] = 50.0
            layer.gate.wg.bias[1] = 25.0
        elif skew == "hot":  # experts 0 and 1 (both on rank 0) hot, others still used
            layer.gate.wg.bias.zero_()
            layer.gate.wg.bias[0] = 2.0
            layer.gate.wg.bias[1] = 1.5
    return layer


def rank_inputs(case: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"] * 100 + rank)
    T = case["tokens"][rank]
    x = torch.randn(T, D, generator=gen, dtype=torch.float64).to(case["dtype"])
    dy = torch.randn(T, D, generator=gen, dtype=torch.float64).to(case["dtype"])
    return x, dy
