"""mixmoe's strategies as transformers EP implementations, trained under transformers' own
FSDP x EP (``from_pretrained(..., distributed_config=DistributedConfig(ep_size=W, fsdp_size=W,
ep_implementation=NAME))``, tp_size=1) on W gloo ranks.

Reference: the same saved model in ONE process with transformers' own experts (no mixmoe code),
fed every rank's batch, stepping AdamW on the mean of the ranks' losses (FSDP averages the
gradients over the W data-parallel ranks). Per-rank losses of every step must equal the
reference's loss on that rank's batch to ``LOSS_TOL``, for every ``mixmoe*`` implementation and
transformers' ``all_to_all`` (the control), with a router skewed so hard that one expert takes
about half of all slots: ``shadow`` and ``mix`` (planned for a compute-bound device) must then
have replicated (read from the implementations' dispatcher stats), so replica weights and their
gradients through FSDP are covered. Many experts get zero rows on some ranks (every collective is still joined). The same
batches every step with the dense parameters frozen make the replica plans repeat while the
experts train, so a stale replica cache fails here (it did: FSDP preserves the weights' version
counters, see ``mixmoe.hf.ep``). ep_size < world: world 4, ep 2 (efsdp 2), one tiny layer.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from mixmoe.bench.hf import (  # noqa: E402
    HFModelShape,
    load_model,
    save_random_model,
    skew_router,
)
from mixmoe.comm.launch import spawn_gloo  # noqa: E402
from mixmoe.hf.ep import ep_implementations, register_ep_implementation  # noqa: E402
from mixmoe.placement.profile import HardwareProfile  # noqa: E402

pytestmark = pytest.mark.dist

# mixmoe_mix_replicate: mix planned for a compute-bound device (replication always pays), so
# that the tiny model really trains through replicas; the registered mixmoe_mix plans with the
# CPU profile, by which a 32-wide expert is never worth copying
MIXMOE_IMPLS = ("mixmoe_a2a", "mixmoe_shadow", "mixmoe_mix", "mixmoe_mix_replicate",
                "mixmoe_mix_ahead")  # fmt: skip
IMPLS = ("all_to_all",) + MIXMOE_IMPLS
# ep_size < world: the control and each strategy once, shadow and mix replicating
SMALL_IMPLS = ("all_to_all", "mixmoe_a2a", "mixmoe_shadow_replicate", "mixmoe_mix_replicate")
COMPUTE_BOUND = HardwareProfile(
    "test-replicate", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)
STEPS, BATCH, SEQ, LR = 3, 2, 12, 1e-2
HOT_EXPERT, HOT_BIAS = 1, 12.0
# float32 losses after 3 AdamW steps; summation orders differ between the experts paths
LOSS_TOL = {"rtol": 2e-5, "atol": 2e-5}
# float32 gradients summed over ranks in another order; atol: GRAD_RTOL times the largest entry
# of the reference gradient (a lost replica gradient is off by ~1e4 times that)
GRAD_RTOL = 1e-3


def _shape(family: str) -> HFModelShape:
    return HFModelShape(
        family=family,
        hidden_size=32,
        intermediate_size=48,
        num_experts=6,
        top_k=2,
        layers=2,
        vocab_size=64,
        heads=2,
    )


def _data(world: int) -> list[list[torch.Tensor]]:
    """[step][rank] token ids [BATCH, SEQ]: the same batches every step (see ``_optimizer``)."""
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (BATCH, SEQ), generator=gen) for _ in range(world)]
    return [batches] * STEPS


def _optimizer(model) -> torch.optim.AdamW:
    """AdamW on the experts; the dense parameters (router included) get lr 0, so that with the
    same batches every step the first layer's routing, and its replica plan, repeat exactly
    while the expert weights change: a replica cache that missed an optimizer step would be
    reused, and the gradients would show it. Every parameter's gradient is still compared."""
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    return torch.optim.AdamW([{"params": experts, "lr": LR}, {"params": dense, "lr": 0.0}])


def _full(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's whole gradient (DTensor shards gathered: collective on every rank)."""
    if grad is None:
        return None
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _step(model, opt, batch_losses) -> tuple[list[float], dict]:
    """Backward of the mean of ``batch_losses``, every parameter's whole gradient, AdamW step."""
    torch.stack(batch_losses).mean().backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in batch_losses], grads


