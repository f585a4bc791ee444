"""How one expert's replica weights reach their holders without the owner sending every copy.

Two routes, chosen per expert from its holder count H (and the profile's topology):

- **scatter + all-gather** (H >= 2, every holder on the owner's node or no topology): the packed
  row is cut into H near-equal chunks (``torch.tensor_split`` order: the first ``Q % H`` chunks one
  element longer); round 0 the owner sends chunk i to the i-th holder, round 1 every holder sends
  its chunk to every other holder. The owner sends one copy in all (not log2(H + 1)); every holder
  receives one copy and sends (H - 1) / H. Gradients return the reverse way: a reduce-scatter among
  the holders (holder i sums chunk i of every holder's gradient), then each holder sends its summed
  chunk to the owner, which adds it to ``.grad`` once.
- **binomial tree** (H = 1: a direct send; or holders on other nodes): the ranks that hold the
  weights double each round, nearest first (``distance``, then rank), so H holders are served in
  ceil(log2(H + 1)) rounds of whole rows; gradients return the tree in reverse.

Why this rule: with one link the scatter is never worse where it matters. Per expert both routes
move 2H copies in all (sent + received over the ranks); the scatter puts 1 on the owner (the tree
ceil(log2(H + 1)) >= 2 for H >= 2), at most 2 - 1/H < 2 on any holder (the tree's first holder
relays up to log2 H more), and takes 2 rounds (the tree ceil(log2(H + 1)) >= 2). Only the tree's
leaves do less (1 copy): they are the helpers with spare capacity, the owner is the hot rank (a hot
rank owning 4 hot experts at W = 256 sends 4 copies instead of 32). Across nodes the all-gather
would send every holder's chunk over the slow link to every holder on another node (m (1 + 2k) / H
crossing copies for k near and m far holders, the tree ~m): there the tree, nearest first, stays.

Pricing (``relay_degrees``): a rank's copies of one expert = what it sends + what it receives, in
copies of the packed row, each of the two floored to a multiple of ``COPY_GRID`` = 2**-24 (a
holder's sends (H - 1) / H; the executed chunks differ from 1/H by under one element of ~10**7, so
the grid is below the model's own resolution). Every degree is then a float64 with few bits, and
sums of them are exact in any order: the water-filling search's incremental loads equal
``plan_pricing``'s bit for bit. Deterministic: every rank computes the same messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Edge = tuple[int, int]  # (sender, receiver)
# (sender, receiver, chunk j, chunks n): chunk j of the packed row cut into n (n = 1: the whole row)
Message = tuple[int, int, int, int]

COPY_GRID_BITS = 24  # copies are priced in multiples of 2**-24 (module doc)


def piece_range(j: int, n: int, Q: int) -> tuple[int, int]:
    """[start, stop) of chunk j of a packed row of Q elements cut into n parts like
    ``torch.tensor_split(row, n)``: the first Q % n parts hold Q // n + 1 elements."""
    base, extra = divmod(Q, n)
    start = j * base + min(j, extra)
    return start, start + base + (j < extra)


def _grid(numerator: int, denominator: int) -> float:
    """numerator / denominator copies floored to a multiple of 2**-COPY_GRID_BITS (exact)."""
    return ((numerator << COPY_GRID_BITS) // denominator) / (1 << COPY_GRID_BITS)


def _served_order(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int] | None
) -> list[int]:
    """The holders nearest first (``distance`` to the owner, then rank); by rank without one."""
    if distance is None:
        return sorted(holders)
    return sorted(holders, key=lambda h: (distance(owner, h), h))


def uses_scatter(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int] | None = None
) -> bool:
    """Whether the expert's weights travel by scatter + all-gather (module doc): H >= 2 and no
    holder on another node than the owner (``distance`` 0 to every holder, or no topology)."""
    if len(holders) < 2:
        return False
    return distance is None or all(distance(owner, h) == 0 for h in holders)


def relay_rounds(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int] | None = None
) -> tuple[tuple[Edge, ...], ...]:
    """The binomial tree's rounds for one expert: ``rounds[k]`` = the (sender, receiver) pairs of
    round k, ascending by receiver position. ``holders`` must exclude ``owner`` and be distinct.

    The i-th served holder (0-based, nearest first) receives in round floor(log2(i + 1)) from the
    rank at position i + 1 - 2**k of the served order ``[owner, h0, h1, ...]``: each round pairs
    every rank that has the weights with one that has not.
    """
    _check(owner, holders)
    order = [owner, *_served_order(owner, holders, distance or (lambda a, b: 0))]
    rounds: list[tuple[Edge, ...]] = []
    have = 1  # ranks of `order` holding the weights before this round
    while have < len(order):
        new = order[have : 2 * have]
        # the j-th newcomer receives from the j-th rank that already holds the weights
        rounds.append(tuple((order[j], rank) for j, rank in enumerate(new)))
        have += len(new)
    return tuple(rounds)


