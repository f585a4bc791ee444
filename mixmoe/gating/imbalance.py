"""Imbalance workloads: count matrices for the load patterns expert parallelism must survive.

Legend: W ranks, N experts (E = N / W per rank, expert g owned by rank g // E), T tokens per rank,
K top-k, C = counts_WN [W, N] (C[s, g] = rows rank s routes to expert g), H hot experts.

Each workload is a string, parsed by ``Workload.parse``:

- ``uniform``, ``zipf:S``, ``hot:P``: ``mixmoe.gating.synthetic.synthetic_counts`` (popularity
  order shuffled across owners).
- ``hotset:H:P``: a hot expert set. H experts (a seeded random set, spread across owners) receive
  a fraction P of every rank's T*K rows, split evenly; the other rows go uniformly to the other
  N - H experts.
- ``hotrank:P``: a hot rank. All E experts of one seeded random rank are the hot set of
  ``hotset``: the rank that owns them is the one that overflows.
- ``idle:F``: ranks with zero load. round(F * W) ranks (at least 1, at most W - 1, a seeded random
  set) route no tokens; the W * T tokens are spread over the other ranks (floor(W * T / active)
  each, so the total stays that of ``uniform`` but for fewer than ``active`` tokens), which route
  uniformly. Every expert still receives rows: the load moves between senders, not experts.
- ``rotate:H:P[:S]``: a rotating hotspot. ``hotset:H:P`` whose hot set moves every step, S steps
  (default 4): step t's set is the t-th run of H experts of a seeded random order of the experts
  (wrapping around), so consecutive sets share no expert while t * H < N.

Rows are drawn with replacement (as ``synthetic_counts``' uniform and hot), but no hot expert
gets more than T rows of one rank (a token picks an expert at most once): the hot rows are
min(H * T, round(P * T * K)), split evenly (the first ones of the set one row more when H does
not divide them). Every step's matrix sums to W * T * K (``idle``: active * floor(W * T /
active) * K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts

__all__ = ["KINDS", "Workload", "workload_counts"]

KINDS = ("uniform", "zipf", "hot", "hotset", "hotrank", "idle", "rotate")
DEFAULT_ROTATE_STEPS = 4
_GRAMMAR = (
    "uniform, zipf:S (S > 0), hot:P, hotset:H:P, hotrank:P, idle:F (0 < F < 1) or rotate:H:P[:S] "
    "(P in [0, 1], H >= 1 hot experts, S >= 1 steps)"
)


@dataclass(frozen=True)
class Workload:
    """One parsed workload (see the module doc). ``share``: S of zipf, P of hot / hotset /
    hotrank / rotate, F of idle; ``size``: H of hotset / rotate; ``steps``: matrices it yields
    (S of rotate, else 1)."""

    kind: str
    share: float = 0.0
    size: int = 0
    steps: int = 1

    @staticmethod
    def parse(text: str) -> Workload:
        if not isinstance(text, str):
            raise TypeError(f"workload must be a string, got {text!r}")
        kind, *args = text.strip().split(":")
        try:
            if kind in ("uniform", "zipf", "hot"):
                spec = RoutingSpec.parse(text.strip())
                if spec.kind != "gate":
                    return Workload(spec.kind, spec.value)
            elif kind in ("hotrank", "idle") and len(args) == 1:
                share = float(args[0])
                if 0.0 <= share <= 1.0 and (kind == "hotrank" or 0.0 < share < 1.0):
                    return Workload(kind, share)
            elif kind in ("hotset", "rotate") and len(args) in (2, 3 if kind == "rotate" else 2):
                size, share = int(args[0]), float(args[1])
                steps = int(args[2]) if len(args) == 3 else DEFAULT_ROTATE_STEPS
                if size >= 1 and 0.0 <= share <= 1.0 and steps >= 1:
                    return Workload(kind, share, size, steps if kind == "rotate" else 1)
        except ValueError:
            pass
        raise ValueError(f"workload {text!r} is not understood; use {_GRAMMAR}")

    def __str__(self) -> str:
        if self.kind in ("hotset", "rotate"):
            tail = f":{self.steps}" if self.kind == "rotate" and self.steps != 4 else ""
            return f"{self.kind}:{self.size}:{self.share:g}{tail}"
        return self.kind if self.kind == "uniform" else f"{self.kind}:{self.share:g}"


def _hot_set_counts(
    W: int, T: int, K: int, N: int, hot_H: torch.Tensor, share: float, gen: torch.Generator
) -> torch.Tensor:
    """counts_WN: every rank sends min(H * T, round(share * T * K)) rows to the experts
    ``hot_H`` (evenly, earlier ones one more) and the rest of its T * K rows uniformly, with
    replacement, to the other experts."""
    H = hot_H.numel()
    hot_rows = min(H * T, round(share * T * K))
    per_H = torch.full((H,), hot_rows // H, dtype=torch.int64)
    per_H[: hot_rows % H] += 1  # the remainder to the first experts of the set
    counts_WN = torch.zeros(W, N, dtype=torch.int64)
    counts_WN[:, hot_H] = per_H
    cold = torch.ones(N, dtype=torch.bool)
    cold[hot_H] = False
    cold_M = cold.nonzero().squeeze(1)
    rest = T * K - hot_rows
    if rest and cold_M.numel():
        draws = torch.randint(0, cold_M.numel(), (W, rest), generator=gen)
        per_WM = torch.zeros(W, cold_M.numel(), dtype=torch.int64)
        counts_WN[:, cold_M] += per_WM.scatter_add_(1, draws, torch.ones_like(draws))
    return counts_WN


def _check_size(workload: Workload, size: int, N: int) -> None:
    if size >= N:
        raise ValueError(
            f"workload {workload} makes {size} of the {N} experts hot, leaving none cold; use "
            f"fewer than {N} hot experts"
        )


def check_workload(
    workload: Workload | str, world_size: int, top_k: int, num_experts: int
) -> Workload:
    """``workload`` parsed, after the checks ``workload_counts`` makes of it for W ranks
    choosing ``top_k`` of ``num_experts`` experts (a clear ValueError, before any count is
    drawn: ``bench balance`` checks every case before it runs the first)."""
    w = Workload.parse(workload) if isinstance(workload, str) else workload
    W, K, N = world_size, top_k, num_experts
    if N % W:
        raise ValueError(f"num_experts={N} must be a multiple of world_size={W}")
    if K > N:
        raise ValueError(f"top_k={K} exceeds num_experts={N}; use top_k <= num_experts")
    if w.kind in ("hotset", "rotate"):
        _check_size(w, w.size, N)
    elif w.kind == "hotrank":
        _check_size(w, N // W, N)
    elif w.kind == "idle" and W < 2:
        raise ValueError(f"workload {w} needs world_size >= 2 (one rank idle), got {W}")
    return w


def workload_counts(
    workload: Workload | str,
    world_size: int,
    tokens: int,
    top_k: int,
    num_experts: int,
    *,
    seed: int = 0,
) -> list[torch.Tensor]:
    """The count matrices (int64 [W, N], one per step: ``workload.steps``) of ``workload`` for W
    ranks of ``tokens`` tokens choosing ``top_k`` of ``num_experts`` experts, drawn from a
    generator seeded with ``seed`` (the same seed, the same matrices)."""
    w = check_workload(workload, world_size, top_k, num_experts)
    W, T, K, N = world_size, tokens, top_k, num_experts
    gen = torch.Generator().manual_seed(seed)
    if w.kind in ("uniform", "zipf", "hot"):
        return [synthetic_counts(RoutingSpec(w.kind, w.share), W, T, K, N, gen)]
    if w.kind == "hotset":
        hot_H = torch.randperm(N, generator=gen)[: w.size]
        return [_hot_set_counts(W, T, K, N, hot_H, w.share, gen)]
    if w.kind == "hotrank":
        E = N // W
        rank = int(torch.randint(0, W, (1,), generator=gen))
        return [_hot_set_counts(W, T, K, N, torch.arange(rank * E, (rank + 1) * E), w.share, gen)]
    if w.kind == "idle":
        idle = min(W - 1, max(1, round(w.share * W)))
        active_A = torch.randperm(W, generator=gen)[idle:].sort().values
        per_rank = (W * T) // active_A.numel()  # the uniform total, spread over the active ranks
        counts_WN = torch.zeros(W, N, dtype=torch.int64)
        uniform = RoutingSpec("uniform")
        counts_WN[active_A] = synthetic_counts(uniform, active_A.numel(), per_rank, K, N, gen)
        return [counts_WN]
    # rotate: the hot set walks a fixed shuffled order of the experts, H at a time
    order_N = torch.randperm(N, generator=gen)
    steps = []
    for t in range(w.steps):
        hot_H = order_N[(t * w.size + torch.arange(w.size)) % N]  # run t of H, wrapping around
        steps.append(_hot_set_counts(W, T, K, N, hot_H, w.share, gen))
    return steps
