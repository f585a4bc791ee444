"""Replica fetch bookkeeping and weight packing (``dispatch/replicas.py``), in one process.

``RelayPlan`` is checked by simulating every round's all_to_all over all ranks with the pieces
(whole rows or chunks) each rank holds: each sender holds what it sends, the splits agree
pairwise, each holder ends with every chunk of exactly its replicas in slot order, and the
messages executed are the route's (``relay_messages``, with one link or holders spanning nodes),
priced as ``relay_degrees`` says.
``pack_experts`` / ``unpack_experts`` round-trip every weight layout (biases, SwiGLU) and route
gradients back to the packed experts, summed over duplicates.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from fractions import Fraction

import pytest
import torch

from mixmoe.dispatch.replicas import (
    RelayPlan,
    fetch_replicas,
    pack_experts,
    unpack_experts,
    weights_version,
)
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.placement.relay import COPY_GRID_BITS, nodes_of, relay_degrees, relay_messages


def _random_replicas(W: int, E: int, rng: random.Random):
    """((g, holders ascending, never the owner), ...) for a random set of hot experts, by g."""
    out = []
    for g in range(W * E):
        others = [h for h in range(W) if h != g // E]
        if others and rng.random() < 0.5:
            out.append((g, tuple(sorted(rng.sample(others, rng.randint(1, len(others)))))))
    return tuple(out)


def _play(plans: list[RelayPlan], E: int) -> tuple[list[list[list]], list[tuple]]:
    """Every round's all_to_all over all ranks, on the pieces (g, j, n) each rank holds: buffer
    0 = its packed owned rows, buffer k + 1 = what round k delivered. Checks that each send reads
    a piece the sender holds (that very piece, or the whole row it is cut from) and that the
    splits agree pairwise; returns the buffers and the executed messages (round, sender,
    receiver, piece)."""
    W = len(plans)
    assert len({len(p.rounds) for p in plans}) == 1  # every rank joins every round
    bufs = [[[(r * E + i, 0, 1) for i in p.pack_local_ids]] for r, p in enumerate(plans)]
    assert all(0 <= i < E for p in plans for i in p.pack_local_ids)
    executed = []
    for k in range(len(plans[0].rounds)):
        sends = []
        for r, p in enumerate(plans):
            out = []
            for b, i, j, n in p.rounds[k].send:
                g, je, ne = bufs[r][b][i]
                assert (je, ne) in ((j, n), (0, 1)), "a sender holds what it sends"
                out.append((g, j, n))
            sends.append(out)
        for r, p in enumerate(plans):
            rd, got = p.rounds[k], []
            for q, sender in enumerate(plans):  # the all_to_all: q's block for r, q ascending
                start = sum(sender.rounds[k].in_splits[:r])
                block = sends[q][start : start + sender.rounds[k].in_splits[r]]
                assert rd.out_splits[q] == len(block), (k, r, q)
                got += block
                executed += [(k, q, r, piece) for piece in block]
            assert tuple(got) == rd.recv, (k, r)
            assert not set(got) & {x for buf in bufs[r] for x in buf}, "received twice"
        for r in range(W):
            bufs[r].append(list(plans[r].rounds[k].recv))
    return bufs, executed


@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize(
    "W,E,per_node",
    [(1, 2, 0), (2, 1, 0), (2, 3, 0), (3, 2, 0), (4, 2, 0), (7, 1, 0), (4, 2, 2), (4, 1, 1),
     (6, 1, 2), (8, 1, 2), (9, 2, 3), (12, 1, 4)],
)  # fmt: skip
def test_relay_plan_delivers_each_replica_by_its_route_in_slot_order(W, E, per_node, relay):
    """Every holder ends with all chunks of exactly its replicas, in slot order; the messages
    executed are the route's (one link, or ``per_node`` ranks per node: holders spanning 2-4
    nodes), and each rank's copies of each expert (a brute-force count of the executed
    messages, chunk j of n = 1/n copy) are what ``relay_degrees`` prices."""
    rng = random.Random(10 * W + E + 1000 * per_node)
    distance = nodes_of(per_node) if per_node else None
    for _ in range(6):
        replicas = _random_replicas(W, E, rng)
        plans = [RelayPlan.build(replicas, r, W, E, distance, relay=relay) for r in range(W)]
        assert relay or len(plans[0].rounds) == (1 if replicas else 0)  # flat: one round
        bufs, executed = _play(plans, E)
        for r, p in enumerate(plans):
            want = tuple(g for g, holders in replicas if r in holders)
            assert p.recv_experts == want
            for g, takes in zip(want, p.slot_pieces, strict=True):
                pieces = [(bufs[r][b][i][0], j, n) for b, i, j, n in takes]
                n = takes[0][3]
                assert pieces == [(g, j, n) for j in range(n)], (r, g, pieces)
        grid = 2**COPY_GRID_BITS
        for g, holders in replicas:
            mine = [(k, a, b, j, n) for k, a, b, (h, j, n) in executed if h == g]
            if not relay:  # the owner sends every whole copy
                assert sorted(mine) == [(0, g // E, h, 0, 1) for h in holders]
                continue
            route = relay_messages(g // E, holders, distance)
            want = sorted((k, *m) for k, msgs in enumerate(route) for m in msgs)
            assert sorted(mine) == want  # the layer executes the priced route
            sent, recv = {}, {}
            for _, a, b, _, n in mine:
                sent[a] = sent.get(a, 0) + Fraction(1, n)
                recv[b] = recv.get(b, 0) + Fraction(1, n)
            counted = {
                r: float(
                    Fraction(int(sent.get(r, 0) * grid), grid)
                    + Fraction(int(recv.get(r, 0) * grid), grid)
                )
                for r in set(sent) | set(recv)
            }
            degrees, rounds = relay_degrees(g // E, holders, distance)
            assert counted == degrees and rounds == len(route)
            assert all(recv[h] == 1 for h in holders)  # every holder receives one copy
            if len(holders) >= 2 and distance is None:  # scatter: one copy from the owner
                assert sent[g // E] == 1


def test_every_chunk_returns_home_on_a_path_across_nodes():
    """Holders on 3 nodes of 2 (owner 0 on node 0; near holder 1, far nodes {2, 3}, {4, 5}):
    what the gradient return relies on (the summation itself runs in
    tests/distributed/test_shares.py): every piece a rank holds came from exactly one sender,
    and following the senders from any holder's piece reaches the owner without a cycle, in 3
    rounds; the owner sends 2 copies (1 inside its node, 1 across), not one per holder."""
    replicas = ((0, (1, 2, 3, 4, 5)),)
    distance = nodes_of(2)
    plans = [RelayPlan.build(replicas, r, 6, 1, distance) for r in range(6)]
    assert len(plans[0].rounds) == 3
    parent = {}  # (rank, piece) -> sender
    for k in range(3):
        for r, p in enumerate(plans):
            pos = 0
            for q, n in enumerate(p.rounds[k].out_splits):
                for piece in p.rounds[k].recv[pos : pos + n]:
                    assert (r, piece) not in parent, "a piece arrives once"
                    parent[(r, piece)] = q
                pos += n
    for (r, (g, j, n)), _ in list(parent.items()):
        seen, x = set(), r
        while x != 0:  # a piece is sent on as the same piece, or cut from the owner's row
            assert x not in seen
            seen.add(x)
            x = parent[(x, (g, j, n))]
    owner_sent = sum(plans[0].rounds[0].in_splits)
    assert owner_sent == 1 + 4  # the whole row to 1, chunk p of 4 to far holder p


def test_scatter_then_all_gather_on_one_node():
    """Holders on the owner's node: round 0 the owner sends chunk i (of H = 6) to the i-th
    holder, round 1 each holder sends its chunk to the 5 others; every holder assembles the row
    from chunks 0..5 in order."""
    replicas = ((0, (1, 2, 3, 4, 5, 6)),)
    plans = [RelayPlan.build(replicas, r, 7, 1) for r in range(7)]
    assert len(plans[0].rounds) == 2
    first, second = plans[0].rounds
    assert first.in_splits == [0, 1, 1, 1, 1, 1, 1] and second.in_splits == [0] * 7
    for h in range(1, 7):
        r0, r1 = plans[h].rounds
        assert r0.recv == ((0, h - 1, 6),) and r0.out_splits == [1] + [0] * 6
        assert r1.in_splits == [0] + [0 if q == h else 1 for q in range(1, 7)]
        assert sorted(r1.recv) == [(0, j, 6) for j in range(6) if j != h - 1]
        assert [(j, n) for *_, j, n in plans[h].slot_pieces[0]] == [(j, 6) for j in range(6)]


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


class _ThreadWorld:
    """W ranks as W threads of one process: ``all_to_all`` posts each rank's blocks, waits for
    every rank, then takes its own (what the fetch and its backward call)."""

    def __init__(self, W: int) -> None:
        self.W = W
        self.barrier = threading.Barrier(W, timeout=60)
        self.boxes: list[list[torch.Tensor | None]] = [[None] * W for _ in range(W)]

    def rank(self, r: int):
        world = self

        class Comm:
            rank, world_size = r, world.W

            def all_to_all(self, out, inp, out_splits, in_splits, async_op=False):
                for q, block in enumerate(torch.split(inp, in_splits)):
                    world.boxes[r][q] = block.clone()  # sender r's block for q
                world.barrier.wait()
                out.copy_(torch.cat([world.boxes[s][r] for s in range(world.W)]))
                assert [world.boxes[s][r].numel() for s in range(world.W)] == out_splits
                world.barrier.wait()  # every rank has taken its blocks
                return _DoneWork()

        return Comm()


class _DoneWork:
    def wait(self) -> bool:
        return True


@pytest.mark.parametrize("W,E,per_node", [(5, 1, 0), (9, 1, 3), (12, 2, 4), (15, 1, 5)])
def test_fetch_moves_every_replica_and_returns_every_gradient(W, E, per_node):
    _fetch_on_threads(W, E, per_node, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine)")
def test_fetch_on_cuda_tensors():
    """The same fetch with every rank's weights on the GPU (the split and cat views there),
    forward only: autograd runs CUDA backward on one device thread for every caller, so W
    threads waiting for each other inside their backward would wait forever (the gradients'
    return is checked on the CPU above, and on the GPU by ``scripts/gpu/ep_one_gpu.py``)."""
    _fetch_on_threads(12, 2, 4, "cuda", backward=False)


def _fetch_on_threads(W: int, E: int, per_node: int, device: str, backward: bool = True) -> None:
    """``fetch_replicas`` on W threads (its merged reads, its element splits): every holder gets
    its replicas' packed rows exactly, in slot order, and each replica's gradient reaches its
    owner's parameters once, summed over holders (the reference: the replicas list alone).
    Under nodes the holders span 2-3 far nodes of unequal fill, so the exchange's blocks differ
    in length and a holder's chunks lie in several runs."""
    distance = nodes_of(per_node) if per_node else None
    rng = random.Random(W * 7 + per_node)
    # expert 0 held by every rank but its owner and the last rank (the last node one short)
    wide = (0, tuple(range(1, W - 1)))
    replicas = (wide, *((g, h) for g, h in _random_replicas(W, E, rng) if g != 0))
    owned = [_weights("swiglu", S=E) for _ in range(W)]
    for r, w in enumerate(owned):  # distinct weights per rank, leaves on the device
        with torch.no_grad():
            on = {n: (t + r).to(device).requires_grad_(True) for n, t in _present(w).items()}
        owned[r] = ExpertWeights(**on)
    plans = [RelayPlan.build(replicas, r, W, E, distance) for r in range(W)]
    world = _ThreadWorld(W)
    coefs = [None] * W
    got = [None] * W
    errors = []

    def run(r: int) -> None:
        try:
            rows, _ = fetch_replicas(world.rank(r), owned[r], plans[r], None)
            got[r] = rows.detach().clone()
            coefs[r] = torch.randn(rows.shape, dtype=torch.float64,
                                   generator=torch.Generator().manual_seed(r)).to(device)  # fmt: skip
            if backward:
                (rows * coefs[r]).sum().backward()
        except BaseException as e:  # noqa: BLE001 - reported below; the barrier breaks for all
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    if plans[0].compiled is not None:  # the fetch reads the compiled layout, never the tuples
        assert all(p.decoded is None for p in plans)
    want_grad = [{n: torch.zeros_like(t) for n, t in _present(w).items()} for w in owned]
    for r in range(W):
        held = [g for g, holders in replicas if r in holders]
        assert plans[r].recv_experts == tuple(held)
        for slot, g in enumerate(held):
            o, i = divmod(g, E)
            torch.testing.assert_close(
                got[r][slot], pack_experts(owned[o], [i])[0].detach(), rtol=0, atol=0
            )
            back = unpack_experts(coefs[r][slot : slot + 1], owned[o])
            for n, t in _present(back).items():
                want_grad[o][n][i] += t[0]
    for o, w in enumerate(owned):
        for n, t in _present(w).items():
            if backward:
                torch.testing.assert_close(t.grad, want_grad[o][n], msg=f"rank {o} {n}")
