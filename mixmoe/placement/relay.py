"""How one expert's replica weights reach their holders without a hot spot on any rank or link.

Legend: o the owner, H holders; with the profile's topology the holders split into k **near**
ones (the owner's node) and R **far** ones on L other nodes, c_n of them on far node n
(R = sum c_n). Without topology every holder is near. A message carries chunk j of the packed
row cut into n parts (``torch.tensor_split`` order: the first ``Q % n`` one element longer).

The route (``relay_messages``), at most 3 rounds:

- **near holders: scatter + all-gather.** k = 1: the whole row, round 0. k >= 2: round 0 the
  owner sends chunk i of k to the i-th near holder (ascending rank); round 1 every near holder
  sends its chunk to the k - 1 others. The owner sends 1 copy, a near holder 2 - 1/k (1 received,
  (k - 1)/k sent).
- **far holders: scatter across, exchange across, all-gather inside** (one cut into R chunks;
  far nodes ordered by their lowest holder, holders by rank: far holder p gets chunk p).
  Round 0 the owner sends chunk p to far holder p: the owner sends 1 copy over the slow link, in
  all. Round 1 (L >= 2) every chunk crosses once more to each other far node: the holder of chunk p
  sends it to one holder of node m, where t numbers the chunks that are not m's own and the
  node's holders take consecutive blocks of t, the first (R - c_m) mod c_m one chunk more (so
  each far node receives every chunk it lacks exactly once, spread evenly over its holders, and
  a holder's chunks lie in at most 3 runs of the row: the fetch reads them as few spans). Last round (round 2, or round 1 when L = 1) every far holder sends every chunk it
  holds to the other holders of its node (fast link). R = 1: the whole row, round 0.

Why this route. The weights cross the slow link L times in all (once per far node: the scatter
1 copy, the exchange L - 1), never per holder, and a far node's share of that traffic is spread
over its c_n holders: a far holder moves grid(1 + e, R) + grid(L - 1, R) copies across (e: the
exchange chunks it receives), under 2 / c_n when the nodes hold c holders each. The "one leader
per node" alternative (the owner scatters to one leader per far node, the leaders all-gather
across, then each leader scatters + all-gathers inside its node) moves the same L copies across
but all on the leaders, 2 - 1/L each, and takes 4 rounds; this route is that one when every far
node has one holder (c_n = 1), and otherwise strictly less on the busiest rank's slow link, in 3
rounds. The owner (the hot rank) sends 1 copy per link class (near, far) whatever H; scattering
among the owner and the leaders (the owner keeps a chunk and sends it on in round 1) would put
2L / (L + 1) copies on the owner's slow link instead of 1, so the owner is not in the all-gather.
Across nodes the one-node scatter + all-gather of all H holders would send every far holder's
chunk to every holder on another node (m (1 + 2k) / H crossing copies for k near and m far):
hence the split by node.

Gradients return exactly the reverse way (``dispatch/replicas.py``: autograd's reverse of each
round): inside each far node a reduce-scatter to the chunk holders, across nodes back to the
chunk's first holder, across once more to the owner; near holders reduce-scatter and send their
chunk home. The owner's chunks add up to the row's gradient, added to ``.grad`` once.

Pricing (``relay_degrees``, ``relay_inter_copies``, closed form: the planner calls them per
probe): a rank's copies of one expert = what it sends + what it receives, in copies of the packed
row, each of the two floored to a multiple of ``COPY_GRID`` = 2**-24 (the executed chunks differ
from 1/n by under one element of ~10**7, so the grid is below the model's own resolution).
Every degree is then a float64 with few bits, and sums of them are exact in any order: the
water-filling search's incremental loads equal ``plan_pricing``'s bit for bit. Deterministic:
every rank computes the same messages. Tests count the same figures from ``relay_messages``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# (sender, receiver, chunk j, chunks n): chunk j of the packed row cut into n (n = 1: the whole row)
Message = tuple[int, int, int, int]
Distance = Callable[[int, int], int]

COPY_GRID_BITS = 24  # copies are priced in multiples of 2**-24 (module doc)


def node_distance(profile: object) -> Distance | None:
    """0 for two ranks of one node, 1 across nodes (nodes of the profile's ``ranks_per_node``
    consecutive ranks), or None when the profile has no topology: every pair alike. The
    function carries ``ranks_per_node``: the relay groups holders by node with it (any other
    ``distance`` callable is grouped pairwise, ``distance(a, b) == 0`` meaning "same node")."""
    per_node = getattr(profile, "ranks_per_node", None)
    if not per_node:
        return None
    return nodes_of(per_node)


def nodes_of(ranks_per_node: int) -> Distance:
    """The ``distance`` of nodes of ``ranks_per_node`` consecutive ranks (``node_distance``): a
    plain function (the planner calls it ~10**5 times per plan), with ``ranks_per_node`` set."""

    def distance(a: int, b: int) -> int:
        return int(a // ranks_per_node != b // ranks_per_node)

    distance.ranks_per_node = ranks_per_node  # type: ignore[attr-defined]
    return distance


def piece_range(j: int, n: int, Q: int) -> tuple[int, int]:
    """[start, stop) of chunk j of a packed row of Q elements cut into n parts like
    ``torch.tensor_split(row, n)``: the first Q % n parts hold Q // n + 1 elements."""
    base, extra = divmod(Q, n)
    start = j * base + min(j, extra)
    return start, start + base + (j < extra)


