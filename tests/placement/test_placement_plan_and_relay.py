"""``Plan``'s share entries (the helper plan space) and the replica relay: the binomial tree,
the scatter + all-gather of chunks, and their pricing (``relay_degrees``) against a count of the
messages they execute."""

from __future__ import annotations

import collections
import math
from fractions import Fraction

import pytest
import torch

from mixmoe.placement.cost_model import Prediction
from mixmoe.placement.plan import Plan
from mixmoe.placement.relay import (
    COPY_GRID_BITS,
    piece_range,
    relay_degrees,
    relay_inter_copies,
    relay_messages,
    relay_rounds,
    uses_scatter,
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


@pytest.mark.parametrize("H", range(0, 20))
def test_relay_tree_serves_every_holder_once_in_log_rounds(H: int) -> None:
    owner, holders = 7, [h for h in range(30) if h != 7][:H]
    rounds = relay_rounds(owner, holders)
    assert len(rounds) == math.ceil(math.log2(H + 1))
    have, sent = {owner}, {}
    for edges in rounds:
        receivers = [b for _, b in edges]
        assert all(a in have for a, _ in edges) and not set(receivers) & have
        assert len({a for a, _ in edges}) == len(edges)  # one copy per sender per round
        for a, _ in edges:
            sent[a] = sent.get(a, 0) + 1
        have |= set(receivers)
    assert have == {owner, *holders}
    assert max(sent.values(), default=0) <= len(rounds)


def test_relay_serves_near_holders_first() -> None:
    def node(a, b):
        return int(a // 4 != b // 4)

    rounds = relay_rounds(1, [9, 2, 8, 3], node)
    assert rounds == (((1, 2),), ((1, 3), (2, 8)), ((1, 9),))
    with pytest.raises(ValueError, match="exclude owner"):
        relay_rounds(1, [1, 2])


# -- the scatter + all-gather route and its pricing ------------------------------------------


def _count(owner: int, holders: list[int], distance=None) -> tuple[dict, int]:
    """The brute-force twin of ``relay_degrees``: play ``relay_messages`` round by round, check
    every sender holds the piece it sends (the owner holds the whole row; a holder what it
    received in an earlier round) and every holder ends with the whole row exactly once, and
    count each rank's sent and received copies as exact fractions (chunk j of n = 1/n copy),
    each floored to the pricing grid."""
    rounds = relay_messages(owner, holders, distance)
    have = {owner: {(0, 1)}}  # rank -> pieces (j, n) it holds before the round
    sent: dict[int, Fraction] = {}
    recv: dict[int, Fraction] = {}
    for msgs in rounds:
        got = []
        for a, b, j, n in msgs:
            assert (j, n) in have.get(a, ()) or (0, 1) in have.get(a, ()), (a, j, n)
            assert b != a and b in holders
            sent[a] = sent.get(a, Fraction(0)) + Fraction(1, n)
            recv[b] = recv.get(b, Fraction(0)) + Fraction(1, n)
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

    ranks = set(sent) | set(recv)
    copies = {r: float(floor(sent.get(r, 0)) + floor(recv.get(r, 0))) for r in ranks}
    return copies, len(rounds)


def _node4(a: int, b: int) -> int:
    return int(a // 4 != b // 4)


@pytest.mark.parametrize("H", range(0, 40))
def test_relay_degrees_equal_the_count_of_the_executed_messages(H: int) -> None:
    holders = [(7 * h + 3) % 41 for h in range(H)]  # distinct, unordered
    assert relay_degrees(41, holders) == _count(41, holders)
    near = [h for h in range(40, 44) if h != 41][: min(H, 3)]  # the owner's node: 40-43
    for hs in (near, holders):  # one node (scatter when H >= 2), across nodes (the tree)
        assert relay_degrees(41, hs, _node4) == _count(41, hs, _node4)
        inter = relay_inter_copies(41, hs, _node4)
        tree = [e for rnd in relay_rounds(41, hs, _node4) for e in rnd]
        if uses_scatter(41, hs, _node4):
            assert inter == {}  # the scatter runs inside one node
        else:  # the tree's whole rows across nodes, at both ends
            want = collections.Counter(r for a, b in tree if _node4(a, b) for r in (a, b))
            assert inter == {r: float(n) for r, n in want.items()}


@pytest.mark.parametrize("H", range(2, 12))
def test_scatter_owner_sends_one_copy_and_holders_under_two(H: int) -> None:
    """What the route is for: the owner sends one copy (the tree: ceil(log2(H + 1))), no holder
    sends + receives 2 copies or more, 2 rounds; the chunks are ``tensor_split``'s."""
    holders = list(range(1, H + 1))
    degrees, rounds = relay_degrees(0, holders)
    assert uses_scatter(0, holders) and rounds == 2
    assert degrees[0] == 1.0 and max(degrees.values()) < 2.0
    assert all(abs(degrees[h] - (2 - 1 / H)) < 2**-23 for h in holders)
    tree_owner = relay_degrees(0, holders, lambda a, b: int(b == H))[0][0]  # a far holder
    assert tree_owner == math.ceil(math.log2(H + 1))
    row = torch.arange(1000 + H)
    for j, part in enumerate(torch.tensor_split(row, H)):
        lo, hi = piece_range(j, H, row.numel())
        assert part.tolist() == list(range(lo, hi))
    assert not uses_scatter(0, [1]) and relay_messages(0, [1]) == (((0, 1, 0, 1),),)


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
