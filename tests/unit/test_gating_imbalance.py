"""The imbalance workloads' count matrices (``mixmoe.gating.imbalance``), checked by counting."""

from __future__ import annotations

import pytest
import torch

from mixmoe.gating.imbalance import Workload, workload_counts
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts


@pytest.mark.parametrize(
    "text", ["uniform", "zipf:1.2", "hot:0.5", "hotset:8:0.5", "hotrank:0.5", "idle:0.25",
             "rotate:8:0.5", "rotate:2:1:3"],
)  # fmt: skip
def test_parse_round_trip(text: str) -> None:
    assert str(Workload.parse(text)) == text
    assert Workload.parse(str(Workload.parse(text))) == Workload.parse(text)


@pytest.mark.parametrize(
    "text",
    ["gate", "zipf:0", "hot:1.5", "hotset:8", "hotset:0:0.5", "hotset:8:0.5:2", "hotrank",
     "idle:0", "idle:1", "rotate:8:0.5:0", "rotate:x:0.5", "burst:0.5"],
)  # fmt: skip
def test_parse_errors_name_the_grammar(text: str) -> None:
    with pytest.raises(ValueError, match=f"workload '{text}' is not understood; use uniform"):
        Workload.parse(text)


def test_synthetic_kinds_are_synthetic_counts() -> None:
    (C,) = workload_counts("zipf:1.2", 4, 100, 2, 16, seed=5)
    expect = synthetic_counts(
        RoutingSpec("zipf", 1.2), 4, 100, 2, 16, torch.Generator().manual_seed(5)
    )
    assert torch.equal(C, expect)


def test_hot_set_splits_its_share_evenly() -> None:
    W, T, K, N = 3, 100, 2, 12
    (C,) = workload_counts("hotset:3:0.5", W, T, K, N, seed=1)
    assert C.sum(1).tolist() == [T * K] * W  # every rank routes all its rows
    hot = C[0].topk(3).indices
    assert sorted(C[:, hot].flatten().tolist()) == [33] * 6 + [34] * 3  # 100 rows: 34 + 33 + 33
    # a share beyond H * T rows is capped: no expert gets more than T rows of one rank
    (C,) = workload_counts("hotset:1:1.0", W, T, K, N, seed=1)
    assert C.max() == T and C.sum(1).tolist() == [T * K] * W


def test_hot_rank_is_one_owners_experts() -> None:
    W, T, K, N = 4, 200, 2, 16  # E = 4
    (C,) = workload_counts("hotrank:0.5", W, T, K, N, seed=2)
    per_rank = C.view(W, W, N // W).sum(2)  # [source, owner]
    owner = int(per_rank.sum(0).argmax())
    assert per_rank[:, owner].tolist() == [T] * W  # half of every rank's T * K rows
    assert (C.view(W, W, N // W)[:, owner] == T // 4).all()  # split over its 4 experts


def test_idle_ranks_keep_the_total() -> None:
    W, T, K, N = 8, 90, 2, 16
    (C,) = workload_counts("idle:0.25", W, T, K, N, seed=4)
    rows_W = C.sum(1)
    assert int((rows_W == 0).sum()) == 2
    assert rows_W[rows_W > 0].tolist() == [(W * T // 6) * K] * 6  # 120 tokens each
    assert (C.sum(0) > 0).all()  # the experts still all receive rows
    with pytest.raises(ValueError, match="needs world_size >= 2"):
        workload_counts("idle:0.5", 1, T, K, N)


def test_rotating_hotspot_moves_every_step() -> None:
    W, T, K, N = 4, 64, 1, 8
    steps = workload_counts("rotate:2:1.0:5", W, T, K, N, seed=7)
    assert len(steps) == 5
    hot = [set(C[0].nonzero().squeeze(1).tolist()) for C in steps]
    assert all(len(h) == 2 for h in hot)
    assert all(not (hot[t] & hot[t + 1]) for t in range(4))  # consecutive sets are disjoint
    assert set().union(*hot[:4]) == set(range(N)) and hot[4] == hot[0]  # wraps after N / H
    again = workload_counts("rotate:2:1.0:5", W, T, K, N, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(steps, again, strict=True))


@pytest.mark.parametrize(
    "text,W,N,match",
    [("hotset:8:0.5", 2, 8, "makes 8 of the 8 experts hot"),
     ("hotrank:0.5", 1, 4, "makes 4 of the 4 experts hot"),
     ("uniform", 3, 8, "num_experts=8 must be a multiple of world_size=3")],
)  # fmt: skip
def test_workload_errors(text: str, W: int, N: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        workload_counts(text, W, 16, 1, N)