def relay_messages(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int] | None = None
) -> tuple[tuple[Message, ...], ...]:
    """What the layer executes for one expert: ``rounds[k]`` = the messages of round k, each
    (sender, receiver, chunk j, chunks n). Scatter + all-gather (``uses_scatter``): round 0
    (owner, h_i, i, H) for the i-th holder of the served order, round 1 (h_i, h_j, i, H) for
    every i != j; otherwise the tree's edges (``relay_rounds``) carrying whole rows (j = 0, n = 1).
    """
    _check(owner, holders)
    if not uses_scatter(owner, holders, distance):
        return tuple(
            tuple((a, b, 0, 1) for a, b in edges)
            for edges in relay_rounds(owner, holders, distance)
        )
    order = _served_order(owner, holders, distance)
    H = len(order)
    scatter = tuple((owner, h, i, H) for i, h in enumerate(order))
    # holder i passes its chunk i on to every other holder (receivers ascending by position)
    gather = tuple((a, b, i, H) for i, a in enumerate(order) for b in order if b != a)
    return scatter, gather


def relay_degrees(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int] | None = None
) -> tuple[dict[int, float], int]:
    """Copies of the expert's packed row each rank sends + receives under ``relay_messages`` (the
    module doc's grid), and its rounds, without building the messages: ({rank: copies}, rounds).
    Scatter: the owner 1.0 (H chunks sent), a holder 1.0 received + grid((H - 1) / H) sent, 2
    rounds. Tree, in the served order [owner, h0, h1, ...] of n ranks: position j sends in every
    round k with 2**k > j and j + 2**k < n, receives once when j > 0; (n - 1).bit_length()
    rounds. Each copy is priced in both directions (forward fetch, gradient return)."""
    if not holders:
        return {}, 0
    if uses_scatter(owner, holders, distance):
        H = len(holders)
        holder = 1.0 + _grid(H - 1, H)
        degrees = {owner: 1.0}
        for h in holders:
            degrees[h] = holder
        return degrees, 2
    if distance is None:  # one link: by rank (the water-filling search calls this per probe)
        order = [owner, *sorted(holders)]
    else:
        order = [owner, *sorted(holders, key=lambda h: (distance(owner, h), h))]
    n = len(order)
    degrees = {owner: float((n - 1).bit_length())}  # the owner sends in every round
    for j in range(1, n):
        # sends in rounds k = j.bit_length() .. (n - j - 1).bit_length() - 1, receives once
        degrees[order[j]] = float(1 + max(0, (n - j - 1).bit_length() - j.bit_length()))
    return degrees, (n - 1).bit_length()


def relay_inter_copies(
    owner: int, holders: Sequence[int], distance: Callable[[int, int], int]
) -> dict[int, float]:
    """The part of ``relay_degrees`` that crosses nodes (``distance`` != 0 between the message's
    two ranks), per rank with any: sent and received copies each floored to the grid, as
    ``relay_degrees`` prices them (the scatter runs inside one node: none there)."""
    sent: dict[int, list[int]] = {}  # rank -> [chunks, n] sent across nodes (one n per expert)
    recv: dict[int, list[int]] = {}
    for messages in relay_messages(owner, holders, distance):
        for a, b, _, n in messages:
            if distance(a, b):
                sent.setdefault(a, [0, n])[0] += 1
                recv.setdefault(b, [0, n])[0] += 1
    out: dict[int, float] = {}
    for table in (sent, recv):
        for rank, (k, n) in table.items():
            out[rank] = out.get(rank, 0.0) + _grid(k, n)
    return out


def node_distance(profile: object) -> Callable[[int, int], int] | None:
    """0 for two ranks of one node, 1 across nodes, from the profile's ``ranks_per_node`` (None
    when the profile has no topology: every pair alike)."""
    per_node = getattr(profile, "ranks_per_node", None)
    if not per_node:
        return None
    return lambda a, b: int(a // per_node != b // per_node)


def _check(owner: int, holders: Sequence[int]) -> None:
    if owner in holders or len(set(holders)) != len(holders):
        raise ValueError(f"holders {list(holders)} must be distinct and exclude owner {owner}")
