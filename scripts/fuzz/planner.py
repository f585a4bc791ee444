"""Fuzz the planner's twins and guarantees on random counts, far more cases than the suite runs.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/fuzz/planner.py [SEED] [CASES] [--big]

Each case draws counts (the suite's adversarial small ones from ``tests/helpers/_planner_cases``,
or skewed routing at W = 2-40, 1-32 experts a rank, with empty ranks, a hot cell, a hot rank
or a hot owner; with ``--big`` every third case at W = 48-200), a budget, ``plan_mix``'s knobs and a profile (one link,
or nodes of 2, 3, 5 and 8 ranks), then checks:

- the compiled plan equals the Python plan (``MIXMOE_NATIVE=0``) field by field, floats bit for bit;
- never predicted slower than a2a (``plan_none`` under the same overlap and profile), within the
  replica budget, ranges valid for the counts (``Plan.check_shares``);
- its fit to a fresh draw of the same popularity (``refit_plan``) equals ``refit_python``, is
  never predicted slower than a2a on the new counts, and is valid for them;
- the step's bookkeeping of the plan and of the fit (``build_step_plan``, compiled, with and
  without C's sums given) equals ``step_plan_python`` at every rank (6 sampled ranks above W = 16);
- the plan, the fit and the bookkeeping of C stored by columns (the mixed strategy's count
  exchange) equal those of C row-major.

A failing case prints one line and is saved to ``/tmp/mixmoe-fuzz/planner_SEED_I.pt`` (counts,
shape, budget, knobs, profile) to replay. Found with it: a topology's repriced source-replica
candidate kept although slower than a2a (``planner._no_worse``); the Python fit's fallback to
nothing replicated keeping a kept holder's entry (``refit_python``, seed 81). ~1000 cases a
minute here.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path

import torch

from mixmoe.dispatch.step_plan import build_step_plan, step_plan_python
from mixmoe.gating.synthetic import redrawn_counts
from mixmoe.placement import (
    CPU_PROFILE,
    GPU_PROFILE,
    HardwareProfile,
    LayerShape,
    native_lib,
    plan_mix,
    plan_none,
)
from mixmoe.placement.counts import CountSums
from mixmoe.placement.planner import replica_slots
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.refit import refit_plan, refit_python
from mixmoe.placement.relay import node_distance

HELPERS = Path(__file__).resolve().parents[2] / "tests" / "helpers"  # the suite's random cases

OUT = Path("/tmp/mixmoe-fuzz")
NODES = load_profile("h100-nvlink-ib")  # 8 ranks per node
PROFILES = (
    GPU_PROFILE,
    CPU_PROFILE,
    HardwareProfile("ib-like", 593e12, 40e9, 30e-6),
    load_profile("h100-nvlink"),
    NODES,
    dataclasses.replace(NODES, ranks_per_node=2),
    dataclasses.replace(NODES, ranks_per_node=3),
    dataclasses.replace(NODES, ranks_per_node=5, row_overhead_s=1e-8, replica_fixed_s=2e-5,
                        step_fixed_s=1e-4),
)  # fmt: skip


def canon(x: object) -> str:
    """A value as text, floats in hex (equal text: equal bits), dataclasses by compared field."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(map(canon, x)) + ")"
    if dataclasses.is_dataclass(x):
        fields = [f for f in dataclasses.fields(x) if f.compare]
        return "{" + ",".join(f"{f.name}={canon(getattr(x, f.name))}" for f in fields) + "}"
    return f"{type(x).__name__}:{x!r}"