def _rank(comm, path: str, data, ep_size: int | None = None, impls=IMPLS) -> dict:
    """Every implementation trained on this rank's batches under FSDP (the world) x EP
    (``ep_size``, default the world)."""
    register_ep_implementation("mixmoe_mix_replicate", "mix", profile=COMPUTE_BOUND)
    register_ep_implementation("mixmoe_shadow_replicate", "shadow", profile=COMPUTE_BOUND)
    register_ep_implementation("mixmoe_mix_ahead", "mix", profile=COMPUTE_BOUND, plan_ahead=True)
    W, out = comm.world_size, {}
    for impl in impls:
        model = load_model(path, impl, ep_size=ep_size or W, fsdp_size=W)
        model.train()
        skew_router(model, HOT_EXPERT, HOT_BIAS)
        opt = _optimizer(model)
        losses, grads = [], []
        for step in data:
            ids = step[comm.rank]
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            (step_loss,), step_grads = _step(model, opt, [loss])
            losses.append(step_loss)
            grads.append(step_grads if comm.rank == 0 else None)
        eps = ep_implementations(model)
        out[impl] = {
            "losses": losses,
            "grads": grads,
            "replicas": [sum(ep.replicas_seen for ep in eps)],
            "fitted": sum(ep.plans_fitted for ep in eps),
            "waited_ms": sum(ep.plan_wait_ms for ep in eps),
            "ep_modules": len(eps),
        }
    return out


def _reference(path: str, data) -> tuple[list[list[float]], list[dict]]:
    """[step][rank] losses and [step] gradients of the single-process run."""
    model = load_model(path, None, 1, 1)
    model.train()
    skew_router(model, HOT_EXPERT, HOT_BIAS)
    opt = _optimizer(model)
    losses, grads = [], []
    for step in data:
        batch = [model(input_ids=ids, labels=ids, use_cache=False).loss for ids in step]
        step_losses, step_grads = _step(model, opt, batch)
        losses.append(step_losses)
        grads.append(step_grads)
    return losses, grads


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_hf_ep_training_equals_one_process(family, world):
    shape = _shape(family)
    data = _data(world)
    with tempfile.TemporaryDirectory(prefix="mixmoe-hf-ep-") as path:
        save_random_model(shape, path, seed=3)
        ref_losses, ref_grads = _reference(path, data)
        got = spawn_gloo(_rank, world, path, data, timeout_s=240)
    _check_equal(got, ref_losses, ref_grads, shape, f"{family} W={world}")


def test_hf_ep_smaller_than_the_world_equals_one_process():
    """FSDP 4 x EP 2 (efsdp 2: every expert lives on two ranks, FSDP-sharded over them, and
    each EP group of two ranks exchanges its own tokens): the same per-rank losses and
    gradients as one process, every strategy, replication included. Kept small (one layer,
    tiny dims, the three strategies once each) so that four processes on the shared cores stay
    within seconds: shadow and mix run planned for a compute-bound device, so that they
    replicate (at these dims the CPU profile never copies an expert, and mix then differs from
    its replicating run only by skipping the fetch, which a2a's path covers)."""
    shape = HFModelShape(
        family="mixtral",
        hidden_size=16,
        intermediate_size=24,
        num_experts=4,
        top_k=2,
        layers=1,
        vocab_size=64,
        heads=2,
    )
    world, ep_size = 4, 2
    data = _data(world)
    with tempfile.TemporaryDirectory(prefix="mixmoe-hf-ep-") as path:
        save_random_model(shape, path, seed=3)
        ref_losses, ref_grads = _reference(path, data)
        got = spawn_gloo(_rank, world, path, data, ep_size, SMALL_IMPLS, timeout_s=240)
    _check_equal(
        got, ref_losses, ref_grads, shape, f"W={world} ep={ep_size}", SMALL_IMPLS, SMALL_IMPLS[2:]
    )


