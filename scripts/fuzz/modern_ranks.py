"""Fuzz the DeepSeek-style layer under expert parallelism against the single-rank layer.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/fuzz/modern_ranks.py [SEED] [WORLD] [CASES]

One spawn of WORLD gloo ranks (2-4) runs CASES random cases of scored routing (softmax or
sigmoid scores and each of their normalizations, groups with a group limit, a route scale, the
aux-loss-free expert bias moving every step), 0-2 shared experts with or without their gate,
the balance losses (sequence, global batch; the micro-batch one is each rank's own, weighed 0
here) and a z-loss on padded sequences,
or ragged tokens with ranks that route nothing; strategy a2a, shadow or mix (plan_ahead on a
third of the mix cases), a profile where replicas pay, never pay, or pay in nodes of 2 ranks;
2-3 steps. At every step the output, the input gradient, the loss (the ranks' mean), the
step's global load and the expert bias (bit for bit on every rank), the gate's and shared
experts' gradients (summed over ranks) and every expert's gradient (at its owner) must equal
the single-rank layer's on every rank's inputs at once (float64, 1e-10). A case that raises or
differs prints one line. The suite runs fixed cases (``tests/distributed/test_modern_moe_ep.py``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_ranks import PROFILES, run  # noqa: E402  (the same profiles and command line)

from mixmoe import GateConfig, MoE, MoEConfig  # noqa: E402
from mixmoe.parallel import parallelize_moe  # noqa: E402

D, F, SHARED_F = 8, 12, 7


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_case(rng: random.Random, world: int, seed: int) -> dict:
    N = world * rng.choice([1, 2, 3, 4])
    score = rng.choice(["softmax", "sigmoid"])
    normalize = rng.choice(
        ["renorm", "none"] if score == "sigmoid" else ["topk_softmax", "softmax_renorm", "softmax"]
    )
    n_groups = rng.choice(_divisors(N))
    per_group = N // n_groups
    topk_groups = rng.choice([None, *range(1, n_groups + 1)])
    eligible = N if topk_groups is None else topk_groups * per_group
    strategy = rng.choice(["a2a", "shadow", "mix", "mix"])
    seq = rng.random() < 0.5  # padded sequences (equal tokens: the losses average) or ragged
    # the micro-batch loss is each rank's own batch's (f_i P_i: a product of its means, so the
    # ranks' mean is not the single-rank loss over their tokens at once): weighed only at 0
    balance_loss = rng.choice(["micro_batch", "sequence", "global_batch"]) if seq else None
    return {
        "seed": seed,
        "num_experts": N,
        "top_k": rng.randint(1, min(4, eligible)),
        "gate": {
            "score": score,
            "normalize": normalize,
            "n_groups": n_groups,
            "topk_groups": topk_groups,
            "group_score": rng.choice(["sum_top2", "max"] if per_group >= 2 else ["max"]),
            "route_scale": rng.choice([1.0, 2.5]),
            "expert_bias": rng.random() < 0.7,
            "bias_update_rate": 0.05,
        },
        "hot": rng.choice([0.0, 1.0, 3.0]),  # added to experts 0, 1's router bias
        "shared": rng.choice([0, 1, 2]),
        "shared_gate": rng.random() < 0.5,
        "seq": (rng.choice([1, 2, 3]), rng.choice([3, 9])) if seq else None,
        "tokens": [rng.choice([0, 1, 17, 40]) for _ in range(world)],
        # the per-rank losses average to the single-rank one only over equal token counts
        "balance_loss": balance_loss,
        "aux_coef": rng.choice([0.0, 0.3]) if seq and balance_loss != "micro_batch" else 0.0,
        "z_coef": rng.choice([0.0, 0.1]) if seq else 0.0,
        "strategy": strategy,
        "plan_ahead": strategy == "mix" and rng.random() < 0.3,
        "profile": rng.choice(list(PROFILES)),
        "block_size": rng.choice([16, 32]),
        "max_replicas": rng.choice([0, 1, 2, 4]),
        "activation": rng.choice(["gelu", "relu", "swiglu"]),
        "steps": rng.randint(2, 3),
    }


def make_layer(case: dict) -> MoE:
    shared = case["shared"]
    config = MoEConfig(
        model_dim=D,
        hidden_dim=F,
        num_experts=case["num_experts"],
        top_k=case["top_k"],
        activation=case["activation"],
        gate=GateConfig(**case["gate"]),
        block_size=case["block_size"],
        max_replicas=case["max_replicas"],
        plan_ahead=case["plan_ahead"],
        aux_loss_coef=case["aux_coef"],
        z_loss_coef=case["z_coef"],
        balance_loss=case["balance_loss"] or "micro_batch",
        shared_experts=shared,
        shared_hidden_dim=SHARED_F if shared else None,
        shared_gate=case["shared_gate"] and shared > 0,
    )
    torch.manual_seed(case["seed"])
    layer = MoE(config, dtype=torch.float64)
    with torch.no_grad():
        layer.gate.wg.bias[:2] += case["hot"]
    return layer


def inputs(case: dict, rank: int, step: int):
    """(x, dy, padding) of ``rank`` at ``step``: [T, D] ragged, or [B, S, D] with sequence b's
    last min(b + 1, S - 1) tokens padded (the same on every rank)."""
    gen = torch.Generator().manual_seed(case["seed"] * 100 + 10 * step + rank)
    shape = (case["tokens"][rank], D) if case["seq"] is None else (*case["seq"], D)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    pad = None
    if case["seq"] is not None:
        B, S = case["seq"]
        pad = torch.arange(S)[None, :] >= S - 1 - torch.arange(B).clamp(max=S - 2)[:, None]
    return x, dy, pad


def _grads(layer: MoE) -> dict:
    out = {"gate_w": layer.gate.wg.weight.grad, "gate_b": layer.gate.wg.bias.grad}
    if layer.shared is not None:
        out.update({f"shared_{n}": p.grad for n, p in layer.shared.named_parameters()})
    out.update({f"d{n}": p.grad for n, p in layer.experts.named_expert_parameters()})
    return {k: v.clone() for k, v in out.items()}


def _record(layer: MoE, y, x, loss, end) -> dict:
    bias = getattr(layer.gate, "expert_bias", None)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "loss": loss.detach(),
        "load": end.load_N,
        "bias": None if bias is None else bias.clone(),
        **_grads(layer),
    }


def _rank(comm, cases: list[dict]) -> list:
    out = []
    for case in cases:
        try:
            layer = make_layer(case)
            parallelize_moe(layer, comm, case["strategy"], profile=PROFILES[case["profile"]])
            layer.dispatcher.check_plans = True
            steps = []
            for step in range(case["steps"]):
                x, dy, pad = inputs(case, comm.rank, step)
                x.requires_grad_(True)
                y, aux = layer(x, padding_mask=pad)
                # each rank's loss is its share: the single-rank loss is their mean
                ((y * dy).sum() + aux.loss / comm.world_size).backward()
                steps.append(_record(layer, y, x, aux.loss, layer.end_step()))
                layer.zero_grad()
            out.append(steps)
        except Exception as e:  # every rank reports; the parent prints it
            out.append({"error": f"{type(e).__name__}: {e}"[:300]})
    return out


def _reference(case: dict, world: int) -> list[dict]:
    layer = make_layer(dict(case, plan_ahead=False))
    steps = []
    for step in range(case["steps"]):
        xs, dys, pads = zip(*(inputs(case, r, step) for r in range(world)), strict=True)
        x = torch.cat(xs).requires_grad_(True)
        pad = None if pads[0] is None else torch.cat(pads)
        y, aux = layer(x, padding_mask=pad)
        ((y * torch.cat(dys)).sum() + aux.loss).backward()
        steps.append(_record(layer, y, x, aux.loss, layer.end_step()))
        layer.zero_grad()
    return steps


def compare(case: dict, got: list[list[dict]], world: int) -> None:
    ref, tol = _reference(case, world), {"rtol": 1e-10, "atol": 1e-10}
    close = torch.testing.assert_close
    for step, want in enumerate(ref):
        ranks = [g[step] for g in got]
        at = f"step {step}"
        close(torch.cat([r["y"] for r in ranks]), want["y"], **tol, msg=f"{at} y")
        close(torch.cat([r["dx"] for r in ranks]), want["dx"], **tol, msg=f"{at} dx")
        close(sum(r["loss"] for r in ranks) / world, want["loss"], **tol, msg=f"{at} loss")
        for r in ranks:  # the same global load and bias, bit for bit, on every rank
            assert torch.equal(r["load"], want["load"]), f"{at}: load {r['load']} {want['load']}"
            if want["bias"] is not None:
                assert torch.equal(r["bias"], want["bias"]), f"{at}: bias differs"
        for key in want:
            if key.startswith(("gate_", "shared_")):  # data-parallel parameters: summed
                close(sum(r[key] for r in ranks), want[key], **tol, msg=f"{at} {key}")
            elif key.startswith("d") and key != "dx":  # at each expert's owner
                close(torch.cat([r[key] for r in ranks]), want[key], **tol, msg=f"{at} {key}")


def main() -> int:
    return run(draw_case, _rank, compare)


if __name__ == "__main__":
    raise SystemExit(main())