def _grid(numerator: int, denominator: int) -> float:
    """numerator / denominator copies floored to a multiple of 2**-COPY_GRID_BITS (exact)."""
    return ((numerator << COPY_GRID_BITS) // denominator) / (1 << COPY_GRID_BITS)


def holder_groups(
    owner: int, holders: Sequence[int], distance: Distance | None = None
) -> tuple[list[int], list[list[int]]]:
    """(near holders ascending, far nodes' holders): each far node's holders ascending, the
    nodes ordered by their lowest holder. Without ``distance`` every holder is near.
    ``holders`` must exclude ``owner`` and be distinct (``ValueError`` otherwise)."""
    _check(owner, holders)
    ordered = sorted(holders)
    if distance is None:
        return ordered, []
    per_node = getattr(distance, "ranks_per_node", None)
    near: list[int] = []
    far: dict[int, list[int]] = {}  # insertion order: by lowest holder (ranks ascending)
    if per_node is not None:
        home = owner // per_node
        for h in ordered:
            key = h // per_node
            if key == home:
                near.append(h)
            else:
                far.setdefault(key, []).append(h)
        return near, list(far.values())
    groups: list[list[int]] = []
    for h in ordered:  # any distance callable: pairwise, 0 = same node
        if distance(owner, h) == 0:
            near.append(h)
            continue
        for grp in groups:
            if distance(grp[0], h) == 0:
                grp.append(h)
                break
        else:
            groups.append([h])
    return near, groups


def _exchange_block(i: int, c: int, lacking: int) -> tuple[int, int]:
    """[lo, hi) of t, the index among a far node's ``lacking`` chunks that are not its own, that
    the node's i-th holder (of c) receives in the exchange: consecutive blocks, the first
    ``lacking % c`` holders one chunk more (so a holder's chunks form at most 2 runs of the row,
    around the node's own chunks)."""
    q, extra = divmod(lacking, c)
    lo = i * q + min(i, extra)
    return lo, lo + q + (i < extra)


def _exchange_receiver(p: int, start: int, group: list[int], R: int) -> int:
    """The holder of far node ``group`` (its chunks start at ``start``, of R) that receives
    chunk p in the exchange: the one whose block (``_exchange_block``) holds p's index t among
    the chunks that are not the node's."""
    c = len(group)
    t = p if p < start else p - c  # p is never in [start, start + c): those are the node's own
    q, extra = divmod(R - c, c)
    big = extra * (q + 1)  # the first `extra` holders' blocks, q + 1 chunks each
    return group[t // (q + 1) if t < big else extra + (t - big) // q]


def relay_messages(
    owner: int, holders: Sequence[int], distance: Distance | None = None
) -> tuple[tuple[Message, ...], ...]:
    """What the layer executes for one expert: ``rounds[k]`` = the messages of round k, each
    (sender, receiver, chunk j, chunks n), sorted; empty rounds dropped (module doc: near
    scatter + all-gather, far scatter + exchange + all-gather inside each node). ``distance``:
    the profile's topology (``node_distance``), None for one link."""
    near, groups = holder_groups(owner, holders, distance)
    r0: list[Message] = []
    r1: list[Message] = []
    r2: list[Message] = []
    k = len(near)
    if k == 1:
        r0.append((owner, near[0], 0, 1))
    elif k >= 2:
        r0 += [(owner, h, i, k) for i, h in enumerate(near)]
        # near holder i passes its chunk i on to every other near holder
        r1 += [(a, b, i, k) for i, a in enumerate(near) for b in near if b != a]
    far = [h for grp in groups for h in grp]  # far holder p receives chunk p in round 0
    R, L = len(far), len(groups)
    if R == 1:
        r0.append((owner, far[0], 0, 1))
    elif R >= 2:
        r0 += [(owner, h, p, R) for p, h in enumerate(far)]
        held = {h: [p] for p, h in enumerate(far)}  # chunks each far holder has to pass on
        starts = [0]  # each far node's first chunk
        for grp in groups[:-1]:
            starts.append(starts[-1] + len(grp))
        for p, sender in enumerate(far):
            for grp, start in zip(groups, starts, strict=True):
                if not start <= p < start + len(grp):  # chunk p crosses once to each other node
                    q = _exchange_receiver(p, start, grp, R)
                    r1.append((sender, q, p, R))
                    held[q].append(p)
        # inside each far node: every chunk a holder has goes to the node's other holders
        last = r2 if L >= 2 else r1
        last += [
            (a, b, p, R) for grp in groups for a in grp for p in held[a] for b in grp if b != a
        ]
    return tuple(tuple(sorted(rnd)) for rnd in (r0, r1, r2) if rnd)


def relay_degrees(
    owner: int, holders: Sequence[int], distance: Distance | None = None
) -> tuple[dict[int, float], int]:
    """Copies of the expert's packed row each rank sends + receives under ``relay_messages`` (the
    module doc's grid), and its rounds, in closed form: ({rank: copies}, rounds).

    The owner: 1 per nonempty class (near, far). A near holder: 1 (k = 1) or 1 + grid((k-1)/k).
    A far holder (R = 1: 1): receives R chunks (1 copy); the i-th of its node's c holders sends
    L - 1 chunks in the exchange and (1 + e_i)(c - 1) inside its node, e_i =
    ceil((R - c - i) / c) (the node lacks R - c chunks, dealt in blocks: its first
    (R - c) mod c holders get one more). Rounds: 1, + 1 when k >= 2 or R >= 2, + 1 when L >= 2 and a
    far node has 2 holders or more. Each copy is priced in both directions (forward fetch,
    gradient return)."""
    if not holders:
        return {}, 0
    near, groups = holder_groups(owner, holders, distance)
    k, L = len(near), len(groups)
    R = sum(map(len, groups))
    degrees = {owner: float((k > 0) + (R > 0))}
    if near:
        near_copies = 1.0 if k == 1 else 1.0 + _grid(k - 1, k)
        for h in near:
            degrees[h] = near_copies
    if R == 1:
        degrees[groups[0][0]] = 1.0
    elif R >= 2:
        for grp in groups:
            c = len(grp)
            # e_i takes two values over a node: two grid values per node
            extra = (R - c) % c  # holders 0 .. extra - 1 receive one chunk more
            low = 1.0 + _grid(L - 1 + (1 + (R - c) // c) * (c - 1), R)
            high = 1.0 + _grid(L - 1 + (2 + (R - c) // c) * (c - 1), R) if extra else low
            for i, h in enumerate(grp):
                degrees[h] = high if i < extra else low
    rounds = 1 + (k >= 2 or R >= 2) + (L >= 2 and any(len(grp) >= 2 for grp in groups))
    return degrees, rounds


def near_relay(owner: int, holders: Sequence[int]) -> tuple[float, int]:
    """``relay_degrees`` of one expert without topology, per holder: (copies each of its k >= 1
    holders sends + receives, rounds); the owner sends 1 copy. ``ValueError`` as
    ``relay_degrees`` for holders that repeat or include the owner."""
    _check(owner, holders)
    k = len(holders)
    return (1.0, 1) if k == 1 else (1.0 + _grid(k - 1, k), 2)


def relay_inter_copies(owner: int, holders: Sequence[int], distance: Distance) -> dict[int, float]:
    """The part of ``relay_degrees`` that crosses nodes, per rank with any, in closed form: the
    owner 1 (the far scatter); the i-th far holder of a node of c grid((1 + e_i) / R) received
    (its round-0 chunk and its exchange chunks) + grid((L - 1) / R) sent (R = 1: 1); near
    holders none (they are served inside the owner's node)."""
    _, groups = holder_groups(owner, holders, distance)
    L, R = len(groups), sum(map(len, groups))
    if R == 0:
        return {}
    out = {owner: 1.0}
    if R == 1:
        out[groups[0][0]] = 1.0
        return out
    sent = _grid(L - 1, R)
    for grp in groups:
        c = len(grp)
        extra = (R - c) % c  # as in ``relay_degrees``: two values per node
        low = _grid(1 + (R - c) // c, R) + sent
        high = _grid(2 + (R - c) // c, R) + sent if extra else low
        for i, h in enumerate(grp):
            out[h] = high if i < extra else low
    return out


def _check(owner: int, holders: Sequence[int]) -> None:
    if owner in holders or len(set(holders)) != len(holders):
        raise ValueError(f"holders {list(holders)} must be distinct and exclude owner {owner}")


MAX_ROUNDS = 3  # no route takes more (module doc)


def relay_rounds(owner: int, holders: Sequence[int], distance: Distance | None = None) -> int:
    """``len(relay_messages(owner, holders, distance))`` in closed form: 0 without holders, else
    round 0 (the scatter), + 1 when k >= 2 or R >= 2 (an all-gather or the exchange), + 1 when
    L >= 2 and a far node has 2 holders or more (its all-gather inside the node)."""
    if not holders:
        return 0
    per_node = getattr(distance, "ranks_per_node", None)
    if per_node is not None:  # by node numbers alone (what the fetch asks for every expert)
        _check(owner, holders)
        home = owner // per_node
        nodes = {h // per_node for h in holders}
        far = len(nodes) - (home in nodes)  # L
        R = len(holders) - sum(1 for h in holders if h // per_node == home)
        near = len(holders) - R
        return 1 + (near >= 2 or R >= 2) + (far >= 2 and R > far)  # R > L: a node holds 2+
    near, groups = holder_groups(owner, holders, distance)
    R = sum(map(len, groups))
    pairs = len(groups) >= 2 and any(len(grp) >= 2 for grp in groups)
    return 1 + (len(near) >= 2 or R >= 2) + pairs


def relay_messages_at(
    rank: int, owner: int, holders: Sequence[int], distance: Distance | None = None
) -> tuple[tuple[Message, ...], ...]:
    """``relay_messages(owner, holders, distance)`` with only the messages ``rank`` sends or
    receives (the same rounds, some of them empty here): O(H) steps for one rank where the whole
    route has O(H**2) messages (each node's all-gather). What ``dispatch.replicas.RelayPlan``
    builds per rank; ``tests/placement/test_placement_plan_and_relay.py`` checks it against
    filtering the whole route."""
    rounds = relay_rounds(owner, holders, distance)
    if rank != owner and rank not in holders:
        return ((),) * rounds
    near, groups = holder_groups(owner, holders, distance)
    out: list[list[Message]] = [[] for _ in range(3)]
    k = len(near)
    if rank == owner:  # round 0: the scatters (near, then far)
        out[0] += (
            [(owner, near[0], 0, 1)] if k == 1 else [(owner, h, i, k) for i, h in enumerate(near)]
        )
    elif rank in near:
        i = near.index(rank)
        out[0].append((owner, rank, 0, 1) if k == 1 else (owner, rank, i, k))
        if k >= 2:  # round 1: it passes chunk i on, and receives every other near chunk
            out[1] += [(rank, b, i, k) for b in near if b != rank]
            out[1] += [(a, rank, j, k) for j, a in enumerate(near) if a != rank]
    far = [h for grp in groups for h in grp]
    R, L = len(far), len(groups)
    if R == 1 and rank in (owner, far[0]):
        out[0].append((owner, far[0], 0, 1))
    elif R >= 2:
        if rank == owner:
            out[0] += [(owner, h, p, R) for p, h in enumerate(far)]
        elif rank in far:
            mine = far.index(rank)  # rank's chunk
            out[0].append((owner, rank, mine, R))
            starts = [0]
            for grp in groups[:-1]:
                starts.append(starts[-1] + len(grp))
            home = next(n for n, grp in enumerate(groups) if rank in grp)
            grp, at = groups[home], starts[home]  # rank's node: its holders' chunks from `at`
            c = len(grp)

            def received(i: int) -> list[int]:
                # the chunks the node's i-th holder receives in the exchange: those p, not the
                # node's own, whose index t among them is in its block (``_exchange_block``)
                return [t if t < at else t + c for t in range(*_exchange_block(i, c, R - c))]

            # the exchange (round 1): every chunk crosses once to each other far node (rank's
            # own to one holder of each), and each of rank's received chunks comes from its
            # holder; O(L + R / c) messages here where every rank's are O(R * L)
            for other, start in zip(groups, starts, strict=True):
                if start != at:
                    out[1].append((rank, _exchange_receiver(mine, start, other, R), mine, R))
            i_rank = grp.index(rank)
            out[1] += [(far[p], rank, p, R) for p in received(i_rank)]
            # each far holder passes on inside its node its own chunk and those it received
            held = {b: [at + i, *received(i)] for i, b in enumerate(grp)}
            last = out[2] if L >= 2 else out[1]
            last += [(rank, b, p, R) for p in held[rank] for b in grp if b != rank]
            last += [(a, rank, p, R) for a in grp if a != rank for p in held[a]]
    return tuple(tuple(sorted(rnd)) for rnd in out[:rounds])