def _check_equal(
    got,
    ref_losses,
    ref_grads,
    shape: HFModelShape,
    label: str,
    impls=IMPLS,
    replicating=("mixmoe_shadow", "mixmoe_mix_replicate"),
) -> None:
    """Every implementation's per-rank losses and rank 0's gathered gradients equal the
    reference's; mixmoe's implementations ran on every layer; the ``replicating`` ones
    replicated, a2a did not."""
    for impl in impls:
        # every parameter's gradient, every step: nothing lost or doubled (AdamW's first
        # updates hardly depend on the gradients' size, so the losses alone would not show it)
        for s in range(STEPS):
            grads = got[0][impl]["grads"][s]
            assert grads.keys() == ref_grads[s].keys()
            for name, ref in ref_grads[s].items():
                assert_close(
                    grads[name],
                    ref,
                    rtol=GRAD_RTOL,
                    atol=GRAD_RTOL * float(ref.abs().max()),
                    msg=lambda m, impl=impl, s=s, n=name: f"{impl} step {s} grad {n}: {m}",
                )
        for r, per_rank in enumerate(got):
            assert_close(
                torch.tensor(per_rank[impl]["losses"], dtype=torch.float64),
                torch.tensor([ref_losses[s][r] for s in range(STEPS)], dtype=torch.float64),
                **LOSS_TOL,
                msg=lambda m, impl=impl, r=r: f"{label} {impl} rank {r} losses: {m}",
            )
    for impl in impls[1:]:
        assert got[0][impl]["ep_modules"] == shape.layers, impl
    # replication happened (every rank agrees on the plan, so rank 0's count is the group's)
    for impl in replicating:
        assert got[0][impl]["replicas"][0] > 0, f"{impl} never replicated under the skewed router"
    assert got[0]["mixmoe_a2a"]["replicas"][0] == 0
    if "mixmoe_mix_ahead" in impls:  # planned a step ahead: fitted after each layer's first step
        fitted = [per_rank["mixmoe_mix_ahead"]["fitted"] for per_rank in got]
        assert fitted[0] > 0 and len(set(fitted)) == 1, fitted
        assert all(per_rank["mixmoe_mix"]["fitted"] == 0 for per_rank in got)
        assert all(per_rank["mixmoe_mix_ahead"]["waited_ms"] >= 0.0 for per_rank in got)
    assert all(per_rank["mixmoe_a2a"]["waited_ms"] == 0.0 for per_rank in got)  # no thread


BF16_IMPLS = ("all_to_all", "mixmoe_mix_replicate")
# bf16 (8 bits of mantissa): the two paths round the expert activations and the summed
# gradients in different orders. A lost or doubled replica gradient is off by ~50% of the
# largest entry, far outside GRAD_BF16
LOSS_BF16 = {"rtol": 1e-2, "atol": 1e-2}
GRAD_BF16 = 3e-2


def _rank_bf16(comm, path: str, data) -> dict:
    """all_to_all and the replicating mix in bfloat16 (weights, activations and the
    collectives' payloads: gloo moves bf16)."""
    register_ep_implementation("mixmoe_mix_replicate", "mix", profile=COMPUTE_BOUND)
    W, out = comm.world_size, {}
    for impl in BF16_IMPLS:
        model = load_model(path, impl, ep_size=W, fsdp_size=W, dtype=torch.bfloat16)
        model.train()
        skew_router(model, HOT_EXPERT, HOT_BIAS)
        opt = _optimizer(model)
        losses, grads, dtypes = [], [], set()
        for step in data:
            ids = step[comm.rank]
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            (step_loss,), step_grads = _step(model, opt, [loss])
            losses.append(step_loss)
            grads.append(step_grads if comm.rank == 0 else None)
            dtypes |= {str(g.dtype) for g in step_grads.values() if g is not None}
        eps = ep_implementations(model)
        out[impl] = {
            "losses": losses,
            "grads": grads,
            "dtypes": sorted(dtypes),
            "replicas": sum(ep.replicas_seen for ep in eps),
        }
    return out


