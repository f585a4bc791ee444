"""A plan's per-rank aggregates on tensors: ``cost_model.plan_pricing``'s arithmetic at large W
(the replica rule, ranges, kept holders and one-link relay copies) in a few ``index_add_``
calls, and across nodes the rows that cross them (the replica rule's from block sums of C, the
ranges' in closed form) for plans priced under a topology at any W.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g; o = g // E its owner); P (holder pairs (g, h) of the plan's replicas), G (experts
with ranges or kept holders), K (kept holders), Q (range entries), B (range bounds), I (stream
intervals): the lengths of the flat index vectors below; L nodes of ``ranks_per_node``
consecutive ranks; loads in ``cost_model.LOADS`` order (rows, local, remote, replica).

Why: at W = 1024 the list code gathers every hot expert's whole column twice (C[:, hot] reads
most of the [W, N] matrix: ~5 ms) and walks every holder in Python; here only the counts the
formulas read are gathered (C[h][g] of each holder pair, C[o][g], C[y][g] of each kept holder)
plus one column sum per ranged expert (the transposed view's rows: ~4x cheaper than C[:, hot]).
Across nodes the list code expanded the ranges into share entries (~7000 per plan at W = 256)
and masked the whole [W, N] matrix per pricing.
Every value is an exact integer in int64 (the relay's copies: float64 on the 2**-24 grid, whose
sums are exact in any order: ``relay`` module doc), so the result equals the list code's bit for
bit (``tests/placement/test_placement_loads_tensor.py`` compares both on random plans).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from itertools import chain

import torch

from mixmoe.placement.relay import near_relay

__all__ = ["int_tensor", "plan_loads_tensor", "range_relay_loads_tensor", "relay_copies_tensor"]


def int_tensor(values: Iterable[int]) -> torch.Tensor:
    """int64 [len] of Python ints, through a C array (~2x faster than ``torch.tensor`` of a
    list: a shadow plan has W - 1 holders per hot expert)."""
    buffer = array("q", values)
    if not buffer:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(buffer, dtype=torch.int64)  # shares (and keeps) the array


def _pairs(replicas: list[tuple[int, tuple[int, ...]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_P, h_P) int64: every (expert, holder) pair of ``replicas`` in order."""
    g_P = int_tensor(g for g, _ in replicas).repeat_interleave(
        int_tensor(len(h) for _, h in replicas)
    )
    return g_P, int_tensor(chain.from_iterable(h for _, h in replicas))


def _at(C_WN: torch.Tensor, s_X: torch.Tensor, g_X: torch.Tensor) -> torch.Tensor:
    """C[s][g] for each index pair: one flat gather (no column is read whole)."""
    return C_WN.reshape(-1)[s_X * C_WN.shape[1] + g_X]


