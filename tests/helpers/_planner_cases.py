"""Random adversarial inputs for ``plan_mix`` twin tests (the compiled planner against the Python
steps): small counts with zeros, empty ranks, one hot segment or ties, and every knob."""

from __future__ import annotations

import random

import torch

from mixmoe.placement import LayerShape


def random_plan_case(rng: random.Random, case: int) -> tuple[torch.Tensor, LayerShape, int, dict]:
    """(counts_WN, shape, max_replicas, plan_mix keyword arguments) of case number ``case``
    (its kind: ``case % 4``), W = 2-12, 1-4 experts per rank."""
    W, E = rng.randint(2, 12), rng.choice([1, 2, 3, 4])
    kind = case % 4
    C = torch.tensor([[rng.randrange(0, 300) for _ in range(W * E)] for _ in range(W)])
    if kind == 1:  # empty ranks
        C[rng.randrange(W)] = 0
        C[:, rng.randrange(W * E)] = 0
    elif kind == 2:  # one hot segment
        C[rng.randrange(W), rng.randrange(W * E)] += rng.randrange(2000, 20000)
    elif kind == 3:  # ties
        C = torch.full((W, W * E), rng.choice([0, 64, 100]))
        C[0, 0] += 640
    shape = LayerShape(rng.choice([64, 256, 1024]), 512, E, W, 2)
    kwargs = {
        "overlap": rng.random() < 0.7,
        "search_width": rng.choice([1, 2, 8]),
        "block_size": rng.choice([1, 16, 64]),
        "balance": rng.random() < 0.9,
    }
    return C, shape, rng.choice([0, 1, 2, 4, 8]), kwargs
