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


def relay_degrees(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int] | None = None
) -> tuple[dict[int, int], int]:
    """Tree edges per rank of ``relay_rounds(owner, holders, distance)`` and its rounds, without
    building the rounds: ({rank: edges}, rounds). In the served order [owner, h0, h1, ...] of n
    ranks, position j sends in every round k with 2**k > j and j + 2**k < n, and receives once
    when j > 0; the tree has (n - 1).bit_length() rounds. Each edge costs both its ranks one
    copy of the weights per direction (forward fetch, gradient return)."""
    if not holders:
        return {}, 0
    dist = distance or (lambda a, b: 0)
    order = [owner, *sorted(holders, key=lambda h: (dist(owner, h), h))]
    n = len(order)
    degrees = {owner: (n - 1).bit_length()}  # the owner sends in every round
    for j in range(1, n):
        # sends in rounds k = j.bit_length() .. (n - j - 1).bit_length() - 1, receives once
        degrees[order[j]] = 1 + max(0, (n - j - 1).bit_length() - j.bit_length())
    return degrees, (n - 1).bit_length()


def node_distance(profile: object) -> Callable[[int, int], int] | None:
    """0 for two ranks of one node, 1 across nodes, from the profile's ``ranks_per_node`` (None
    when the profile has no topology: every pair alike)."""
    per_node = getattr(profile, "ranks_per_node", None)
    if not per_node:
        return None
    return lambda a, b: int(a // per_node != b // per_node)
