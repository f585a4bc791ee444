"""Controllable routing skew for benchmarks.

Legend: T tokens, K top-k, N experts.

Specs: ``gate`` (the learned gate decides), ``uniform``, ``zipf:S`` (expert i drawn with weight
1/(i+1)^S), ``hot:P`` (expert 0 receives a fraction P of all T*K rows, the rest spread uniformly).
Every token's K choices are distinct. ``SyntheticGate`` imposes such ids while keeping the weights
differentiable (softmax of the gate logits over the imposed ids), so the gate still trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixmoe.config import MoEConfig
from mixmoe.gating import load_balancing_loss, router_z_loss
from mixmoe.types import Routing


@dataclass(frozen=True)
class RoutingSpec:
    kind: str  # gate | uniform | zipf | hot
    value: float = 0.0

    @staticmethod
    def parse(text: str) -> RoutingSpec:
        if not isinstance(text, str):
            raise TypeError(f"routing must be a string such as 'zipf:1.2', got {text!r}")
        kind, _, arg = text.partition(":")
        if kind in ("gate", "uniform") and not arg:
            return RoutingSpec(kind)
        if kind in ("zipf", "hot") and arg:
            try:
                value = float(arg)
            except ValueError:
                value = float("nan")
            if kind == "zipf" and value > 0:
                return RoutingSpec(kind, value)
            if kind == "hot" and 0.0 <= value <= 1.0:
                return RoutingSpec(kind, value)
        raise ValueError(
            f"routing {text!r} is not understood; use gate, uniform, zipf:S (S > 0) or hot:P "
            "(0 <= P <= 1)"
        )

    def __str__(self) -> str:
        return self.kind if self.kind in ("gate", "uniform") else f"{self.kind}:{self.value:g}"


def synthetic_ids(
    spec: RoutingSpec, num_tokens: int, top_k: int, num_experts: int, generator: torch.Generator
) -> torch.Tensor:
    """ids_TK (int64, distinct per row) drawn according to ``spec`` (not ``gate``)."""
    T, K, N = num_tokens, top_k, num_experts
    if spec.kind == "uniform" or spec.kind == "zipf":
        rank_N = torch.arange(N, dtype=torch.float64)
        probs_N = (
            torch.ones(N, dtype=torch.float64)
            if spec.kind == "uniform"
            else (rank_N + 1) ** -spec.value
        )
        if T == 0:
            return torch.empty(0, K, dtype=torch.int64)
        return torch.multinomial(probs_N.expand(T, N), K, replacement=False, generator=generator)
    if spec.kind != "hot":
        raise ValueError(f"synthetic_ids needs uniform, zipf or hot routing, got {spec}")
    if K >= N:  # every token uses every expert: nothing to skew
        return torch.arange(N).expand(T, N).clone()
    # expert 0 gets round(P * T * K) rows (at most one per token); other choices uniform on 1..N-1
    hot_rows = min(T, round(spec.value * T * K))
    ids_TK = (
        1
        + torch.multinomial(
            torch.ones(max(T, 1), N - 1, dtype=torch.float64),
            K,
            replacement=False,
            generator=generator,
        )[:T]
    )
    hot_T = torch.randperm(T, generator=generator)[:hot_rows]
    slot_T = torch.randint(0, K, (hot_rows,), generator=generator)
    ids_TK[hot_T, slot_T] = 0
    return ids_TK


class SyntheticGate(nn.Module):
    """A gate whose ids are imposed (``ids_TK``, fixed per benchmark) and whose weights are the
    softmax of its own logits over those ids."""

    def __init__(self, config: MoEConfig, ids_TK: torch.Tensor, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.wg = nn.Linear(config.model_dim, config.num_experts, device=device, dtype=dtype)
        self.register_buffer("ids_TK", ids_TK.to(device), persistent=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[Routing, torch.Tensor, torch.Tensor]:
        if x_TD.shape[0] != self.ids_TK.shape[0]:
            raise ValueError(
                f"SyntheticGate holds ids for {self.ids_TK.shape[0]} tokens, got {x_TD.shape[0]}"
            )
        logits_TN = self.wg(x_TD)
        weights_TK = torch.softmax(logits_TN.float().gather(1, self.ids_TK), dim=-1)
        routing = Routing(self.ids_TK, weights_TK.to(logits_TN.dtype), logits_TN)
        return routing, load_balancing_loss(logits_TN, self.ids_TK), router_z_loss(logits_TN)


def synthetic_counts(
    spec: RoutingSpec,
    world_size: int,
    tokens: int,
    top_k: int,
    num_experts: int,
    generator: torch.Generator,
    *,
    shuffle_experts: bool = True,
) -> torch.Tensor:
    """counts_WN (int64 [W, N]): the rows each of W ranks routes to each expert when each rank's
    ``tokens`` tokens pick ``top_k`` distinct experts by ``spec`` (uniform, zipf:S or hot:P, the
    marginals of ``synthetic_ids``), without materialising ids for every token at once.

    ``shuffle_experts``: the popularity order (zipf's rank i, hot's expert) is a seeded random
    permutation of the experts, the same on every rank, so the hottest experts have different
    owners as a trained gate's would; False keeps ``synthetic_ids``' order (expert 0 hottest, so
    the E hottest all sit on rank 0).

    zipf: every choice is drawn with weight 1/(i+1)^S and redrawn while it repeats an earlier
    choice of its token (sequential sampling without replacement, as ``torch.multinomial``).
    uniform / hot: drawn with replacement, which leaves the per-expert expectation unchanged (by
    symmetry); hot: min(T, round(P * T * K)) rows of every rank go to the hot expert.
    """
    if spec.kind not in ("uniform", "zipf", "hot"):
        raise ValueError(f"synthetic_counts needs uniform, zipf or hot routing, got {spec}")
    W, T, K, N = world_size, tokens, top_k, num_experts
    if K > N:
        raise ValueError(f"top_k={K} exceeds num_experts={N}; use top_k <= num_experts")
    order_N = torch.randperm(N, generator=generator) if shuffle_experts else torch.arange(N)
    counts_WN = torch.zeros(W, N, dtype=torch.int64)
    if spec.kind == "hot":
        hot_rows = min(T, round(spec.value * T * K))
        rest = T * K - hot_rows
        hot, others_M = order_N[0], order_N[1:]
        counts_WN[:, hot] = hot_rows if N > 1 else T * K
        if N > 1 and rest:
            draws = torch.randint(0, N - 1, (W, rest), generator=generator)
            per_W = torch.zeros(W, N - 1, dtype=torch.int64).scatter_add_(
                1, draws, torch.ones_like(draws)
            )
            counts_WN[:, others_M] += per_W
        return counts_WN
    probs_N = torch.ones(N, dtype=torch.float64)
    if spec.kind == "zipf":
        probs_N = (torch.arange(N, dtype=torch.float64) + 1) ** -spec.value
    chunk = max(1, (1 << 22) // max(T * K, 1))  # ranks per chunk: ~4M draws at a time
    for w0 in range(0, W, chunk):
        M = min(W, w0 + chunk) - w0
        ids_MK = torch.empty(M * T, K, dtype=torch.int64)
        for k in range(K):
            ids_MK[:, k] = torch.multinomial(probs_N, M * T, True, generator=generator)
            rows = torch.arange(M * T) if k and spec.kind == "zipf" else None
            while rows is not None:
                # only the rows redrawn last time can still repeat an earlier choice: re-check
                # those (ascending, as a full scan would find them: the same draws, faster)
                again = rows[(ids_MK[rows, k : k + 1] == ids_MK[rows, :k]).any(1)]
                if not len(again):
                    break
                ids_MK[again, k] = torch.multinomial(probs_N, len(again), True, generator=generator)
                rows = again
        rank_MT = torch.arange(w0, w0 + M).repeat_interleave(T)
        flat = (rank_MT[:, None] * N + order_N[ids_MK]).reshape(-1)
        counts_WN.view(-1).index_add_(0, flat, torch.ones_like(flat))
    return counts_WN


def redrawn_counts(counts_WN: torch.Tensor, seed: int) -> torch.Tensor:
    """Another step of the same popularity: each source rank's rows drawn again, as many,
    multinomially from its row of ``counts_WN`` (int64 [W, N]; a rank with no rows keeps
    none). What the planning-ahead figures fit a plan to (``bench balance --ahead``, ``bench
    planner``'s fit)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros_like(counts_WN)
    for s, row in enumerate(counts_WN):
        n = int(row.sum())
        if n:
            draw = torch.multinomial(row.double(), n, replacement=True, generator=gen)
            out[s] = torch.bincount(draw, minlength=counts_WN.shape[1])
    return out