def plan_loads_tensor(
    C_WN: torch.Tensor,
    replicas: list[tuple[int, tuple[int, ...]]],
    experts_per_rank: int,
    base_4W: torch.Tensor,
) -> torch.Tensor:
    """``cost_model.plan_loads`` as int64 [4, W]: ``base_4W`` (float64 [4, W], the aggregates
    with nothing replicated) with each holder h of g computing its own C[h][g] rows (rows and
    local += c, remote -= c, one replica) and g's owner no longer computing them (rows and
    remote -= c, one replica served per holder). ``replicas``: (g, holders) with holders
    non-empty."""
    loads_4W = base_4W.to(torch.int64)  # a copy: the float64 input stays as it is
    if not replicas:
        return loads_4W
    g_P, h_P = _pairs(replicas)
    c_P = _at(C_WN, h_P, g_P)
    one_P = torch.ones_like(c_P)
    loads_4W.index_add_(1, h_P, torch.stack([c_P, c_P, -c_P, one_P]))  # at the holders
    zero_P = torch.zeros_like(c_P)
    loads_4W.index_add_(1, g_P // experts_per_rank, torch.stack([-c_P, zero_P, -c_P, one_P]))
    return loads_4W


def range_relay_loads_tensor(
    C_WN: torch.Tensor,
    experts: list[tuple[int, tuple, dict[int, int], tuple[int, ...]]],
    experts_per_rank: int,
    loads_4W: torch.Tensor,
    colsum_N: torch.Tensor | None = None,
) -> None:
    """``ranges.range_loads`` on int64 [4, W] ``loads_4W`` (rows, local, remote used), in place.
    ``colsum_N``: C's column sums (int64 [N]) when the caller has them, else the ranged
    experts' columns are gathered and summed here.
    ``experts``: (g, ranges ((helper, rows), ...), kept {holder: local rows}, holders) of every
    expert with ranges or kept holders. Per expert: others = C[:, g].sum() - C[o][g] - the
    holders' rows + the kept rests; a kept holder y's rest d = C[y][g] - local goes back to the
    stream (y: rows, local -= d, remote += d; o: rows, remote += d); the helpers take their
    rows (rows, remote += n); the owner gives up taken = sum n: the other sources' rows first
    (from_others = min(taken, others): it no longer receives them), then its own (own = taken -
    from_others: sent now, no longer local)."""
    E = experts_per_rank
    G = len(experts)
    if not G:
        return
    g_G = int_tensor(g for g, _, _, _ in experts)
    o_G = g_G // E
    # the stream's rows from sources other than the owner (``ranges._stream_terms``)
    if colsum_N is None:  # rows of the transposed view: ~4x cheaper than C[:, g]
        colsum_G = C_WN.t().index_select(0, g_G).sum(1)
    else:
        colsum_G = colsum_N[g_G]
    ar_G = torch.arange(G)
    i_P = ar_G.repeat_interleave(int_tensor(len(h) for _, _, _, h in experts))
    h_P = int_tensor(chain.from_iterable(h for _, _, _, h in experts))
    held_G = torch.zeros(G, dtype=torch.int64).index_add_(0, i_P, _at(C_WN, h_P, g_G[i_P]))
    others_G = colsum_G - _at(C_WN, o_G, g_G) - held_G
    rows, local, remote = loads_4W[0], loads_4W[1], loads_4W[2]
    if any(k for _, _, k, _ in experts):
        i_K = ar_G.repeat_interleave(int_tensor(len(k) for _, _, k, _ in experts))
        y_K = int_tensor(chain.from_iterable(k for _, _, k, _ in experts))
        local_K = int_tensor(chain.from_iterable(k.values() for _, _, k, _ in experts))
        d_K = _at(C_WN, y_K, g_G[i_K]) - local_K
        others_G.index_add_(0, i_K, d_K)  # the rests stay in the stream
        rows.index_add_(0, y_K, -d_K)
        local.index_add_(0, y_K, -d_K)
        remote.index_add_(0, y_K, d_K)
        rows.index_add_(0, o_G[i_K], d_K)
        remote.index_add_(0, o_G[i_K], d_K)
    taken_G = torch.zeros(G, dtype=torch.int64)
    if any(r for _, r, _, _ in experts):
        i_Q = ar_G.repeat_interleave(int_tensor(len(r) for _, r, _, _ in experts))
        y_Q = int_tensor(y for _, r, _, _ in experts for y, _ in r)
        n_Q = int_tensor(n for _, r, _, _ in experts for _, n in r)
        rows.index_add_(0, y_Q, n_Q)
        remote.index_add_(0, y_Q, n_Q)
        taken_G.index_add_(0, i_Q, n_Q)
    from_others_G = torch.minimum(taken_G, others_G)
    own_G = taken_G - from_others_G
    rows.index_add_(0, o_G, -taken_G)
    remote.index_add_(0, o_G, own_G - from_others_G)
    local.index_add_(0, o_G, -own_G)


def relay_copies_tensor(
    replicas: list[tuple[int, tuple[int, ...]]], experts_per_rank: int, world_size: int
) -> tuple[torch.Tensor, int]:
    """(replica_W float64, rounds): each rank's copies in the one-link relays of ``replicas``
    ((g, holders) with holders non-empty) and the most rounds any takes: the owner 1 per expert,
    each of its k holders ``near_relay(k)``'s copies (``relay.relay_degrees`` without topology,
    which also checks the holders)."""
    replica_W = torch.zeros(world_size, dtype=torch.float64)
    if not replicas:
        return replica_W, 0
    copies, rounds = [], 0
    for g, holders in replicas:
        c, depth = near_relay(g // experts_per_rank, holders)
        copies.append(c)
        rounds = max(rounds, depth)
    g_P, h_P = _pairs(replicas)
    sizes = torch.tensor([len(h) for _, h in replicas], dtype=torch.int64)
    copies_P = torch.tensor(copies, dtype=torch.float64).repeat_interleave(sizes)
    replica_W.index_add_(0, h_P, copies_P)  # grid values: exact sums in any order
    o_G = torch.tensor([g // experts_per_rank for g, _ in replicas], dtype=torch.int64)
    replica_W.index_add_(0, o_G, torch.ones(len(replicas), dtype=torch.float64))
    return replica_W, rounds


def range_crossing_tensor(
    C_WN: torch.Tensor,
    experts: list[tuple[int, tuple, dict[int, int], tuple[int, ...]]],
    experts_per_rank: int,
    ranks_per_node: int,
) -> torch.Tensor:
    """How ranges and kept holders change each rank's remote rows that cross nodes (nodes of
    ``ranks_per_node`` consecutive ranks): int64 [W], to add to the replica rule's
    (``cost_model._inter_node_loads``). ``experts``: as for ``range_relay_loads_tensor``.

    Per expert (``ranges`` module doc): under the replica rule a source that neither owns g
    nor holds it sends its C[s][g] rows to the owner o (crossing when s and o are on two
    nodes; a holder's rows, a kept holder's included, stay at it); with ranges, stream row p
    of source s is computed at the rank whose piece holds p (the helpers' ranges in order,
    then the owner), crossing when that rank is on another node than s. A crossing row counts
    at both ends. The stream's segments (G x (W + 2) starts, one column gather) and the pieces
    (ranges, then the owner's rest) are two sorted boundary lists per expert; merged (one sort,
    experts offset by BIG > every stream's end) they cut the stream into intervals of one
    source and one computing rank each: one ``searchsorted`` into each list names them. The
    same integers as the share loop over ``range_shares`` (a test compares them)."""
    E, P = experts_per_rank, ranks_per_node
    W = C_WN.shape[0]
    G = len(experts)
    delta_W = torch.zeros(W, dtype=torch.int64)
    if not G:
        return delta_W
    node_W = torch.arange(W) // P
    ar_G = torch.arange(G)
    g_G = int_tensor(g for g, _, _, _ in experts)
    o_G = g_G // E
    cols_GW = C_WN.t().index_select(0, g_G)  # a copy: rows of the transposed view
    own_G = cols_GW[ar_G, o_G]
    # the stream's sources: the owner and the holders leave it (kept holders come back below)
    out_X = int_tensor(chain.from_iterable((g // E, *h) for g, _, _, h in experts))
    out_sizes = int_tensor(len(h) + 1 for _, _, _, h in experts)
    cols_GW.view(-1)[ar_G.repeat_interleave(out_sizes) * W + out_X] = 0
    # the replica rule's crossings, undone: each such source's rows went to the owner
    far_GW = node_W.view(1, W) != node_W[o_G].view(G, 1)
    old_GW = cols_GW * far_GW
    delta_W -= old_GW.sum(0)
    delta_W.index_add_(0, o_G, -old_GW.sum(1))
    if any(k for _, _, k, _ in experts):  # a kept holder's rest joins the stream
        i_K = ar_G.repeat_interleave(int_tensor(len(k) for _, _, k, _ in experts))
        y_K = int_tensor(chain.from_iterable(k for _, _, k, _ in experts))
        local_K = int_tensor(chain.from_iterable(k.values() for _, _, k, _ in experts))
        cols_GW.view(-1)[i_K * W + y_K] = _at(C_WN, y_K, g_G[i_K]) - local_K
    S = W + 2
    starts_GS = torch.zeros(G, S, dtype=torch.int64)
    starts_GS[:, 1 : W + 1] = cols_GW.cumsum(1)
    starts_GS[:, W + 1] = starts_GS[:, W] + own_G  # the owner's segment last
    end_G = starts_GS[:, W + 1]
    big = int(end_G.max()) + 1
    starts_X = (starts_GS + ar_G.view(G, 1) * big).view(-1)  # ascending overall
    # the pieces: bounds 0, the ranges' running ends, the stream's end; ranks: the helpers,
    # then the owner (and a placeholder at the end bound, never an interval's start)
    sizes = int_tensor(len(r) + 2 for _, r, _, _ in experts)
    i_B = ar_G.repeat_interleave(sizes)
    rows_B = int_tensor(chain.from_iterable((0, *(n for _, n in r), 0) for _, r, _, _ in experts))
    first_B = torch.zeros(len(rows_B), dtype=torch.bool)
    first_B[sizes.cumsum(0)[:-1]] = True  # each expert's bounds restart at 0
    first_B[0] = True
    at_B = rows_B.cumsum(0)
    at_B -= torch.cummax(torch.where(first_B, at_B, 0), 0).values  # running sums per expert
    last_B = torch.zeros(len(rows_B), dtype=torch.bool)
    last_B[sizes.cumsum(0) - 1] = True
    at_B = torch.where(last_B, end_G[i_B], at_B)
    rank_B = int_tensor(
        chain.from_iterable((*(y for y, _ in r), g // E, g // E) for g, r, _, _ in experts)
    )
    bounds_X = (at_B + i_B * big).contiguous()
    # the merged bounds: every interval has one source slot and one piece
    x_I = torch.cat([starts_X, bounds_X]).sort().values
    len_I = x_I.diff()
    x_I = x_I[:-1]
    e_I = x_I // big
    inside_I = (x_I - e_I * big < end_G[e_I]) & (len_I > 0)
    x_I, len_I, e_I = x_I[inside_I], len_I[inside_I], e_I[inside_I]
    slot_I = torch.searchsorted(starts_X, x_I, right=True) - 1 - e_I * S
    src_I = torch.where(slot_I < W, slot_I, o_G[e_I])  # slot W: the owner's own segment
    dst_I = rank_B[torch.searchsorted(bounds_X, x_I, right=True) - 1]
    cross_I = torch.where(node_W[src_I] != node_W[dst_I], len_I, 0)
    delta_W.index_add_(0, src_I, cross_I)
    delta_W.index_add_(0, dst_I, cross_I)
    return delta_W


def inter_node_loads_tensor(
    C_WN: torch.Tensor,
    replicas: list[tuple[int, tuple[int, ...]]],
    experts_per_rank: int,
    ranks_per_node: int,
) -> tuple[list[int], list[int]]:
    """``cost_model._inter_node_loads`` when W is a multiple of ``ranks_per_node`` P (L = W / P
    nodes): the remote rows that cross nodes under the replica rule, per rank, and the flat
    fan-out's crossing copies. Nothing replicated, source s sends across what it routes to
    other nodes' experts (its row sum less its own node's column block) and the owner of g
    receives across C[:, g]'s rows from other nodes (the column sum less its own node's rows):
    two block reductions of C ([W, L] and [L, N]) instead of [W, N] masks. Then each holder h
    of g computes its own C[h][g] rows: not crossing any more when h and g's owner are on two
    nodes (at both), and such an owner -> holder copy counts once at each."""
    E, P = experts_per_rank, ranks_per_node
    W, N = C_WN.shape
    L = W // P
    node_W = torch.arange(W) // P
    # per source, rows to each node's experts; per expert, rows from each node's sources
    to_node_WL = C_WN.reshape(W, L, P * E).sum(2)
    from_node_LN = C_WN.reshape(L, P, N).sum(1)
    sent_W = to_node_WL.sum(1) - to_node_WL.gather(1, node_W.view(W, 1)).squeeze(1)
    o_N = torch.arange(N) // E
    received_N = from_node_LN.sum(0) - from_node_LN.gather(0, node_W[o_N].view(1, N)).squeeze(0)
    remote_W = sent_W + received_N.view(W, E).sum(1)
    flat_W = torch.zeros(W, dtype=torch.int64)
    replicas = [(g, h) for g, h in replicas if h]
    if replicas:
        g_P = int_tensor(g for g, _ in replicas).repeat_interleave(
            int_tensor(len(h) for _, h in replicas)
        )
        h_P = int_tensor(chain.from_iterable(h for _, h in replicas))
        o_P = g_P // E
        far_P = node_W[h_P] != node_W[o_P]
        c_P = torch.where(far_P, _at(C_WN, h_P, g_P), 0)  # the holder's rows stop crossing
        remote_W.index_add_(0, h_P, -c_P)
        remote_W.index_add_(0, o_P, -c_P)
        far_P = far_P.to(torch.int64)
        flat_W.index_add_(0, h_P, far_P)
        flat_W.index_add_(0, o_P, far_P)
    return remote_W.tolist(), flat_W.tolist()
