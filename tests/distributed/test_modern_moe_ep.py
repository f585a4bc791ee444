"""DeepSeek-style layers under expert parallelism equal the single-rank layer, step by step:
sigmoid group-limited routing with the selection bias moving between steps, shared experts
(with and without their gate), padding, and the sequence / global-batch losses; ``a2a``,
``shadow`` and ``mix`` with replicas forced, on 2 and 3 gloo ranks, forward and every gradient;
the bias identical on every rank. Plus data parallelism on one device per rank: one all_reduce
of the step counts gives every rank the bias of the whole batch.

Legend: T tokens, D model dim, N experts, W ranks, B sequences, S tokens per sequence.
"""

from __future__ import annotations

import pytest
import torch
from _cases import D, F

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.parallel import parallelize_moe
from mixmoe.placement.profile import HardwareProfile
from mixmoe.tracing import TraceRecorder

pytestmark = pytest.mark.dist

# compute-bound profile: replication always pays, so mix and shadow really use replicas
REPLICATE = HardwareProfile(
    "test-replicate", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)
STEPS = 2


def _config(case: dict) -> MoEConfig:
    gate = GateConfig(
        score="sigmoid",
        normalize="renorm",
        n_groups=4,
        topk_groups=2,
        group_score=case.get("group_score", "sum_top2"),
        route_scale=2.5,
        expert_bias=True,
        bias_update_rate=0.05,  # large: the step-2 selection really differs
        router_dtype="float32" if case["dtype"] == torch.float32 else None,
    )
    return MoEConfig(
        model_dim=D,
        hidden_dim=F,
        num_experts=case["num_experts"],
        top_k=3,
        activation=case["activation"],
        gate=gate,
        block_size=16,
        strategy="local",
        aux_loss_coef=case["aux_coef"],
        balance_loss=case["balance_loss"],
        shared_experts=case["shared"],
        shared_hidden_dim=7,
        shared_gate=case["shared_gate"],
        plan_async=True,
    )


def _layer(case: dict) -> MoE:
    torch.manual_seed(case["seed"])
    layer = MoE(_config(case), dtype=case["dtype"])
    with torch.no_grad():
        layer.gate.wg.bias[:2] += 1.0  # experts 0, 1 (rank 0's) hot: replicas pay
    return layer


def _inputs(case: dict, rank: int, step: int):
    """(x, dy, padding) of ``rank`` at ``step``: [T, D] ragged, or [B, S, D] with sequence b's
    last b + 1 tokens padded (the same count on every rank, so per-rank means average exactly)."""
    gen = torch.Generator().manual_seed(case["seed"] * 100 + 10 * step + rank)
    shape = (case["tokens"][rank], D) if case["seq"] is None else (*case["seq"], D)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(case["dtype"])
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(case["dtype"])
    pad = None
    if case["seq"] is not None:
        B, S = case["seq"]
        pad = torch.arange(S)[None, :] >= S - 1 - torch.arange(B)[:, None]
    return x, dy, pad


def _grads(layer: MoE) -> dict:
    out = {"gate_w": layer.gate.wg.weight.grad, "gate_b": layer.gate.wg.bias.grad}
    if layer.shared is not None:
        out.update({f"shared_{n}": p.grad for n, p in layer.shared.named_parameters()})
    out.update({f"d{n}": p.grad for n, p in layer.experts.named_expert_parameters()})
    return out


def _run_ep(comm, case: dict) -> list[dict]:
    layer = _layer(case)
    if case["strategy"] != "dp":
        parallelize_moe(layer, comm, case["strategy"], profile=REPLICATE)
    W = comm.world_size
    steps = []
    for step in range(STEPS):
        x, dy, pad = _inputs(case, comm.rank, step)
        x.requires_grad_(True)
        rec = TraceRecorder(rank=comm.rank, stage_id=0, device="cpu")
        with rec.activate(), rec.op("forward_step", batch_id=step, mg_state="steady"):
            y, aux = layer(x, padding_mask=pad)
        spans = {
            s.name: (s.timestamp_ms - s.duration_ms, s.timestamp_ms)
            for s in rec.records()[0].sub_ops
        }
        # every rank's aux loss is its share: the single-rank loss is their mean (equal tokens)
        ((y * dy).sum() + aux.loss / W).backward()
        reduce = (lambda t: comm.all_reduce(t)) if case["strategy"] == "dp" else None
        record = layer.end_step(reduce)
        steps.append(
            {
                "y": y.detach(),
                "dx": x.grad,
                "loss": aux.loss.detach(),
                "replicas": (aux.stats or {}).get("replicas", 0),
                "spans": spans,
                "load": record.load_N,
                "bias": layer.gate.expert_bias.clone(),
                **{k: v.clone() for k, v in _grads(layer).items()},
            }
        )
        layer.zero_grad()
    return steps


def _worker(comm, cases: list[dict]) -> list[list[dict]]:
    return [_run_ep(comm, case) for case in cases]


