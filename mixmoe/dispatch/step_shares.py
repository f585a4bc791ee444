"""Host-side bookkeeping of one step whose plan has share entries (the helper plan space).

Legend: W ranks, E experts per rank, N = W*E experts, H replicas held here, C the count matrix
[W, N], M rows of one receive-side column set (own experts and replicas held here).

A share entry cuts segment (s, g) -- the rows source s routes to expert g, in their order on s
(ascending token, then choice) -- into consecutive runs computed at named ranks: the owner of g,
the source, or a helper holding a replica of g (``placement.plan``). So on rank r:

- as a source, every kept row belongs to one *run* of its segment; sorted by expert (stable),
  the rows of all segments are the runs back to back, and each run gets a sort key that puts
  it in its final group: [own experts computed here | replicas computed here | sent, by
  receiver, then expert | dropped]. One stable sort by the run keys gives the step's row order.
- as a receiver, it gets from each source s the runs at r of segments (s, g) for its own
  experts g and the experts it holds replicas of, in expert order (the sender's key order): the
  received rows of replica experts are computed with the replicas, the rest with owned weights.

Everything follows from C and the plan (no exchange): every rank computes the same splits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from mixmoe.placement.plan import Plan


@dataclass(frozen=True)
class SourceRuns:
    """This rank's kept rows as runs (module doc).

    run_len: rows of each run, in by-expert order (expert ascending, then the segment's runs).
    run_key: sort key of each run: e for own slot e, E + h for replica slot h, E + H + c*N + g
             for rows of expert g sent to rank c.
    own_c:   rows computed here with each own slot (E).
    rep_c:   rows computed here with each replica slot (H).
    n_send:  rows sent away.
    owned_rows_stay: every row routed here to an own expert is computed here (a plan-free
             layout of the own rows is then still valid: the async own-rows compute).
    """

    run_len: list[int]
    run_key: list[int]
    own_c: list[int]
    rep_c: list[int]
    n_send: int
    owned_rows_stay: bool


def share_fields(
    C_WN: torch.Tensor,
    plan: Plan,
    rank: int,
    experts_per_rank: int,
    recv_WE: torch.Tensor,
    rows_moved: int,
    moved_by: tuple | None = None,
) -> dict:
    """The ``StepPlan`` fields a share plan changes, for ``rank``: ``recv_WE`` and ``rows_moved``
    are the replica rule's (``build_step_plan``'s vectorised values), patched here segment by
    segment for the share entries only. ``plan``'s entries may be those ``rank`` reads only
    (``Plan.expanded(..., rank)``); ``moved_by``: then the entries whose rows crossing ranks
    ``rows_moved`` does not count yet (default: all of ``plan``'s)."""
    W, E, r = C_WN.shape[0], experts_per_rank, rank
    N = W * E
    rep = plan.replica_slots(r)
    rep_slot = {g: h for h, g in enumerate(rep)}

    # -- source side: this rank's rows as runs
    counts_r = C_WN[r].tolist()
    source_runs = _runs_by_expert if N <= LIST_RUNS_N else _runs_by_key
    run_len, run_key, own_c, rep_c, in_splits = source_runs(C_WN[r], counts_r, plan, r, E, rep)

    # -- receive side: columns = own experts and replicas held here, by expert id
    cols = sorted([*range(r * E, (r + 1) * E), *rep])
    col_of = {g: j for j, g in enumerate(cols)}
    recv_WM = torch.zeros(W, len(cols), dtype=torch.int64)
    own_cols = [col_of[g] for g in range(r * E, (r + 1) * E)]
    recv_WM[:, own_cols] = recv_WE  # the replica rule's receive counts (a replica column: 0)
    # the shared segments' rows computed here, written in one indexed assignment (entries are
    # unique by (s, g): strictly ascending); W = 1024: ~10**3 entries, ~1 us each one by one
    here = [(s, col_of[g], dict(runs).get(r, 0)) for s, g, runs in plan.shares
            if s != r and g in col_of]  # fmt: skip
    if here:
        s_K, j_K, n_K = zip(*here, strict=True)
        recv_WM[list(s_K), list(j_K)] = torch.tensor(n_K, dtype=torch.int64)
    recv_WM[r] = 0

    # -- rows crossing ranks: the replica rule's total, corrected for the shared segments (their
    # counts C[s][g] read with one gather, not one tensor index each)
    moved = plan.shares if moved_by is None else moved_by
    counts_K = C_WN[[s for s, _, _ in moved], [g for _, g, _ in moved]].tolist() if moved else []
    for (s, g, runs), c_sg in zip(moved, counts_K, strict=True):
        before = c_sg if plan.computed_at(s, g, E) != s else 0
        rows_moved += sum(n for c, n in runs if c != s) - before

    return {
        "send_experts": (),
        "in_splits": in_splits,
        "out_splits": recv_WM.sum(1).tolist(),
        "recv_counts": recv_WM.reshape(-1).tolist(),  # source-major, then expert id
        "recv_slots": [g - r * E if g // E == r else rep_slot[g] for g in cols] * W,
        "recv_replica": [g // E != r for g in cols] * W,
        "rows_moved": rows_moved,
        "runs": SourceRuns(
            run_len=run_len,
            run_key=run_key,
            own_c=own_c,
            rep_c=rep_c,
            n_send=sum(in_splits),
            owned_rows_stay=sum(own_c) == sum(counts_r[r * E : (r + 1) * E]),
        ),
    }


LIST_RUNS_N = 256  # experts up to which a rank's runs are walked expert by expert (_runs_by_expert)


def _runs_by_expert(
    counts_N: torch.Tensor, counts_r: list[int], plan: Plan, r: int, E: int, rep: tuple
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """This rank's runs (``SourceRuns``' run_len, run_key, own_c, rep_c) and the rows it sends
    to each rank: every expert it routes rows to walked in turn (``Plan.segment_runs``)."""
    W, H = len(counts_r) // E, len(rep)
    rep_slot = {g: h for h, g in enumerate(rep)}
    entry_g = {g for s, g, _ in plan.shares if s == r}
    experts = sorted(set(torch.nonzero(counts_N).flatten().tolist()) | entry_g)
    out = ([], [], [0] * E, [0] * H, [0] * W)  # run_len, run_key, own_c, rep_c, in_splits
    for g in experts:
        _walk_segment(plan, r, g, counts_r[g], E, rep_slot, out)
    return out


def _walk_segment(
    plan: Plan, r: int, g: int, rows: int, E: int, rep_slot: dict, out: tuple
) -> None:
    """The runs of this rank's segment of g (``Plan.segment_runs``) appended to ``out`` =
    (run_len, run_key, own_c, rep_c, in_splits), each with its sort key (``SourceRuns.run_key``),
    its rows counted where they are computed."""
    run_len, run_key, own_c, rep_c, in_splits = out
    H, N = len(rep_c), len(in_splits) * E
    for c, n in plan.segment_runs(r, g, rows, E):
        if c != r:
            key = E + H + c * N + g  # by receiver, then expert: the receiver's order
            in_splits[c] += n
        elif g // E == r:
            key = g - r * E  # own slot
            own_c[key] += n
        else:  # computed here with the replica (check_shares: r holds one)
            key = E + rep_slot[g]
            rep_c[key - E] += n
        run_len.append(n)
        run_key.append(key)


def _runs_by_key(
    counts_N: torch.Tensor, counts_r: list[int], plan: Plan, r: int, E: int, rep: tuple
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """``_runs_by_expert`` for many experts (W = 1024: ~4000 a rank routes to, ~10 of them with
    share entries): a segment without an entry is one run at the rank computing it
    (``Plan.computed_at``), its key from the expert id alone, so all of them in tensor ops; the
    experts with entries walk their runs, spliced in at their place in expert order."""
    W, H = len(counts_r) // E, len(rep)
    N = W * E
    rep_slot = {g: h for h, g in enumerate(rep)}
    entry_g = sorted({g for s, g, _ in plan.shares if s == r})
    g_N = torch.arange(N)
    key_N = E + H + (g_N // E) * N + g_N  # sent: by receiver (the owner), then expert
    key_N[r * E : (r + 1) * E] = torch.arange(E)  # own slot e
    held = list(rep)
    key_N[held] = E + torch.arange(H)  # replica slot h
    plain_N = counts_N > 0
    plain_N[entry_g] = False
    plain_g = torch.nonzero(plain_N).flatten()
    plain_len, plain_key = counts_N[plain_g].tolist(), key_N[plain_g].tolist()
    plain_g = plain_g.tolist()
    own_c = counts_N[r * E : (r + 1) * E].where(plain_N[r * E : (r + 1) * E], 0).tolist()
    rep_c = counts_N[held].where(plain_N[held], 0).tolist()
    sent_N = counts_N.where(plain_N, 0)
    sent_N[r * E : (r + 1) * E] = 0
    sent_N[held] = 0
    in_splits = sent_N.view(W, E).sum(1).tolist()
    run_len, run_key = [], []
    at = 0  # plain runs copied so far
    for g in entry_g:
        cut = bisect.bisect_left(plain_g, g, at)  # the plain runs of experts before g
        run_len += plain_len[at:cut]
        run_key += plain_key[at:cut]
        at = cut
        _walk_segment(
            plan, r, g, counts_r[g], E, rep_slot, (run_len, run_key, own_c, rep_c, in_splits)
        )
    run_len += plain_len[at:]
    run_key += plain_key[at:]
    return run_len, run_key, own_c, rep_c, in_splits
