"""Replica fetch bookkeeping and weight packing (``dispatch/replicas.py``), in one process.

``RelayPlan`` is checked by simulating every relay round's all_to_all over all ranks: each sender
holds what it sends, each holder ends with exactly its replicas in ascending order (its replica
slots), the splits agree pairwise, and no rank sends one expert more than ceil(log2(H + 1)) times. ``pack_experts`` / ``unpack_experts`` round-trip every weight layout
(biases, SwiGLU) and route gradients back to the packed experts, summed over duplicates.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from mixmoe.dispatch.replicas import RelayPlan, pack_experts, unpack_experts, weights_version
from mixmoe.ops.expert_mlp import ExpertWeights


def _random_replicas(W: int, E: int, rng: random.Random):
    """((g, holders ascending, never the owner), ...) for a random set of hot experts, by g."""
    out = []
    for g in range(W * E):
        others = [h for h in range(W) if h != g // E]
        if others and rng.random() < 0.5:
            out.append((g, tuple(sorted(rng.sample(others, rng.randint(1, len(others)))))))
    return tuple(out)


@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize("W,E", [(1, 2), (2, 1), (2, 3), (3, 2), (4, 2), (7, 1)])
def test_relay_plan_delivers_each_replica_down_its_tree_in_slot_order(W, E, relay):
    """Simulate every round's all_to_all over all ranks, each rank's buffers holding expert ids:
    every sender holds what it sends, splits agree pairwise, every holder ends with exactly its
    replicas in ascending order, and no rank sends one expert more than ceil(log2(H + 1)) times."""
    rng = random.Random(10 * W + E)
    for _ in range(6):
        replicas = _random_replicas(W, E, rng)
        plans = [RelayPlan.build(replicas, r, W, E, relay=relay) for r in range(W)]
        assert len({len(p.rounds) for p in plans}) == 1  # every rank joins every round
        assert relay or len(plans[0].rounds) == (1 if replicas else 0)  # flat: one round
        bufs = [[[r * E + i for i in p.pack_local_ids]] for r, p in enumerate(plans)]
        assert all(0 <= i < E for p in plans for i in p.pack_local_ids)
        sent_copies: dict[tuple[int, int], int] = {}
        for k in range(len(plans[0].rounds)):
            sends = [[bufs[r][b][i] for b, i in p.rounds[k].send_rows] for r, p in enumerate(plans)]
            for r, p in enumerate(plans):
                rd = p.rounds[k]
                got = []
                for q, sender in enumerate(plans):  # the all_to_all: q's block for r, q ascending
                    start = sum(sender.rounds[k].in_splits[:r])
                    block = sends[q][start : start + sender.rounds[k].in_splits[r]]
                    assert rd.out_splits[q] == len(block), (k, r, q)
                    got += block
                    for g in block:
                        sent_copies[(q, g)] = sent_copies.get((q, g), 0) + 1
                assert tuple(got) == rd.recv_experts, (k, r)
                assert not set(got) & {g for buf in bufs[r] for g in buf}, "received twice"
            for r in range(W):
                bufs[r].append(list(plans[r].rounds[k].recv_experts))
        for r, p in enumerate(plans):
            want = tuple(g for g, holders in replicas if r in holders)
            assert p.recv_experts == want
            assert tuple(bufs[r][b][i] for b, i in p.slot_rows) == want, (r, replicas)
        holders = dict(replicas)
        for (q, g), n in sent_copies.items():
            most = math.ceil(math.log2(len(holders[g]) + 1)) if relay else len(holders[g])
            assert n <= most and (relay or q == g // E), (q, g, n)


def test_relay_is_a_tree_rooted_at_the_owner():
    """What the gradient return relies on (the summation itself runs in
    tests/distributed/test_shares.py): each holder receives once, and following the senders
    from any holder reaches the owner without a cycle, in ceil(log2(H + 1)) rounds."""
    replicas = ((0, (1, 2, 3, 4, 5, 6)),)
    plans = [RelayPlan.build(replicas, r, 7, 1) for r in range(7)]
    parent = {}
    for k in range(len(plans[0].rounds)):
        for r, p in enumerate(plans):
            for q, n in enumerate(p.rounds[k].out_splits):
                if n:
                    assert r not in parent, "a holder receives once"
                    parent[r] = q
    for h in range(1, 7):  # every holder's gradient path reaches the owner without a cycle
        seen, x = set(), h
        while x != 0:
            assert x not in seen
            seen.add(x)
            x = parent[x]
    assert len(plans[0].rounds) == 3  # ceil(log2(7)) rounds, not 6 sends from the owner


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


def test_relay_plan_is_frozen():
    """A step's fetch is shared by the step plan and the dispatcher's last-fetch record."""
    plan = RelayPlan.build(((0, (1,)),), 0, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rounds = ()