def _reference(case: dict, world: int) -> list[dict]:
    layer = _layer(case)
    steps = []
    for step in range(STEPS):
        xs, dys, pads = zip(*(_inputs(case, r, step) for r in range(world)), strict=True)
        x = torch.cat(xs).requires_grad_(True)
        pad = None if pads[0] is None else torch.cat(pads)
        y, aux = layer(x, padding_mask=pad)
        ((y * torch.cat(dys)).sum() + aux.loss).backward()
        record = layer.end_step()
        steps.append(
            {
                "y": y.detach(),
                "dx": x.grad,
                "loss": aux.loss.detach(),
                "load": record.load_N,
                "bias": layer.gate.expert_bias.clone(),
                **{k: v.clone() for k, v in _grads(layer).items()},
            }
        )
        layer.zero_grad()
    return steps


def _check(case: dict, got: list[list[dict]], world: int) -> None:
    ref = _reference(case, world)
    tol = (
        {"rtol": 1e-10, "atol": 1e-10}
        if case["dtype"] == torch.float64
        else {"rtol": 1e-4, "atol": 2e-5}
    )
    close = torch.testing.assert_close
    for step in range(STEPS):
        ranks, want = [g[step] for g in got], ref[step]
        msg = f"{case['name']} step {step}"
        close(
            torch.cat([r["y"] for r in ranks]), want["y"], **tol, msg=lambda m, s=msg: f"{s}: {m}"
        )
        close(torch.cat([r["dx"] for r in ranks]), want["dx"], **tol)
        close(sum(r["loss"] for r in ranks) / world, want["loss"], **tol)
        for r in ranks:  # the same global load and the same bias, bit for bit, everywhere
            assert torch.equal(r["load"], want["load"]), msg
            assert torch.equal(r["bias"], want["bias"]), msg
        for key in want:
            if key.startswith(("gate_", "shared_")):  # data-parallel parameters: summed grads
                close(
                    sum(r[key] for r in ranks), want[key], **tol, msg=lambda m, k=key: f"{k}: {m}"
                )
            elif key.startswith("d") and key != "dx":
                if case["strategy"] == "dp":  # every rank holds every expert: summed grads
                    cat = sum(r[key] for r in ranks)
                else:  # every expert's grad lives on its owner, replica grads reduced into it
                    cat = torch.cat([r[key] for r in ranks])
                close(cat, want[key], **tol, msg=lambda m, k=key, s=msg: f"{s} {k}: {m}")
    assert not torch.equal(ref[1]["bias"], torch.zeros_like(ref[1]["bias"]))


def _cases(world: int) -> list[dict]:
    tokens = {2: [41, 0], 3: [0, 50, 23]}[world]
    cases = []
    strategies = ("a2a", "shadow", "mix") + (("dp",) if world == 2 else ())
    for i, strategy in enumerate(strategies):
        for kind in ("ragged", "seq"):
            seq = kind == "seq"
            cases.append(
                {
                    "name": f"{strategy}-{kind}",
                    "strategy": strategy,
                    "seed": 7000 + 100 * world + 10 * i + seq,
                    "num_experts": 4 * world,
                    "dtype": torch.float32 if (strategy == "mix" and seq) else torch.float64,
                    "tokens": tokens,
                    "seq": (2, 9) if seq else None,
                    "activation": "swiglu" if seq else "gelu",
                    "aux_coef": 0.3 if seq else 0.0,
                    # global_batch needs the EP count matrix: on one device (dp) it is the
                    # rank's own batch, so dp runs the sequence loss
                    "balance_loss": (
                        ("sequence", "global_batch")[i % 2] if strategy != "dp" else "sequence"
                    )
                    if seq
                    else "micro_batch",
                    "group_score": "max" if i == 1 else "sum_top2",
                    "shared": 2 if seq else 1,
                    "shared_gate": not seq,
                }
            )
    return cases


@pytest.mark.parametrize("world", [2, 3])
def test_deepseek_style_layer_matches_single_rank(world: int) -> None:
    from mixmoe.comm.launch import spawn_gloo

    cases = _cases(world)
    per_rank = spawn_gloo(_worker, world, cases, timeout_s=600)
    replicas = {"shadow": 0, "mix": 0}
    for i, case in enumerate(cases):
        got = [per_rank[r][i] for r in range(world)]
        _check(case, got, world)
        if case["strategy"] in replicas:
            replicas[case["strategy"]] += sum(s["replicas"] for g in got for s in g)
    assert replicas["mix"] > 0 and replicas["shadow"] > 0, replicas
    # under mix the shared experts run after the token exchange started and before the experts
    # that wait for its rows: while it is in flight
    overlapped = 0
    for i, case in enumerate(cases):
        for r in range(world) if case["strategy"] == "mix" else ():
            for s in per_rank[r][i]:
                sp = s["spans"]
                if "moe.experts_remote" in sp:
                    assert sp["moe.dispatch"][1] <= sp["moe.shared_experts"][0]
                    assert sp["moe.shared_experts"][1] <= sp["moe.experts_remote"][0]
                    overlapped += 1
    assert overlapped > 0
