"""``mixmoe.parallel`` in one process: ``load_full_state_dict`` gives each rank exactly its slice of a
full checkpoint (nested and top-level layers), ``parallelize_moe`` slices, marks and installs the
strategy without losing user marks, and the mark / ignore lists DDP reads are complete. (The
collective parts, ``gather_full_state_dict`` and ``average_expert_gradients`` across ranks, are in
tests/distributed.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mixmoe import MoE, MoEConfig
from mixmoe.comm import LocalCommunicator
from mixmoe.dispatch.expert_parallel import ExpertParallelDispatcher
from mixmoe.parallel import (
    average_expert_gradients,
    expert_parameters,
    load_full_state_dict,
    mark_expert_parameters,
    parallelize_moe,
)
from mixmoe.placement.profile_io import load_profile

N = 8


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(model_dim=6, hidden_dim=10, num_experts=N, top_k=2, **kw)


class _Block(nn.Module):
    """A model holding the MoE one level down: expert keys carry the prefix ``moe.``."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.moe = moe


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_load_full_state_dict_gives_each_rank_its_slice(nested, world, activation):
    torch.manual_seed(0)
    full = MoE(_cfg(activation=activation))
    full_model = _Block(full) if nested else full
    state = {k: v.clone() for k, v in full_model.state_dict().items()}
    prefix = "moe." if nested else ""
    E = N // world
    for r in range(world):
        torch.manual_seed(100 + r)  # different init: every tensor must come from the checkpoint
        shard = MoE(_cfg(activation=activation), ep_rank=r, ep_size=world)
        model = _Block(shard) if nested else shard
        load_full_state_dict(model, state)
        got = model.state_dict()
        assert sorted(got) == sorted(state)
        for key, tensor in state.items():
            want = tensor
            if key.startswith(prefix + "experts."):
                want = tensor[r * E : (r + 1) * E]
            torch.testing.assert_close(got[key], want, rtol=0, atol=0, msg=f"rank {r} {key}")
    assert state.keys() == full_model.state_dict().keys()  # the caller's dict is not modified
    with pytest.raises(ValueError, match="holds 4 experts"):
        load_full_state_dict(
            MoE(_cfg(activation=activation)),
            {k[len(prefix) :]: v[:4] if "experts." in k else v for k, v in state.items()},
        )
    with pytest.raises(KeyError, match="experts.w1"):
        load_full_state_dict(_Block(MoE(_cfg())), {"moe.experts.b1": state[prefix + "experts.b1"]})


def test_parallelize_moe_slices_marks_and_keeps_user_marks():
    torch.manual_seed(1)
    layer = MoE(_cfg(strategy="mix"))
    full = {n: p.detach().clone() for n, p in layer.experts.named_expert_parameters()}
    layer.experts.w1.user_mark = "scan"  # set by the user before sharding
    model = _Block(layer)
    model._ddp_params_and_buffers_to_ignore = ["proj.bias"]
    got = parallelize_moe(layer, SimpleNamespace(rank=1, world_size=4), profile="cpu")
    assert got is layer
    experts = layer.experts
    assert (experts.num_experts, experts.first_expert, experts.num_global_experts) == (2, 2, N)
    for n, p in experts.named_expert_parameters():
        torch.testing.assert_close(p.detach(), full[n][2:4], rtol=0, atol=0, msg=n)
        assert p.skip_allreduce is True and p.requires_grad, n
    assert experts.w1.user_mark == "scan"
    assert isinstance(layer.dispatcher, ExpertParallelDispatcher)
    assert layer.dispatcher.name == "mix" and layer.dispatcher.experts_per_rank == 2
    assert layer.dispatcher.profile == load_profile("cpu")  # a preset name is resolved
    assert not hasattr(layer.gate.wg.weight, "skip_allreduce")
    expert_names = [n for n, _ in expert_parameters(model)]
    assert expert_names == [f"moe.experts.{n}" for n, _ in experts.named_expert_parameters()]
    assert mark_expert_parameters(model) == expert_names
    assert model._ddp_params_and_buffers_to_ignore == sorted(["proj.bias", *expert_names])
    assert layer._ddp_params_and_buffers_to_ignore == sorted(
        f"experts.{n}" for n, _ in experts.named_expert_parameters()
    )
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize_moe(layer, SimpleNamespace(rank=1, world_size=4))


def test_parallelize_moe_strategy_argument_wins_over_the_config():
    layer = parallelize_moe(MoE(_cfg(strategy="mix")), SimpleNamespace(rank=0, world_size=2), "a2a")
    assert layer.dispatcher.name == "a2a" and layer.dispatcher.profile is None


def test_average_expert_gradients_of_a_world_of_one_leaves_them():
    layer = MoE(_cfg())
    for _, p in expert_parameters(layer):
        p.grad = torch.full_like(p, 3.0)
    layer.experts.b1.grad = None  # parameters without a gradient are skipped
    average_expert_gradients(layer, LocalCommunicator())
    for n, p in expert_parameters(layer):
        if n != "experts.b1":
            torch.testing.assert_close(p.grad, torch.full_like(p, 3.0))
    assert layer.experts.b1.grad is None


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_parallelize_moe_takes_a_layer_built_for_its_rank(rank):
    """A layer built with ``MoE(config, ep_rank=r, ep_size=W)`` is parallelized as it is (the
    same experts, nothing sliced or reallocated) on rank r, and refused on any other rank."""
    torch.manual_seed(2)
    layer = MoE(_cfg(), ep_rank=rank, ep_size=4)
    before = {n: p for n, p in layer.experts.named_expert_parameters()}
    got = parallelize_moe(layer, SimpleNamespace(rank=rank, world_size=4), "a2a")
    experts = got.experts
    assert (experts.num_experts, experts.first_expert) == (N // 4, rank * N // 4)
    assert all(p is before[n] for n, p in experts.named_expert_parameters())
    assert isinstance(got.dispatcher, ExpertParallelDispatcher)
    other = (rank + 1) % 4
    with pytest.raises(ValueError, match=f"ep_rank={other}"):
        parallelize_moe(
            MoE(_cfg(), ep_rank=rank, ep_size=4), SimpleNamespace(rank=other, world_size=4), "a2a"
        )
