"""``Plan``'s share entries (the helper plan space) and the replica relay: the scatter +
all-gather of chunks inside the owner's node, the scatter, exchange and all-gather across nodes,
and their pricing (``relay_degrees``, ``relay_inter_copies``) against a count of the messages
they execute."""

from __future__ import annotations

import collections
import random
from fractions import Fraction

import pytest
import torch

from mixmoe.placement.cost_model import Prediction
from mixmoe.placement.plan import Plan
from mixmoe.placement.relay import (
    COPY_GRID_BITS,
    holder_groups,
    node_distance,
    nodes_of,
    piece_range,
    relay_degrees,
    relay_inter_copies,
    relay_messages,
    relay_messages_at,
    relay_rounds,
)

P = Prediction((1.0,), (0.0,), (0,), (0,), (1,), 1.0)


def _plan(**kw) -> Plan:
    return Plan(kw.pop("hot", (0,)), kw.pop("replicas", ((0, (2, 3)),)), P, P, **kw)


def test_segment_runs_follow_shares_then_the_replica_rule() -> None:
    E = 2  # expert 0 is owned by rank 0; ranks 2 and 3 hold replicas
    plan = _plan(shares=((0, 0, ((0, 64), (2, 64), (3, 10))), (1, 0, ((3, 50),))))
    assert plan.segment_runs(0, 0, 138, E) == ((0, 64), (2, 64), (3, 10))
    assert plan.segment_runs(1, 0, 50, E) == ((3, 50),)  # rank 1's rows of 0 go to helper 3
    assert plan.segment_runs(2, 0, 7, E) == ((2, 7),)  # a holder computes its own rows
    assert plan.segment_runs(1, 1, 7, E) == ((0, 7),)  # not hot: at the owner
    assert plan.segment_runs(1, 1, 0, E) == ()
    plan.check_shares([[138, 0], [50, 0], [0, 0], [0, 0]], E, 64)


@pytest.mark.parametrize(
    "shares,counts,match",
    [
        (((0, 0, ((0, 64), (2, 60))),), [[120]], "not its 120 rows"),
        (((0, 0, ((0, 64), (1, 56))),), [[120]], "outside owner and holders"),
        (((0, 0, ((0, 60), (2, 60))),), [[120]], "inside a 64-row block"),
    ],
)
def test_check_shares_rejects(shares, counts, match) -> None:
    plan = _plan(shares=shares)
    with pytest.raises(ValueError, match=match):
        plan.check_shares(counts, 2, 64)


@pytest.mark.parametrize(
    "shares",
    [
        ((1, 0, ((3, 5),)), (0, 0, ((0, 5),))),  # not ascending
        ((0, 0, ((0, 5), (0, 5))),),  # a rank twice
        ((0, 0, ((0, 0),)),),  # an empty run
        ((0, 0, ()),),  # no run
    ],
)
def test_plan_rejects_malformed_shares(shares) -> None:
    with pytest.raises(ValueError, match="share"):
        _plan(shares=shares)


# -- the route (near scatter + all-gather; far scatter, exchange, all-gather) and its pricing ---


def _count(owner: int, holders: list[int], distance=None) -> tuple[dict, int, dict]:
    """The brute-force twin of ``relay_degrees`` and ``relay_inter_copies``: play
    ``relay_messages`` round by round, check every sender holds the piece it sends (the owner
    holds the whole row; a holder what it received in an earlier round) and every holder ends
    with the whole row exactly once, and count each rank's sent and received copies as exact
    fractions (chunk j of n = 1/n copy), all and across nodes (``distance`` != 0), each floored
    to the pricing grid: ({rank: copies}, rounds, {rank: copies across nodes})."""
    rounds = relay_messages(owner, holders, distance)
    have = {owner: {(0, 1)}}  # rank -> pieces (j, n) it holds before the round
    ends: dict[int, list[Fraction]] = collections.defaultdict(lambda: [Fraction(0)] * 4)
    for msgs in rounds:
        assert msgs, "an empty round"
        got = []
        for a, b, j, n in msgs:
            assert (j, n) in have.get(a, ()) or (0, 1) in have.get(a, ()), (a, j, n)
            assert b != a and b in holders
            ends[a][0] += Fraction(1, n)
            ends[b][1] += Fraction(1, n)
            if distance is not None and distance(a, b):
                ends[a][2] += Fraction(1, n)
                ends[b][3] += Fraction(1, n)
            got.append((b, (j, n)))
        for b, piece in got:  # received pieces are usable from the next round on
            assert piece not in have.get(b, set()), "a piece received twice"
            have.setdefault(b, set()).add(piece)
    for h in holders:  # the whole row: once whole, or every chunk of one cut once
        pieces = have[h]
        n = {n for _, n in pieces}
        assert len(n) == 1 and pieces == {(j, *n) for j in range(*n)}, (h, pieces)
    grid = 2**COPY_GRID_BITS

    def floor(x: Fraction) -> Fraction:
        return Fraction(int(x * grid), grid)

    copies = {r: float(floor(e[0]) + floor(e[1])) for r, e in ends.items()}
    inter = {r: float(floor(e[2]) + floor(e[3])) for r, e in ends.items() if e[2] or e[3]}
    return copies, len(rounds), inter


