"""A moefy'd GPT-2 and BERT under ``parallelize_moe`` on 2 gloo ranks, ``a2a`` and ``mix``: one
training step's logits, loss (task + aux) and every gradient equal the single-rank model's.

Rank r trains on its own batch r; the single-rank model runs batch 0 and batch 1 one after the
other and accumulates gradients, so dense gradients summed over ranks (what DDP reduces, up to
its averaging) and each rank's expert gradients (already summed over every rank's tokens by the
backward all-to-all) must equal the single-rank model's. Float64: equal to rounding.
"""

from __future__ import annotations

import pytest
import torch
from _hf_models import BUILDERS, F64_TOL, batch, moe_config
from torch.testing import assert_close

from mixmoe.models.moefy import moe_aux, moe_aux_loss, moe_layers, moefy
from mixmoe.parallel import parallelize_moe
from mixmoe.placement.profile import HardwareProfile

pytestmark = pytest.mark.dist

WORLD = 2
NUM_EXPERTS = 4
# compute-starved profile: the cost model replicates hot experts, so mix runs its replica path
REPLICATE = HardwareProfile(
    "test-replicate", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)
# "a2a-built": each rank builds only its own experts (moefy(..., ep_rank, ep_size)), no slicing
CASES = [(f, s) for f in ("gpt2", "bert") for s in ("a2a", "mix")] + [("gpt2", "a2a-built")]


def _build(family: str, ep_rank: int = 0, ep_size: int = 1):
    torch.manual_seed(11)
    model = moefy(
        BUILDERS[family](torch.float64),
        moe_config(NUM_EXPERTS, 2),
        layers="every:2",
        ep_rank=ep_rank,
        ep_size=ep_size,
    )
    # skew the router so that experts of rank 0 are hot (mix then replicates them)
    for _, moe in moe_layers(model):
        with torch.no_grad():
            moe.gate.wg.bias[:2] += 1.0
    return model


def _step(model, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = batch(20 + rank)
    out = model(input_ids=ids, labels=labels)
    loss = out.loss + moe_aux_loss(model)
    loss.backward()
    return out.logits.detach(), loss.detach()


def _worker(comm) -> dict:
    results = {}
    for family, strategy in CASES:
        built = strategy.endswith("-built")
        model = _build(family, comm.rank, comm.world_size) if built else _build(family)
        if built:
            assert all(m.experts.num_experts == NUM_EXPERTS // WORLD for _, m in moe_layers(model))
        for _, moe in moe_layers(model):
            parallelize_moe(moe, comm, strategy.removesuffix("-built"), profile=REPLICATE)
        logits, loss = _step(model, comm.rank)
        grads = {}
        for name, p in model.named_parameters():
            if not getattr(p, "skip_allreduce", False):
                comm.all_reduce(p.grad)  # data-parallel parameters: sum over ranks
            grads[name] = p.grad.clone()
        replicas = sum(int(a.stats["replicas"]) for a in moe_aux(model).values())
        results[family, strategy] = {
            "logits": logits,
            "loss": loss,
            "grads": grads,
            "replicas": replicas,
        }
    return results


def test_moefied_models_train_under_a2a_and_mix_like_one_rank():
    from mixmoe.comm.launch import spawn_gloo

    out = spawn_gloo(_worker, WORLD)
    E = NUM_EXPERTS // WORLD
    for family in ("gpt2", "bert"):
        ref = _build(family)
        ref_steps = [_step(ref, r) for r in range(WORLD)]
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for strategy in [s for f, s in CASES if f == family]:
            for r in range(WORLD):
                got = out[r][family, strategy]
                what = f"{family} {strategy} rank {r}"
                assert_close(got["logits"], ref_steps[r][0], **F64_TOL, msg=what)
                assert_close(got["loss"], ref_steps[r][1], **F64_TOL, msg=what)
                assert set(got["grads"]) == set(ref_grads)
                for name, g in got["grads"].items():
                    want = ref_grads[name]
                    if ".experts." in name:
                        want = want[r * E : (r + 1) * E]
                    assert_close(g, want, **F64_TOL, msg=f"{what}: {name}")
        assert sum(out[r][family, "mix"]["replicas"] for r in range(WORLD)) > 0, family
