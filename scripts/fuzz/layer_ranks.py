"""Fuzz the expert-parallel layer against the single-rank layer on random small cases.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/fuzz/layer_ranks.py [SEED] [WORLD] [CASES]

One spawn of WORLD gloo ranks (2-4) runs CASES random cases, each a layer built the same way
everywhere (``tests/distributed/_cases``): 1-3 experts per rank, top-1 to top-4, gelu / relu /
swiglu, a uniform, skewed or one-hot gate, 0-130 tokens per rank (ranks without tokens
included), strategy a2a, shadow or mix (plan_ahead on a third of the mix cases), a profile where
replicas pay, where they never do, or in nodes of 2 ranks, a block size, a replica budget, C's
sums shared or not, 1-3 steps. The last step's output, input gradient, gate gradients (summed
over ranks) and every expert's gradient (at its owner) must equal the single-rank layer's on
every rank's inputs at once (float64, 1e-10). A case that raises or differs prints one line.
The suite runs the fixed cases (``tests/distributed/test_strategies.py``, ``test_shares.py``);
this draws new ones: 900 cases (W = 2, 3, 4) took ~6 minutes here, all equal.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import torch

from mixmoe.parallel import parallelize_moe
from mixmoe.placement.profile import HardwareProfile

CASES_DIR = Path(__file__).resolve().parents[2] / "tests" / "distributed"
# replicas pay (compute-bound) / never pay (no bandwidth) / pay, in nodes of 2 ranks
REPLICATE = HardwareProfile("replicate", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9)
PROFILES = {
    "replicate": REPLICATE,
    "no-replicate": HardwareProfile("no-replicate", 1e15, 1.0, 1e-9),
    "nodes": dataclasses.replace(REPLICATE, name="nodes", ranks_per_node=2,
                                 inter_node_bandwidth=1e11, inter_node_latency=1e-8),
}  # fmt: skip


def _cases_module():
    sys.path.insert(0, str(CASES_DIR))
    import _cases

    return _cases


def draw_case(rng: random.Random, world: int, seed: int) -> dict:
    E = rng.choice([1, 2, 3])
    N = world * E
    strategy = rng.choice(["a2a", "shadow", "mix", "mix"])
    return {
        "strategy": strategy,
        "dtype": torch.float64,
        "num_experts": N,
        "top_k": rng.randint(1, min(4, N)),
        "skew": rng.choice(["uniform", "hot", "one", None]),
        "tokens": [rng.choice([0, 1, 17, 64, 100, 130]) for _ in range(world)],
        "seed": seed,
        "profile": rng.choice(list(PROFILES)),
        "block_size": rng.choice([16, 32, 64]),
        "max_replicas": rng.choice([0, 1, 2, 4]),
        "activation": rng.choice(["gelu", "relu", "swiglu"]),
        "steps": rng.randint(1, 3),
        "shared_sums": rng.random() < 0.5,
        "plan_ahead": strategy == "mix" and rng.random() < 0.3,
    }


def _grads(layer, y: torch.Tensor, x: torch.Tensor) -> dict:
    return {
        "y": y.detach(),
        "dx": x.grad,
        "gate_w": layer.gate.wg.weight.grad,
        "gate_b": layer.gate.wg.bias.grad,
        **{f"d{n}": p.grad for n, p in layer.experts.named_expert_parameters()},
    }


def _rank(comm, cases: list[dict]) -> list[dict]:
    cases_mod = _cases_module()
    out = []
    for case in cases:
        try:
            layer = cases_mod.make_layer(case)
            parallelize_moe(layer, comm, case["strategy"], profile=PROFILES[case["profile"]])
            layer.dispatcher.check_plans = True
            if case["shared_sums"]:
                layer.dispatcher.shared_sums_min = 0
            for step in range(case["steps"]):  # no optimizer: the last step alone is compared
                x, dy = cases_mod.rank_inputs(dict(case, seed=case["seed"] + step), comm.rank)
                x.requires_grad_(True)
                layer.zero_grad()
                y, _ = layer(x)
                (y * dy).sum().backward()
            out.append(_grads(layer, y, x))
        except Exception as e:  # every rank reports; the parent prints it
            out.append({"error": f"{type(e).__name__}: {e}"[:300]})
    return out


def _reference(case: dict, world: int) -> dict:
    cases_mod = _cases_module()
    layer = cases_mod.make_layer(case)
    last = dict(case, seed=case["seed"] + case["steps"] - 1)
    xs, dys = zip(*(cases_mod.rank_inputs(last, r) for r in range(world)), strict=True)
    x = torch.cat(xs).requires_grad_(True)
    y, _ = layer(x)
    (y * torch.cat(dys)).sum().backward()
    return _grads(layer, y, x)


def compare(case: dict, got: list[dict], world: int) -> None:
    want, tol = _reference(case, world), {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), want["y"], **tol)
    torch.testing.assert_close(torch.cat([g["dx"] for g in got]), want["dx"], **tol)
    for key in ("gate_w", "gate_b"):  # data-parallel gate: the ranks' gradients sum
        torch.testing.assert_close(sum(g[key] for g in got), want[key], **tol)
    for key in [k for k in want if k.startswith("d") and k != "dx"]:  # at each expert's owner
        torch.testing.assert_close(torch.cat([g[key] for g in got]), want[key], **tol, msg=key)


def run(draw, rank_fn, check) -> int:
    """The fuzz scripts' command line (SEED WORLD CASES): ``draw(rng, world, seed)`` cases, run
    by ``rank_fn(comm, cases)`` on WORLD gloo ranks (a case that raised: a dict with "error"),
    each checked by ``check(case, got, world)``; prints a line per failure and the count."""
    from mixmoe.comm.launch import spawn_gloo

    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    rng = random.Random(seed)
    cases = [draw(rng, world, seed * 1000 + i) for i in range(n)]
    per_rank = spawn_gloo(rank_fn, world, cases, timeout_s=3600)
    failed = 0
    for i, case in enumerate(cases):
        got = [per_rank[r][i] for r in range(world)]
        errors = [g["error"] for g in got if isinstance(g, dict) and "error" in g]
        try:
            assert not errors, errors[0] if errors else ""
            check(case, got, world)
        except AssertionError as e:
            failed += 1
            print(f"case {i}: {str(e).splitlines()[0][:200]} {case}")
    print(f"seed {seed}, W={world}: {n} cases, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    return run(draw_case, _rank, compare)


if __name__ == "__main__":
    raise SystemExit(main())