def _nodes(per_node: int):
    """The same topology twice: the relay's ``nodes_of`` (grouped by node) and a plain
    callable (grouped pairwise)."""
    return nodes_of(per_node), lambda a, b: int(a // per_node != b // per_node)


@pytest.mark.parametrize("H", range(0, 40))
def test_relay_degrees_equal_the_count_of_the_executed_messages(H: int) -> None:
    holders = [(7 * h + 3) % 41 for h in range(H)]  # distinct, unordered
    assert relay_degrees(41, holders) == _count(41, holders)[:2]
    for per_node in (4, 8, 16):  # holders on 1-11 nodes, owner 41 on node 41 // per_node
        for distance in _nodes(per_node):
            copies, rounds, inter = _count(41, holders, distance)
            assert relay_degrees(41, holders, distance) == (copies, rounds)
            assert relay_inter_copies(41, holders, distance) == inter


@pytest.mark.parametrize("W,per_node", [(5, 0), (9, 0), (8, 2), (16, 4), (12, 3), (24, 8), (30, 4)])
def test_one_ranks_messages_are_the_whole_routes_filtered(W: int, per_node: int) -> None:
    """``relay_messages_at`` (one rank's messages, built directly) equals the whole route's
    messages that rank sends or receives, round by round, for every rank (owner, near and far
    holders, bystanders); ``relay_rounds`` equals the route's rounds."""
    rng = random.Random(W * 7 + per_node)
    for _ in range(40):
        owner = rng.randrange(W)
        others = [r for r in range(W) if r != owner]
        holders = rng.sample(others, rng.randint(0, len(others)))  # any order
        for distance in _nodes(per_node) if per_node else [None]:
            route = relay_messages(owner, holders, distance)
            assert relay_rounds(owner, holders, distance) == len(route)
            for rank in range(W):
                want = tuple(tuple(m for m in rnd if rank in m[:2]) for rnd in route)
                assert relay_messages_at(rank, owner, holders, distance) == want, (owner, holders)


@pytest.mark.parametrize("W,per_node", [(8, 2), (16, 4), (24, 8), (32, 8), (64, 8), (12, 3)])
def test_relay_twins_on_random_holders_spanning_nodes(W: int, per_node: int) -> None:
    """Random owners and holder sets spanning 2-4 nodes (and any number): the closed forms
    equal the count of the executed messages, for both forms of the topology."""
    rng = random.Random(W * 100 + per_node)
    for _ in range(60):
        owner = rng.randrange(W)
        nodes = rng.sample(range(W // per_node), min(W // per_node, rng.randint(2, 4)))
        pool = [r for r in range(W) if r // per_node in nodes and r != owner]
        if rng.random() < 0.3:  # any holders at all
            pool = [r for r in range(W) if r != owner]
        holders = rng.sample(pool, rng.randint(1, len(pool)))
        for distance in _nodes(per_node):
            copies, rounds, inter = _count(owner, holders, distance)
            assert relay_degrees(owner, holders, distance) == (copies, rounds)
            assert relay_inter_copies(owner, holders, distance) == inter


def test_route_across_nodes_message_by_message() -> None:
    """Owner 1 on node 0 (nodes of 4); near holders 0, 2; far nodes {5, 6} and {9} (R = 3
    chunks, L = 2): round 0 the near scatter (chunks of 2) and the far scatter (chunks of 3);
    round 1 the near all-gather and the exchange (chunk 2 to node {5, 6}'s first holder, chunks
    0 and 1 to 9); round 2 the all-gather inside node {5, 6}."""
    rounds = relay_messages(1, [9, 6, 2, 5, 0], nodes_of(4))
    assert rounds == (
        ((1, 0, 0, 2), (1, 2, 1, 2), (1, 5, 0, 3), (1, 6, 1, 3), (1, 9, 2, 3)),
        ((0, 2, 0, 2), (2, 0, 1, 2), (5, 9, 0, 3), (6, 9, 1, 3), (9, 5, 2, 3)),
        ((5, 6, 0, 3), (5, 6, 2, 3), (6, 5, 1, 3)),
    )
    assert holder_groups(1, [9, 6, 2, 5, 0], nodes_of(4)) == ([0, 2], [[5, 6], [9]])
    with pytest.raises(ValueError, match="exclude owner"):
        relay_messages(1, [1, 2])


@pytest.mark.parametrize("per_node", [2, 4, 8])
@pytest.mark.parametrize("nodes", [2, 3, 4, 8])
def test_weights_cross_once_per_node_and_no_rank_is_a_hot_spot(per_node: int, nodes: int) -> None:
    """Every rank of ``nodes`` full nodes holds the owner's expert: the weights cross the slow
    link once per far node in all (not per holder), the owner sends one copy per link class
    (near, far), no rank sends + receives more than 2 copies, a far holder moves under
    2 / per_node copies across nodes (one leader per node would move 2 - 1 / L), in at most 3
    rounds."""
    W = per_node * nodes
    owner, holders = 1 % W, [r for r in range(W) if r != 1 % W]
    distance = nodes_of(per_node)
    crossing = sum(
        Fraction(1, n) for rnd in relay_messages(owner, holders, distance) for a, b, _, n in rnd
        if distance(a, b)
    )  # fmt: skip
    assert crossing == nodes - 1  # the far nodes
    degrees, rounds = relay_degrees(owner, holders, distance)
    near = per_node > 1
    assert degrees[owner] == 1.0 + near and max(degrees.values()) <= 2.0
    assert rounds == (3 if nodes > 2 and per_node > 1 else 2)
    inter = relay_inter_copies(owner, holders, distance)
    assert inter[owner] == 1.0
    far = [h for h in holders if distance(owner, h)]
    assert all(inter[h] < 2 / per_node for h in far), inter
    assert not any(h in inter for h in holders if not distance(owner, h))


@pytest.mark.parametrize("H", range(2, 12))
def test_scatter_owner_sends_one_copy_and_holders_under_two(H: int) -> None:
    """One link (or every holder on the owner's node): the owner sends one copy (a tree:
    ceil(log2(H + 1))), no holder sends + receives 2 copies or more, 2 rounds; the chunks are
    ``tensor_split``'s."""
    holders = list(range(1, H + 1))
    degrees, rounds = relay_degrees(0, holders)
    assert rounds == 2 and relay_degrees(0, holders, nodes_of(H + 1)) == (degrees, rounds)
    assert degrees[0] == 1.0 and max(degrees.values()) < 2.0
    assert all(abs(degrees[h] - (2 - 1 / H)) < 2**-23 for h in holders)
    row = torch.arange(1000 + H)
    for j, part in enumerate(torch.tensor_split(row, H)):
        lo, hi = piece_range(j, H, row.numel())
        assert part.tolist() == list(range(lo, hi))
    assert relay_messages(0, [1]) == (((0, 1, 0, 1),),)  # one holder: the whole row
    assert relay_messages(0, [1], nodes_of(1)) == (((0, 1, 0, 1),),)


def test_node_distance_of_a_profile() -> None:
    from mixmoe.placement import GPU_PROFILE
    from mixmoe.placement.profile_io import load_profile

    assert node_distance(GPU_PROFILE) is None
    nodes = node_distance(load_profile("h100-nvlink-ib"))
    assert nodes.ranks_per_node == 8 and nodes(7, 8) == 1 and nodes(8, 15) == 0


def test_fractional_copies_price_alike_on_both_paths_and_round_to_bytes() -> None:
    """A scattered plan's copies (1 at the owner, 2 - 1/H at holders, H = 3, 5, 6 at once) give
    the same ``Prediction`` from the tensor path (``prediction_W``) and the list path
    (``prediction_lists``, ``rank_seconds`` per rank), weight bytes = round(2 P x copies); also
    where an int64 product would overflow (then Python numbers)."""
    import dataclasses

    from mixmoe.placement import GPU_PROFILE, LayerShape
    from mixmoe.placement.cost_model import StepModel, plan_pricing

    shape = LayerShape(64, 96, 1, 8, 2)
    C = torch.randint(1, 50, (8, 8), generator=torch.Generator().manual_seed(3))
    plan = Plan((0, 2, 7), ((0, (1, 2, 3)), (2, (0, 1, 3, 4, 5)), (7, (1, 2, 3, 4, 5, 6))), P, P)
    loads, rounds = plan_pricing(C, dataclasses.replace(plan, relay=True), 1)
    assert rounds == 2 and not all(x.is_integer() for x in loads[3].tolist())
    model = StepModel(shape, GPU_PROFILE, True)
    weight = 2 * shape.params_bytes_per_expert
    rows, local, remote, replica = loads.tolist()
    listed = model.prediction_lists(*[list(map(int, x)) for x in (rows, local, remote)], replica)
    assert model.prediction_W(loads) == listed  # both: one fetch round (the flag form)
    assert listed.weight_bytes == tuple(round(weight * x) for x in replica)
    assert model.prediction_W(loads, rounds).weight_bytes == listed.weight_bytes
    tiny = StepModel(LayerShape(1, 1, 4, 8, 4), GPU_PROFILE, True)  # 32 weight bytes per copy
    huge = torch.tensor([[1.0] * 8, [1.0] * 8, [1.0] * 8, [2.0**58 + 0.5] * 7 + [1.5]])
    assert tiny.prediction_W(huge).weight_bytes == tuple(round(32 * x) for x in huge[3].tolist())
