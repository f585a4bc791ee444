"""``mixmoe_mix`` under transformers' expert parallelism when the experts module's version cannot
be read (``sharded_parameters_version`` returns None: not an FSDP2 unit, or a torch whose FSDP2
internals are not the ones ``mixmoe.comm.fsdp`` reads): no version then tells the replica cache
that an optimizer step changed the owners' weights (FSDP2 refills the unsharded weights in place
and preserves their version counters), so ``MixmoeEP`` must refetch the replicas on every call
(``invalidate_replicas``, ``mixmoe.hf.ep``). A no-op planted there passed the whole suite once:
every other transformers EP test reads a version that the optimizer step changes.

transformers only shards experts with FSDP2 on (``ep_size`` must divide ``fsdp_size``), so the
unreadable case is made by replacing ``mixmoe.hf.ep.sharded_parameters_version`` with one that
returns None in the spawned ranks. Two gloo ranks, FSDP 2 x EP 2, a tiny Mixtral with a router
skewed so hard that the compute-bound planner replicates, the same batches every step and the
dense parameters frozen (lr 0): the replica plan repeats step after step while the experts train,
so a cache that survived an optimizer step would serve the weights of the step before. Control:
transformers' own ``all_to_all`` on the same ranks, data and steps; per-rank losses and every
parameter's gradient must match it after every AdamW step.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import mixmoe.hf.ep as hf_ep  # noqa: E402
from mixmoe.bench.hf import HFModelShape, load_model, save_random_model, skew_router  # noqa: E402
from mixmoe.comm.launch import spawn_gloo  # noqa: E402
from mixmoe.placement.profile import HardwareProfile  # noqa: E402

pytestmark = pytest.mark.dist

COMPUTE_BOUND = HardwareProfile(
    "test-refetch", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)
IMPLS = ("all_to_all", "mixmoe_mix_replicate")
STEPS, BATCH, SEQ, LR = 2, 2, 12, 1e-2  # step 1 is the first after an optimizer step
LOSS_TOL = {"rtol": 2e-5, "atol": 2e-5}
GRAD_RTOL = 1e-3
SHAPE = HFModelShape(
    family="mixtral",
    hidden_size=16,
    intermediate_size=24,
    num_experts=4,
    top_k=2,
    layers=1,
    vocab_size=64,
    heads=2,
)


def _full(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's whole gradient (DTensor shards gathered: collective on every rank)."""
    if grad is None:
        return None
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _rank(comm, path: str, batches: list[torch.Tensor]) -> dict:
    hf_ep.register_ep_implementation("mixmoe_mix_replicate", "mix", profile=COMPUTE_BOUND)
    hf_ep.sharded_parameters_version = lambda module: None  # this process only: a spawned rank
    ids = batches[comm.rank]
    out = {}
    for impl in IMPLS:
        model = load_model(path, impl, ep_size=comm.world_size, fsdp_size=comm.world_size)
        model.train()
        skew_router(model, 1, 12.0)
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        dense = [p for n, p in model.named_parameters() if ".experts." not in n]
        opt = torch.optim.AdamW([{"params": experts, "lr": LR}, {"params": dense, "lr": 0.0}])
        losses, grads, stats = [], [], []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            stats.append([dict(ep.last_stats) for ep in hf_ep.ep_implementations(model)])
        out[impl] = {"losses": losses, "grads": grads, "stats": stats}
    return out


def test_mix_refetches_replicas_every_call_without_a_version():
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, SHAPE.vocab_size, (BATCH, SEQ), generator=gen) for _ in range(2)]
    with tempfile.TemporaryDirectory(prefix="mixmoe-hf-refetch-") as path:
        save_random_model(SHAPE, path, seed=3)
        got = spawn_gloo(_rank, 2, path, batches, timeout_s=240)
    for r, per_rank in enumerate(got):
        base, mix = per_rank["all_to_all"], per_rank["mixmoe_mix_replicate"]
        # the numbers first: a stale replica shows in the step after an optimizer step
        for s in range(STEPS):
            for name, ref in base["grads"][s].items():
                assert_close(
                    mix["grads"][s][name],
                    ref,
                    rtol=GRAD_RTOL,
                    atol=GRAD_RTOL * float(ref.abs().max()),
                    msg=lambda m, r=r, s=s, n=name: f"rank {r} step {s} grad {n}: {m}",
                )
        assert_close(
            torch.tensor(mix["losses"], dtype=torch.float64),
            torch.tensor(base["losses"], dtype=torch.float64),
            **LOSS_TOL,
            msg=lambda m, r=r: f"rank {r} losses: {m}",
        )
        for s, layers in enumerate(mix["stats"]):
            # replicated every step (the same plan), never served from the cache
            assert all(st["replicas"] > 0 for st in layers), f"rank {r} step {s}: {layers}"
            assert not any(st["replica_cached"] for st in layers), f"rank {r} step {s}: {layers}"
