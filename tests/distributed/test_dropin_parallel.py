"""The legacy drop-in with world_size > 1: built with all experts, sharded from outside, equal to
the single-device module; the user's scan_expert_func marks survive sharding."""

from __future__ import annotations

import pytest
import torch

from mixmoe import MixMOETransformerMLP
from mixmoe.parallel import parallelize_moe

pytestmark = pytest.mark.dist

D, F, E = 12, 16, 2


def _mark(name, param) -> None:
    param.my_mark = name


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(30 + 20 * rank, D, generator=torch.Generator().manual_seed(rank))


def _worker(comm) -> dict:
    torch.manual_seed(3)
    ffn = MixMOETransformerMLP(
        gate_type={"type": "top", "k": 2},
        experts={"num_local_expert": E, "hidden_size": F, "activation_fn": "relu"},
        model_dim=D,
        world_size=2,
        expert_rank=comm.rank,
        scan_expert_func=_mark,
    )
    x = _inputs(comm.rank)
    try:
        ffn(x)
        unsharded = "no error"
    except ValueError as err:
        unsharded = str(err)
    parallelize_moe(ffn.moe, comm, "mix")
    y = ffn(x)
    marks = {n: getattr(p, "my_mark", None) for n, p in ffn.moe.experts.named_expert_parameters()}
    return {"y": y.detach(), "unsharded": unsharded, "marks": marks, "l_aux": ffn.l_aux is not None}


def test_dropin_world_size_2_matches_single_device() -> None:
    from mixmoe.comm.launch import spawn_gloo

    got = spawn_gloo(_worker, 2)
    torch.manual_seed(3)
    single = MixMOETransformerMLP(
        gate_type={"type": "top", "k": 2},
        experts={"num_local_expert": 2 * E, "hidden_size": F, "activation_fn": "relu"},
        model_dim=D,
    )
    with torch.no_grad():
        ref = single(torch.cat([_inputs(0), _inputs(1)]))
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), ref)
    for g in got:
        assert "parallelize_moe" in g["unsharded"]
        assert g["marks"] == {n: n for n in ("w1", "b1", "w2", "b2")}
        assert g["l_aux"]
