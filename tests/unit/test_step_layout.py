"""The expert-parallel step's index tensors (``dispatch/step_layout.py``) against the contract they
implement, checked row by row with plain Python over a simulated group of W ranks (no process, no
collective): every routed row is computed exactly once, by the right work item, under the right
weight slot, and its result comes back to the right (token, choice).

The distributed tier checks the same through the layer's numbers, but only for 2 and 4 ranks with
many tokens per rank; here also 1- and 0-token ranks, top-1 single rows, dropped choices (GShard
random routing, id -1), 3 and 5 ranks and every planner.
"""

from __future__ import annotations

import pytest
import torch

from mixmoe.dispatch.step_layout import build_own_layout, build_step_layout
from mixmoe.dispatch.step_plan import build_step_plan
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.planner import plan_none, plan_shadow
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.replica_search import plan_replicas
from mixmoe.schedule.sort import expert_counts
from mixmoe.types import Routing

# replication pays at once: slow GEMMs, a fast link
REPLICATE = HardwareProfile("test", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9)


def _ids(T: int, K: int, N: int, gen: torch.Generator, hot: bool) -> torch.Tensor:
    """Distinct experts per token (a top-k), skewed to expert 0 when ``hot``, ~15% dropped."""
    scores = torch.rand(T, N, generator=gen)
    if hot:
        scores[:, 0] += 0.7
    ids_TK = scores.topk(K, dim=1).indices
    drop = torch.rand(T, K, generator=gen) < 0.15
    return ids_TK.masked_fill(drop, -1)


def _plan(name: str, C_WN: torch.Tensor, E: int):
    shape = LayerShape(8, 16, E, C_WN.shape[0], 4)
    if name == "none":
        return plan_none(C_WN, shape, REPLICATE)
    if name == "mix":
        return plan_replicas(C_WN, shape, REPLICATE, max_replicas=3)
    return plan_shadow(C_WN, shape, REPLICATE)