def test_hf_ep_bf16_mix_with_replicas_matches_all_to_all():
    """A bfloat16 tiny Mixtral under mixmoe's mix with replication forced equals transformers'
    all_to_all within bf16 tolerance: per-rank losses over the AdamW steps and every
    parameter's gradient (bf16 throughout, replicas asserted)."""
    world = 2
    data = _data(world)
    with tempfile.TemporaryDirectory(prefix="mixmoe-hf-ep-") as path:
        save_random_model(_shape("mixtral"), path, seed=3)
        got = spawn_gloo(_rank_bf16, world, path, data, timeout_s=240)
    base, mix = (got[0][impl] for impl in BF16_IMPLS)
    assert base["dtypes"] == mix["dtypes"] == ["torch.bfloat16"]
    assert mix["replicas"] > 0, "mix never replicated under the skewed router"
    for s in range(STEPS):
        for name, ref in base["grads"][s].items():
            assert_close(
                mix["grads"][s][name].float(),
                ref.float(),
                rtol=GRAD_BF16,
                atol=GRAD_BF16 * float(ref.float().abs().max()),
                msg=lambda m, s=s, n=name: f"bf16 step {s} grad {n}: {m}",
            )
    for r, per_rank in enumerate(got):
        assert_close(
            torch.tensor(per_rank[BF16_IMPLS[1]]["losses"]),
            torch.tensor(per_rank[BF16_IMPLS[0]]["losses"]),
            **LOSS_BF16,
            msg=lambda m, r=r: f"bf16 rank {r} losses: {m}",
        )


ACC_IMPLS = ("all_to_all", "mixmoe_mix_replicate")


def _rank_accumulate(comm, path: str, data) -> dict:
    """Two micro-batches per optimizer step (FSDP accumulates the gradients), all_to_all and
    the replicating mix. The two micro-batches are the same batch, so that mix's plan repeats
    and its second forward reuses the replicas of the first (the cache is keyed on the FSDP
    sharded parameters' version, which only the optimizer step changes)."""
    register_ep_implementation("mixmoe_mix_replicate", "mix", profile=COMPUTE_BOUND)
    W, out = comm.world_size, {}
    for impl in ACC_IMPLS:
        model = load_model(path, impl, ep_size=W, fsdp_size=W)
        model.train()
        skew_router(model, HOT_EXPERT, HOT_BIAS)
        opt = _optimizer(model)
        eps = ep_implementations(model)
        losses, grads, cached = [], [], []
        for step in data:
            ids = step[comm.rank]
            for _micro in range(2):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                (loss / 2).backward()
                losses.append(float(loss.detach()))
                cached.append(
                    [(ep.last_stats["replicas"], ep.last_stats["replica_cached"]) for ep in eps]
                )
            grads.append(
                {n: _full(p.grad) for n, p in model.named_parameters()} if comm.rank == 0 else None
            )
            if comm.rank != 0:
                for p in model.parameters():
                    _full(p.grad)  # the gather is a collective: every rank joins it
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[impl] = {"losses": losses, "grads": grads, "cached": cached}
    return out


def test_hf_ep_gradient_accumulation_with_cached_replicas():
    """Gradient accumulation (two micro-batches, one AdamW step) under mix with replication:
    the second micro-batch's forward takes the replicas from the cache (nothing moves; their
    gradients still go home in backward), the first forward after each optimizer step fetches
    afresh, and losses and the accumulated gradients equal all_to_all's."""
    world = 2
    data = _data(world)
    with tempfile.TemporaryDirectory(prefix="mixmoe-hf-ep-") as path:
        save_random_model(_shape("mixtral"), path, seed=3)
        got = spawn_gloo(_rank_accumulate, world, path, data, timeout_s=240)
    base, mix = (got[0][impl] for impl in ACC_IMPLS)
    for micro, layers in enumerate(mix["cached"]):
        assert all(replicas > 0 for replicas, _ in layers), f"micro-batch {micro}: {layers}"
        # even: the first forward after an optimizer step (or the first ever); odd: the second
        want = micro % 2 == 1
        assert all(c is want for _, c in layers), f"micro-batch {micro} cached: {layers}"
    for s in range(STEPS):
        for name, ref in base["grads"][s].items():
            assert_close(
                mix["grads"][s][name],
                ref,
                rtol=GRAD_RTOL,
                atol=GRAD_RTOL * float(ref.abs().max()),
                msg=lambda m, s=s, n=name: f"accumulated step {s} grad {n}: {m}",
            )
    for r, per_rank in enumerate(got):
        assert_close(
            torch.tensor(per_rank[ACC_IMPLS[1]]["losses"], dtype=torch.float64),
            torch.tensor(per_rank[ACC_IMPLS[0]]["losses"], dtype=torch.float64),
            **LOSS_TOL,
            msg=lambda m, r=r: f"accumulation rank {r} losses: {m}",
        )
