"""``Plan``'s share entries (the helper plan space) and the replica relay tree."""

from __future__ import annotations

import math

import pytest

from mixmoe.placement.cost_model import Prediction
from mixmoe.placement.plan import Plan
from mixmoe.placement.relay import relay_rounds

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
