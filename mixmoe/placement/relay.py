"""How one expert's replica weights reach their holders without the owner sending every copy.

A binomial tree: the ranks that already hold the weights double each round. Round 0 has the owner
send to the first holder; in round k every rank that holds the weights sends to one that does not,
so H holders are served in ceil(log2(H + 1)) rounds and no rank sends more than that many copies
(a flat fan-out makes the owner send H). Replica gradients return the same tree in reverse (the last
round first), each rank adding what it received to its own before sending on, so the owner's
``.grad`` receives every holder's gradient exactly once.

The holders are served nearest first: by ``distance(owner, holder)`` (e.g. 0 inside the owner's
node, 1 across nodes), then by rank. Deterministic: every rank computes the same rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Edge = tuple[int, int]  # (sender, receiver)


def relay_rounds(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int] | None = None
) -> tuple[tuple[Edge, ...], ...]:
    """The tree's rounds for one expert: ``rounds[k]`` = the (sender, receiver) pairs of round k,
    ascending by receiver position. ``holders`` must exclude ``owner`` and be distinct.

    The i-th served holder (0-based, nearest first) receives in round floor(log2(i + 1)) from the
    rank at position i + 1 - 2**k of the served order ``[owner, h0, h1, ...]``: each round pairs
    every rank that has the weights with one that has not.
    """
    if owner in holders or len(set(holders)) != len(holders):
        raise ValueError(f"holders {list(holders)} must be distinct and exclude owner {owner}")
    dist = distance or (lambda a, b: 0)
    order = [owner, *sorted(holders, key=lambda h: (dist(owner, h), h))]
    rounds: list[tuple[Edge, ...]] = []
    have = 1  # ranks of `order` holding the weights before this round
    while have < len(order):
        new = order[have : 2 * have]
        # the j-th newcomer receives from the j-th rank that already holds the weights
        rounds.append(tuple((order[j], rank) for j, rank in enumerate(new)))
        have += len(new)
    return tuple(rounds)
