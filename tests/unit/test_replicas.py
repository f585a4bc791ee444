"""Replica fetch bookkeeping and weight packing (``dispatch/replicas.py``), in one process.

``FetchPlan`` is checked by simulating the all_to_all of every rank's send list: each holder must
receive exactly its replicas, from their owners, in ascending order (its replica slots), and the
splits must agree pairwise. ``pack_experts`` / ``unpack_experts`` round-trip every weight layout
(biases, SwiGLU) and route gradients back to the packed experts, summed over duplicates.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from mixmoe.dispatch.replicas import FetchPlan, pack_experts, unpack_experts, weights_version
from mixmoe.ops.expert_mlp import ExpertWeights


def _random_replicas(W: int, E: int, rng: random.Random):
    """((g, holders ascending, never the owner), ...) for a random set of hot experts, by g."""
    out = []
    for g in range(W * E):
        others = [h for h in range(W) if h != g // E]
        if others and rng.random() < 0.5:
            out.append((g, tuple(sorted(rng.sample(others, rng.randint(1, len(others)))))))
    return tuple(out)


@pytest.mark.parametrize("W,E", [(1, 2), (2, 1), (2, 3), (3, 2), (4, 2)])
def test_fetch_plan_delivers_each_replica_from_its_owner_in_slot_order(W, E):
    rng = random.Random(10 * W + E)
    for _ in range(6):
        replicas = _random_replicas(W, E, rng)
        plans = [FetchPlan.build(replicas, r, W, E) for r in range(W)]
        for plan in plans:  # sent: owned experts only, grouped by destination
            assert len(plan.send_local_ids) == sum(plan.in_splits)
            assert all(0 <= i < E for i in plan.send_local_ids), plan
        for r, plan in enumerate(plans):
            got = []
            for q, sender in enumerate(plans):  # the all_to_all: q's block for r, q ascending
                start = sum(sender.in_splits[:r])
                block = sender.send_local_ids[start : start + sender.in_splits[r]]
                assert plan.out_splits[q] == len(block), (r, q)
                got += [q * E + i for i in block]
            want = tuple(g for g, holders in replicas if r in holders)
            assert plan.recv_experts == want, (r, replicas)
            assert tuple(got) == want, (r, replicas, got)


def _weights(layout: str, S: int = 4, D: int = 3, F: int = 5) -> ExpertWeights:
    gen = torch.Generator().manual_seed(len(layout))

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    if layout == "plain":
        return ExpertWeights(t(S, D, F), t(S, F, D))
    if layout == "bias":
        return ExpertWeights(t(S, D, F), t(S, F, D), b1_SF=t(S, F), b2_SD=t(S, D))
    return ExpertWeights(t(S, D, F), t(S, F, D), t(S, F), t(S, D), w3_SDF=t(S, D, F), b3_SF=t(S, F))


def _present(w: ExpertWeights) -> dict[str, torch.Tensor]:
    names = ("w1_SDF", "w2_SFD", "b1_SF", "b2_SD", "w3_SDF", "b3_SF")
    return {n: getattr(w, n) for n in names if getattr(w, n) is not None}


@pytest.mark.parametrize("layout", ["plain", "bias", "swiglu"])
def test_pack_unpack_round_trip_and_gradients(layout):
    w = _weights(layout)
    ids = [2, 0, 2, 3]  # an expert sent to two holders appears twice
    packed = pack_experts(w, ids)
    Q = sum(math.prod(t.shape[1:]) for t in _present(w).values())
    assert packed.shape == (len(ids), Q)
    got = unpack_experts(packed, w)
    assert _present(got).keys() == _present(w).keys()
    coefs = {}
    for n, t in _present(w).items():
        torch.testing.assert_close(_present(got)[n], t[ids].detach(), rtol=0, atol=0, msg=n)
        coefs[n] = torch.randn(_present(got)[n].shape, dtype=torch.float64)
    sum((_present(got)[n] * c).sum() for n, c in coefs.items()).backward()
    for n, t in _present(w).items():
        want = torch.zeros_like(t)
        for j, i in enumerate(ids):  # each packed row's gradient adds to its expert
            want[i] += coefs[n][j]
        torch.testing.assert_close(t.grad, want, rtol=0, atol=0, msg=n)
    empty = pack_experts(w, [])
    assert empty.shape == (0, Q)
    assert unpack_experts(empty, w).w1_SDF.shape == (0,) + tuple(w.w1_SDF.shape[1:])


def test_weights_version_moves_with_every_in_place_write():
    w = _weights("swiglu")
    seen = {weights_version(w)}
    for n, t in _present(w).items():
        _ = t * 2  # reading does not count
        assert weights_version(w) in seen
        with torch.no_grad():
            t.add_(1.0)
        v = weights_version(w)
        assert v not in seen, n
        seen.add(v)


def test_fetch_plan_is_frozen():
    """A step's fetch is shared by the step plan and the dispatcher's last-fetch record."""
    plan = FetchPlan.build(((0, (1,)),), 0, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.in_splits = [0, 0]