def _block_slot(work, p: int) -> int:
    return int(work.schedule.block_slot_Nb[p // work.schedule.block_size])


def _check_local(work, ids_TK, slot_of: dict[int, int], name: str) -> None:
    """Local work: each (t, k) whose expert has a slot here has its own padded row, reading
    token t under that slot; every other (t, k) points past the end; padding reads row T."""
    T, K = ids_TK.shape
    P = work.schedule.num_padded_rows
    token_P, pos_TK = work.token_P.tolist(), work.pos_TK.tolist()
    assert work.pos_TK.shape == (T, K) and len(token_P) == P, name
    used = set()
    for t in range(T):
        for k in range(K):
            g, p = int(ids_TK[t, k]), pos_TK[t][k]
            if g in slot_of:
                assert 0 <= p < P and p not in used, (name, t, k, p)
                used.add(p)
                assert token_P[p] == t, (name, t, k, p, token_P[p])
                assert _block_slot(work, p) == slot_of[g], (name, t, k, g)
            else:
                assert p == P, (name, t, k, g, p)
    assert all(token_P[p] == T for p in range(P) if p not in used), (name, token_P)
    assert work.schedule.num_rows == len(used), name


def _check_slot_ends(work, num_slots: int, name: str) -> None:
    """Every work item's blocks come in slot order, and ``slot_ends`` says where each slot's
    blocks end (what the grouped-GEMM path takes as its group offsets)."""
    ends, B = work.schedule.slot_ends, work.schedule.block_size
    assert ends is not None and len(ends) == num_slots, (name, ends)
    assert (ends[-1] if ends else 0) == work.schedule.num_padded_rows, name
    for b, slot in enumerate(work.schedule.block_slot_Nb.tolist()):
        lo = ends[slot - 1] if slot else 0
        assert lo <= b * B < ends[slot], (name, b, slot, ends)


def _rank_layout(ids_TK, C_WN, plan, r: int, E: int, B: int, with_replicas: bool):
    T, K = ids_TK.shape
    routing = Routing(ids_TK, torch.rand(T, K, dtype=torch.float64), torch.zeros(T, C_WN.shape[1]))
    counts = C_WN[r].tolist()
    step = build_step_plan(C_WN, plan, r, E)
    own = build_own_layout(routing, counts, r, E, B)
    return step, own, build_step_layout(routing, own, counts, step, B, with_replicas=with_replicas)


@pytest.mark.parametrize("W,E", [(1, 3), (2, 2), (3, 2), (5, 1)])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("planner", ["none", "mix", "shadow"])
def test_step_layout_computes_every_row_once_and_returns_it(W, E, K, planner):
    N, B = W * E, 4
    gen = torch.Generator().manual_seed(100 * W + 10 * K + len(planner))
    tokens = [23, 30, 0, 1, 40][:W]  # from W = 3 a rank without tokens, from 4 one with one
    ids = [_ids(T, K, N, gen, hot=planner != "none") for T in tokens]
    C_WN = torch.stack([expert_counts(ids_TK, N) for ids_TK in ids])
    plan = _plan(planner, C_WN, E)
    if planner != "none" and W > 1:
        assert plan.replicas, "the skewed counts must make the planner replicate"
    any_replica = bool(plan.replicas)
    sent = {}  # source rank -> [(token, expert)] in send order
    layouts = {}
    for r in range(W):
        ids_TK = ids[r]
        T = ids_TK.shape[0]
        step, own, lay = _rank_layout(ids_TK, C_WN, plan, r, E, B, any_replica)
        layouts[r] = (step, lay)
        own_slot = {r * E + e: e for e in range(E)}
        assert own.num_own == sum(C_WN[r, r * E : (r + 1) * E].tolist())
        _check_local(lay.own, ids_TK, own_slot, f"rank {r} own")
        _check_slot_ends(lay.own, E, f"rank {r} own")
        _check_slot_ends(lay.received, E, f"rank {r} received")
        if any_replica:
            rep_slot = {g: h for h, g in enumerate(step.rep_experts)}
            _check_local(lay.replica, ids_TK, rep_slot, f"rank {r} replica")
            _check_slot_ends(lay.replica, len(step.rep_experts), f"rank {r} replica")
        else:
            assert lay.replica is None
        # rows sent away: exactly the choices of experts neither owned nor replicated here,
        # ascending by expert (so grouped by owner, as the receivers' segments expect)
        pos_back = lay.pos_back_TK.tolist()
        send_tok = lay.send_token_S.tolist()
        assert len(send_tok) == lay.num_send
        rows: list[tuple[int, int] | None] = [None] * lay.num_send
        for t in range(T):
            for k in range(K):
                g, j = int(ids_TK[t, k]), pos_back[t][k]
                if g >= 0 and g in step.send_experts:
                    assert 0 <= j < lay.num_send and rows[j] is None, (r, t, k, j)
                    rows[j] = (t, g)
                    assert send_tok[j] == t, (r, t, k, j)
                else:
                    assert j == lay.num_send, (r, t, k, g, j)
        experts = [g for _, g in rows]
        assert experts == sorted(experts), (r, experts)
        assert [sum(g // E == q for g in experts) for q in range(W)] == step.in_splits
        sent[r] = rows
    for r in range(W):  # the receiver's work item over the simulated receive buffer
        step, lay = layouts[r]
        buffer = [(s, t, g) for s in range(W) for t, g in sent[s] if g // E == r]
        assert [sum(s == q for s, _, _ in buffer) for q in range(W)] == step.out_splits
        work, n_recv = lay.received, len(buffer)
        P = work.schedule.num_padded_rows
        token_P, pos = work.token_P.tolist(), work.pos_TK.view(-1).tolist()
        assert work.pos_TK.shape == (n_recv, 1) and len(token_P) == P
        assert len(set(pos)) == n_recv and all(0 <= p < P for p in pos), (r, pos)
        for i, (_, _, g) in enumerate(buffer):
            assert token_P[pos[i]] == i, (r, i)
            assert _block_slot(work, pos[i]) == g - r * E, (r, i, g)
        assert all(token_P[p] == n_recv for p in range(P) if p not in set(pos)), (r, token_P)


def test_step_layout_of_a_single_routed_row():
    """T = 1, K = 1 on each of 2 ranks, each token routed to the other rank's expert: one row
    sent, one received, and (rank 1 holding a replica of expert 0 under a hand-made plan)
    a single replica row."""
    from mixmoe.placement.planner import Plan

    E, B = 1, 4
    ids = [torch.tensor([[1]]), torch.tensor([[0]])]
    C_WN = torch.stack([expert_counts(i, 2) for i in ids])
    base = plan_none(C_WN, LayerShape(8, 16, E, 2, 4), REPLICATE)
    for plan in (base, Plan((0,), ((0, (1,)),), base.prediction, base.baseline)):
        for r in range(2):
            step, own, lay = _rank_layout(ids[r], C_WN, plan, r, E, B, bool(plan.replicas))
            _check_local(lay.own, ids[r], {r: 0}, "own")
            if plan.replicas:
                rep = {g: h for h, g in enumerate(step.rep_experts)}
                _check_local(lay.replica, ids[r], rep, "replica")
            replicated = r == 1 and bool(plan.replicas)
            assert lay.num_send == (0 if replicated else 1)
            assert lay.send_token_S.tolist() == ([] if replicated else [0])
            assert lay.pos_back_TK.tolist() == [[0]]


def test_step_layout_is_built_on_the_routing_device_whatever_the_default():
    """Every index tensor lives on the routing's device: under another default device (meta
    here; cuda:0 for a model on another GPU) the layout is the same, on the same device."""
    W, E, K, B = 2, 2, 2, 4
    gen = torch.Generator().manual_seed(3)
    ids = [_ids(T, K, W * E, gen, hot=True) for T in (30, 20)]
    C_WN = torch.stack([expert_counts(ids_TK, W * E) for ids_TK in ids])
    plan = _plan("mix", C_WN, E)
    assert plan.replicas
    for r in range(W):
        step, own, want = _rank_layout(ids[r], C_WN, plan, r, E, B, True)
        T = ids[r].shape[0]
        routing = Routing(ids[r], torch.rand(T, K), torch.zeros(T, W * E))
        with torch.device("meta"):
            got = build_step_layout(routing, own, C_WN[r].tolist(), step, B, with_replicas=True)
        for name in ("order_R", "send_token_S", "pos_back_TK"):
            assert getattr(got, name).device.type == "cpu", name
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for item in ("replica", "received"):
            for name in ("token_P", "pos_TK"):
                t = getattr(getattr(got, item), name)
                assert t.device.type == "cpu", (item, name)
                assert torch.equal(t, getattr(getattr(want, item), name)), (item, name)


def test_received_rows_run_on_the_grouped_gemm_path():
    """The received work item (several source segments per slot, slot-major) through the
    grouped-GEMM body (``torch._grouped_mm`` runs float32 on CPU) equals the reference ops."""
    from mixmoe.ops.expert_mlp import ExpertWeights
    from mixmoe.ops.grouped_mm_expert_mlp import grouped_mm_token_expert_mlp
    from mixmoe.ops.token_expert_mlp import token_expert_mlp

    W, E, K, B, D, Fh = 3, 2, 2, 4, 8, 16
    gen = torch.Generator().manual_seed(7)
    ids = [_ids(T, K, W * E, gen, hot=False) for T in (23, 30, 17)]
    C_WN = torch.stack([expert_counts(ids_TK, W * E) for ids_TK in ids])
    plan = _plan("none", C_WN, E)
    _, _, lay = _rank_layout(ids[1], C_WN, plan, 1, E, B, False)
    work = lay.received
    n_recv = work.pos_TK.shape[0]
    assert n_recv > 0 and work.schedule.num_blocks > E  # several segments per slot
    x = torch.randn(n_recv, D, generator=gen, requires_grad=True)
    w1 = torch.randn(E, D, Fh, generator=gen, requires_grad=True)
    w2 = torch.randn(E, Fh, D, generator=gen, requires_grad=True)
    args = (work.token_P, work.pos_TK, None, ExpertWeights(w1, w2), work.schedule, "gelu")
    y = grouped_mm_token_expert_mlp(x, *args)
    ref = token_expert_mlp(x, *args, fused=False)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    dy = torch.randn(y.shape, generator=gen)
    for a, r in zip(
        torch.autograd.grad(y, [x, w1, w2], dy),
        torch.autograd.grad(ref, [x, w1, w2], dy),
        strict=True,
    ):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
