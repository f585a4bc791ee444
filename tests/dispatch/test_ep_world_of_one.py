"""Expert parallelism over a world of one (``LocalCommunicator``, e.g. a 1-process torchrun): every
strategy runs the expert-parallel engine with nothing to move and nothing to replicate, and equals
the single-device layer built from the same seed, forward and every gradient, over two steps (the
second after an optimizer step, so the weights' version changes)."""

from __future__ import annotations

import pytest
import torch

from mixmoe import MoE, MoEConfig
from mixmoe.comm import LocalCommunicator
from mixmoe.parallel import parallelize_moe


def _layer(seed: int) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, top_k=2, block_size=16)
    return MoE(cfg, dtype=torch.float64)


def _steps(layer: MoE) -> list[dict]:
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(2):
        x = torch.randn(19, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        dy = torch.randn(19, 8, generator=gen, dtype=torch.float64)
        y, aux = layer(x)
        opt.zero_grad()
        (y * dy).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        out.append({"y": y.detach(), "dx": x.grad, "stats": aux.stats, **grads})
        opt.step()
    return out


@pytest.mark.parametrize("strategy", ["a2a", "shadow", "mix"])
def test_expert_parallel_over_one_rank_is_the_single_device_layer(strategy):
    want = _steps(_layer(3))
    got = _steps(parallelize_moe(_layer(3), LocalCommunicator(), strategy))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["stats"]["rows_moved"] == 0 and g["stats"]["replicas"] == 0, g["stats"]
        assert g["stats"]["replica_cached"] is False, g["stats"]  # nothing was fetched
        for key in [k for k in w if k != "stats"]:
            torch.testing.assert_close(g[key], w[key], rtol=1e-12, atol=1e-12, msg=(step, key))