def python_twin(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the compiled parts off."""
    before = os.environ.get(native_lib.ENV_OFF)
    os.environ[native_lib.ENV_OFF] = "0"
    try:
        return fn(*args, **kwargs)
    finally:
        if before is None:
            del os.environ[native_lib.ENV_OFF]
        else:
            os.environ[native_lib.ENV_OFF] = before


def skewed_case(rng: random.Random, lo: int, hi: int) -> tuple:
    """Counts of W in [lo, hi] ranks, E experts each, drawn from a Pareto popularity, with one of
    empty ranks, a hot cell, a hot rank or a hot owner; a shape, a budget and the knobs."""
    W, E = rng.randint(lo, hi), rng.choice([1, 2, 4, 8, 16, 32])
    E = min(E, max(1, 2048 // W))  # many experts a rank (a hot owner offers more than 4 a pass)
    N, kind = W * E, rng.randrange(5)
    popularity = torch.tensor([rng.paretovariate(rng.choice([0.8, 1.2, 2.0])) for _ in range(N)])
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    C = torch.zeros(W, N, dtype=torch.int64)
    for s in range(W):
        tokens = rng.choice([0, 64, 512, 4096]) if kind == 0 else 4096
        if tokens:
            picks = torch.multinomial(popularity, 2 * tokens, replacement=True, generator=gen)
            C[s] = torch.bincount(picks, minlength=N)
    if kind == 1:  # one rank's rows of one expert
        C[rng.randrange(W), rng.randrange(N)] += rng.randrange(1000, 50000)
    elif kind == 2:  # a hot rank
        C[rng.randrange(W)] *= rng.randint(2, 10)
    elif kind == 3:  # a hot owner: every rank's rows of one rank's experts
        o = rng.randrange(W)
        C[:, o * E : (o + 1) * E] *= 5
    D, F = rng.choice([(1024, 4096), (2048, 1024), (64, 512)])
    knobs = {"overlap": rng.random() < 0.8, "search_width": rng.choice([1, 8]),
             "block_size": rng.choice([16, 64]), "balance": True}  # fmt: skip
    return C, LayerShape(D, F, E, W, 2), rng.choice([1, 2, 4, 8]), knobs


def check(C, shape: LayerShape, budget: int, knobs: dict, profile: HardwareProfile) -> None:
    """Every check of the module doc; AssertionError naming the one that failed."""
    W, E = shape.world_size, shape.experts_per_rank
    overlap, block = knobs["overlap"], knobs["block_size"]
    plan = plan_mix(C, shape, profile, budget, **knobs)
    assert canon(plan) == canon(python_twin(plan_mix, C, shape, profile, budget, **knobs)), "twin"
    a2a = plan_none(C, shape, profile, overlap=overlap).prediction.step_s
    assert plan.prediction.step_s <= a2a, f"slower than a2a: {plan.prediction.step_s} > {a2a}"
    slots = replica_slots(budget, E) if budget else 0
    assert all(len(plan.replica_slots(r)) <= slots for r in range(W)), "over the replica budget"
    dataclasses.replace(plan).check_shares(C, E, block)  # built unchecked: Plan's checks now
    after = redrawn_counts(C, random.randrange(1 << 20)) if C.sum() else C.clone()
    fit = refit_plan(plan, C, after, shape, profile, overlap, block)
    want = refit_python(plan, C, after, shape, profile, overlap, block, 0)
    assert canon(fit) == canon(want), "refit twin"
    by_column = [x.t().contiguous().t() for x in (C, after)]
    assert canon(plan_mix(by_column[0], shape, profile, budget, **knobs)) == canon(plan), "by cols"
    by_column_fit = refit_plan(plan, *by_column, shape, profile, overlap, block)
    assert canon(by_column_fit) == canon(fit), "refit by columns"
    a2a_after = plan_none(after, shape, profile, overlap=overlap).prediction.step_s
    assert fit.prediction.step_s <= a2a_after, "fit slower than a2a"
    dataclasses.replace(fit).check_shares(after, E, block)
    distance = node_distance(profile)
    ranks = range(W) if W <= 16 else random.sample(range(W), 6)
    for counts, p in ((C, plan), (after, fit)):
        sums = CountSums(counts.sum(0), counts.sum(1))  # given, as the layer's device sums them
        for r in ranks:
            want = canon(step_plan_python(counts, p, r, E, distance))
            for given in (None, sums):
                for stored in (counts, counts.t().contiguous().t()):
                    got = dataclasses.replace(
                        build_step_plan(stored, p, r, E, distance, given), expert_rows_N=None
                    )
                    assert canon(got) == want, f"step {r}" + (" given the sums" if given else "")


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--big"]
    seed, cases = (int(args[0]) if args else 0), (int(args[1]) if len(args) > 1 else 1000)
    big = "--big" in sys.argv
    torch.set_num_threads(1)
    sys.path.insert(0, str(HELPERS))
    from _planner_cases import random_plan_case

    failed = 0
    for i in range(cases):
        rng = random.Random(seed * 1_000_003 + i)
        random.seed(seed * 1_000_003 + i)  # the fit's redraw and the sampled ranks
        if i % 3 == 0:
            C, shape, budget, knobs = random_plan_case(rng, i)
        elif i % 3 == 2 and big:
            C, shape, budget, knobs = skewed_case(rng, 48, 200)
        else:
            C, shape, budget, knobs = skewed_case(rng, 2, 40)
        profile = rng.choice(PROFILES)
        try:
            check(C, shape, budget, knobs, profile)
        except AssertionError as e:
            failed += 1
            OUT.mkdir(exist_ok=True)
            path = OUT / f"planner_{seed}_{i}.pt"
            torch.save((C, shape, budget, knobs, profile), path)
            print(f"case {i}: {e} (W={shape.world_size} E={shape.experts_per_rank} budget={budget}"
                  f" {knobs} {profile.name} nodes of {profile.ranks_per_node}): {path}")  # fmt: skip
    print(f"seed {seed}: {cases} cases, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
