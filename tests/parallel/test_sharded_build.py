"""Experts built for one expert-parallel rank: the same weights as the single-device layer's slice,
1/W of its memory, and clear errors where a layer would silently run something else."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from mixmoe import MixMOETransformerMLP, MoE, MoEConfig
from mixmoe.parallel import parallelize_moe


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(model_dim=12, hidden_dim=20, num_experts=8, top_k=2, **kw)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("world", [2, 4])
def test_shard_holds_the_single_device_weights(world: int, activation: str) -> None:
    seed = int(torch.randint(0, 2**31, (1,)))
    torch.manual_seed(seed)
    full = MoE(_cfg(activation=activation))
    E = 8 // world
    for r in range(world):
        torch.manual_seed(seed)
        shard = MoE(_cfg(activation=activation), ep_rank=r, ep_size=world)
        assert (shard.experts.first_expert, shard.experts.num_global_experts) == (r * E, 8)
        for name, p in shard.experts.named_expert_parameters():
            assert torch.equal(p, getattr(full.experts, name)[r * E : (r + 1) * E]), name
        assert torch.equal(shard.gate.wg.weight, full.gate.wg.weight)
    # and the RNG is left in the same state (the rest of a model initialises identically)
    torch.manual_seed(seed)
    MoE(_cfg())
    after_full = torch.rand(3)
    torch.manual_seed(seed)
    MoE(_cfg(), ep_rank=1, ep_size=world)
    assert torch.equal(torch.rand(3), after_full)


def test_dropin_world_size_4_allocates_a_quarter() -> None:
    def expert_bytes(module) -> int:
        return sum(
            p.numel() * p.element_size() for _, p in module.moe.experts.named_expert_parameters()
        )

    kw = {"gate_type": {"type": "top", "k": 2}, "model_dim": 64}
    full = MixMOETransformerMLP(experts={"num_local_expert": 16, "hidden_size": 128}, **kw)
    for r in range(4):
        part = MixMOETransformerMLP(
            experts={"num_local_expert": 4, "hidden_size": 128}, world_size=4, expert_rank=r, **kw
        )
        assert expert_bytes(part) * 4 == expert_bytes(full)


_PEAK = """
import sys, torch
from mixmoe import MixMOETransformerMLP

def status(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])

W, rank = int(sys.argv[1]), int(sys.argv[2])
torch.zeros(1)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current resident size
before = status("VmRSS:")
MixMOETransformerMLP(gate_type={"type": "top", "k": 2}, model_dim=512,
                     experts={"num_local_expert": 32 // W, "hidden_size": 1024},
                     world_size=W, expert_rank=rank)
print(status("VmHWM:") - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_peak_memory_of_a_rank_is_a_quarter() -> None:
    """Peak resident memory while building (not just what is kept): 32 experts of 2 x 512 x 1024
    float32 = 128 MiB on one device; each of 4 ranks must stay near 32 MiB."""

    def peak_kib(world: int, rank: int) -> int:
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_PEAK), str(world), str(rank)],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.strip().splitlines()[-1])

    full = peak_kib(1, 0)
    sharded = peak_kib(4, 3)
    assert full > 100 * 1024, full  # the full build really allocates its 128 MiB
    assert sharded < 0.4 * full, (sharded, full)


def test_strategy_in_config_without_parallelize_raises() -> None:
    layer = MoE(_cfg(strategy="mix"))
    with pytest.raises(ValueError, match="never parallelized"):
        layer(torch.randn(5, 12))


def test_shard_without_parallelize_raises() -> None:
    layer = MoE(_cfg(), ep_rank=1, ep_size=2)
    with pytest.raises(ValueError, match="parallelize_moe"):
        layer(torch.randn(5, 12))


def test_parallelize_checks_the_rank_a_layer_was_built_for() -> None:
    layer = MoE(_cfg(), ep_rank=1, ep_size=2)
    with pytest.raises(ValueError, match="ep_rank=0"):
        parallelize_moe(layer, SimpleNamespace(rank=0, world_size=2), "a2a")
    with pytest.raises(ValueError, match="not expert-parallel"):
        parallelize_moe(MoE(_cfg()), SimpleNamespace(rank=0, world_size=2), "local")


def test_bad_expert_shards_raise() -> None:
    with pytest.raises(ValueError, match="divisible"):
        MoE(_cfg(), ep_rank=0, ep_size=3)
    with pytest.raises(ValueError, match="ep_rank"):
        MoE(_cfg(), ep_rank=2, ep_size=2)
