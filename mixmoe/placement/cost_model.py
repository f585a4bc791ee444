"""Cost model of one MoE layer's training step (forward + backward) under a replica placement.

Legend: W ranks in the EP group, E experts per rank, N = W*E experts, D model dim, F expert hidden
dim, C = counts_WN with C[s][g] = rows (token x choice) rank s routes to expert g.

Placement. Expert g is owned by rank o(g) = g // E. ``hot`` maps a replicated expert g to the
ranks H(g) that hold a read-only replica of it (o(g) never in H(g)). Segment (s, g) -- the C[s][g]
rows source s sends to g -- is computed at s if s == o(g) or s in H(g) ("local" rows), otherwise at
o(g) ("remote" rows: they travel to the owner and back).

Per rank r, with rb = D * bytes_per_element (one row) and P = params_bytes_per_expert:

- rows[r]    = rows computed at r; local[r] = those of them whose source is r.
- compute[r] = rows[r] * flops_per_row / gemm_flops, flops_per_row = 6 * gemms * D * F
  (2 FLOP per multiply-add, backward = 2 x forward).
- remote[r]  = remote rows r sends away (source r) + remote rows r computes for others. Each remote
  row crosses the link 4 times (forward dispatch and return, backward dispatch and return), so r
  sends 2 * rb and receives 2 * rb per remote row: token_sent = token_recv = 2 * rb * remote[r];
  ``token_bytes`` reports sent + received = 4 * rb * remote[r].
- replica[r] = replicas r serves as owner (sum of |H(g)| over its hot g) + replicas r holds. The
  owner sends P per holder in forward and receives P of gradient per holder in backward; a holder
  receives P and sends P: weight_sent = weight_recv = P * replica[r]; ``weight_bytes`` reports
  sent + received = 2 * P * replica[r] (rounded to whole bytes). Under a relay (``Plan.relay``,
  ``plan_pricing``) replica[r] is instead the copies r sends + receives in the relay's messages
  (``relay.relay_degrees``, a float64 on a 2**-24 grid): with one link a scatter + all-gather, 1
  for the owner and 2 - 1/H for each of the H holders; across nodes the owner 1 per link class,
  near holders as above, far holders 1 received + their exchange and in-node sends (< 2).
- Each communication phase costs link_latency per collective + max(sent, recv) / link_bandwidth.
  The token phase uses 4 all-to-alls (dispatch and return, forward and backward), counted on every
  rank when any row anywhere is remote and skipped otherwise (every rank knows C, so all skip
  together). The weight phase uses 2 collectives (fetch, gradient return), counted on every rank
  when any replica exists. The count all-gather is common to every strategy and is not modelled.
- token_time[r]  = 4 * latency + 2 * rb * remote[r] / bandwidth   (0 without remote rows).
  exposed[r]     = max(0, token_time[r] - local_time[r]) with ``overlap`` (the token
                   all-to-all runs while the source-local rows are computed), else token_time[r];
                   local_time[r] = local[r] * flops_per_row / gemm_flops + local[r] * row_overhead.
  weight_time[r] = 2 * latency + P * replica[r] / bandwidth + replica[r] * replica_fixed
                   (0 without replicas); never overlapped (the replica must arrive before its rows
                   are computed).
  comm[r]        = exposed[r] + weight_time[r].
- The profile's fixed costs (``HardwareProfile``; each 0.0 unless measured, which drops its term):
  compute[r] += rows[r] * row_overhead (gathers, scatters, element-wise work per row computed)
  + step_fixed (gate, count exchange, plan, sort, combine, optimizer: every rank, every plan);
  replica_fixed prices what a replica costs beyond its bytes (packing, the replica slots' work
  item, the gradient return's reduction), per replica served or held, in weight_time.
- step = max over r of compute[r] + comm[r].

The planner (``mixmoe.placement.planner``) and the what-if simulator both use this model.
The arithmetic is written twice, side by side in ``StepModel``: ``rank_seconds`` for one rank
(Python ints and floats) and ``seconds_W`` for many ranks at once (float64 tensors holding the
integer aggregates, stacked in ``LOADS`` order). Both evaluate the same expressions in the same
order on exact integer aggregates, so they agree bit for bit (a test checks it) and the same
inputs give bit-identical predictions on every rank (the planner relies on it). Vector names
carry their length: ``rows_W`` (one entry per rank), ``colsum_N`` (one per expert).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from mixmoe.placement.counts import (  # noqa: F401  (re-exported: the planners' count arithmetic)
    baseline_loads,
    counts_as_lists,
    counts_as_tensor,
    counts_with_sums,
)
from mixmoe.placement.loads_tensor import (
    inter_node_loads_tensor,
    plan_loads_tensor,
    range_crossing_tensor,
    range_relay_loads_tensor,
    relay_copies_tensor,
)
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.ranges import range_experts, range_loads
from mixmoe.placement.relay import (
    near_relay,
    node_distance,
    relay_degrees,
    relay_inter_copies,
)

LOADS = ("rows", "local", "remote", "replica")  # the order of the stacked aggregates [4, W]
TOKEN_COLLECTIVES = 4  # dispatch + return, forward + backward
WEIGHT_COLLECTIVES = 2  # replica fetch (forward) + replica gradient return (backward)
LIST_PRICING_W = 64  # ranks up to which plan_pricing adds loads on Python lists (else tensors)


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{owner}.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class LayerShape:
    """Sizes of one MoE layer under expert parallelism (all ints >= 1).

    model_dim D, hidden_dim F, experts_per_rank E, world_size W; bytes_per_element of the rows and
    weights on the wire (4 fp32, 2 bf16/fp16); gemms_per_expert: 2 for a plain MLP, 3 for SwiGLU.
    """

    model_dim: int
    hidden_dim: int
    experts_per_rank: int
    world_size: int
    bytes_per_element: int
    gemms_per_expert: int = 2

    def __post_init__(self) -> None:
        for name in (
            "model_dim",
            "hidden_dim",
            "experts_per_rank",
            "world_size",
            "bytes_per_element",
            "gemms_per_expert",
        ):
            _positive_int("LayerShape", name, getattr(self, name))

    @property
    def num_experts(self) -> int:
        """N = W * E."""
        return self.world_size * self.experts_per_rank

    @property
    def flops_per_row(self) -> int:
        """Forward + backward FLOPs of one row through one expert: 3 * 2 * gemms * D * F."""
        return 6 * self.gemms_per_expert * self.model_dim * self.hidden_dim

    @property
    def params_bytes_per_expert(self) -> int:
        """Bytes of one expert's parameters: gemms * D * F weights plus biases (F for every GEMM
        but the last, D for the last), times bytes_per_element."""
        gemms, D, F = self.gemms_per_expert, self.model_dim, self.hidden_dim
        return (gemms * D * F + (gemms - 1) * F + D) * self.bytes_per_element

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row: D * bytes_per_element."""
        return self.model_dim * self.bytes_per_element


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one layer step; every tuple has one entry per rank (see module doc).

    compute_s, comm_s: seconds (comm_s is the exposed communication after overlap);
    token_bytes, weight_bytes: bytes sent + received; rows: rows computed at the rank;
    step_s: max over ranks of compute_s + comm_s.
    """

    compute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    token_bytes: tuple[int, ...]
    weight_bytes: tuple[int, ...]
    rows: tuple[int, ...]
    step_s: float

    @classmethod
    def packed(cls, step_s: float, reals: bytes, ints: bytes) -> Prediction:
        """The Prediction of ``step_s`` and the per-rank fields packed in native order:
        ``reals`` float64 [compute_s, comm_s] and ``ints`` int64 [token_bytes, weight_bytes,
        rows] (W each), each field's tuple built when first read (``__getattr__``). The same
        value as the eager one (equality, repr, hash and pickling read the fields). What the
        compiled planner returns: a W = 1024 plan's two Predictions are ~10**4 numbers, and the
        layer reads only the plan's rows, on the step's critical path."""
        out = object.__new__(cls)
        object.__setattr__(out, "step_s", step_s)
        object.__setattr__(out, "_packed", (reals, ints))
        return out

    def __getattr__(self, name: str):
        """A packed Prediction's field, decoded once (``packed``); only called for attributes
        not set (a frozen instance sets each field at most once, from the same bytes)."""
        at = _PACKED_FIELDS.get(name)
        packed = self.__dict__.get("_packed")
        if at is None or packed is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        k, code = at
        data = memoryview(packed[code == "q"]).cast(code)
        W = len(data) // (2 if code == "d" else 3)
        value = tuple(data[k * W : (k + 1) * W])
        object.__setattr__(self, name, value)
        return value


# a packed Prediction's per-rank fields: (index in its buffer, the buffer's type code)
_PACKED_FIELDS = {
    "compute_s": (0, "d"),
    "comm_s": (1, "d"),
    "token_bytes": (0, "q"),
    "weight_bytes": (1, "q"),
    "rows": (2, "q"),
}


def replica_map(
    hot: Mapping[int, Iterable[int]] | Iterable, C: list[list[int]], shape: LayerShape
) -> dict[int, tuple[int, ...]]:
    """Normalise ``hot`` to ``{g: holders ascending}``.

    Accepted forms: a mapping ``g -> holder ranks``; or an iterable whose items are either
    ``(g, holder ranks)`` pairs (e.g. ``Plan.replicas``) or bare expert ids ``g``, which mean "a
    replica on every rank s != owner with C[s][g] > 0" (the mixed strategy's rule).
    """
    W, E, N = shape.world_size, shape.experts_per_rank, shape.num_experts
    items = hot.items() if isinstance(hot, Mapping) else hot
    out: dict[int, tuple[int, ...]] = {}
    for item in items:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            g, holders = operator.index(item[0]), tuple(operator.index(h) for h in item[1])
        else:
            g, holders = operator.index(item), None
        if not 0 <= g < N:
            raise ValueError(f"hot expert {g} is out of range [0, {N})")
        if holders is None:
            holders = tuple(s for s in range(W) if s != g // E and C[s][g] > 0)
        if g in out:
            raise ValueError(f"hot expert {g} is listed twice")
        if any(not 0 <= h < W for h in holders) or len(set(holders)) != len(holders):
            raise ValueError(
                f"holders {holders} of hot expert {g} must be distinct ranks in [0, {W})"
            )
        if g // E in holders:
            raise ValueError(f"holders {holders} of hot expert {g} contain its owner rank {g // E}")
        out[g] = tuple(sorted(holders))
    return out


def rank_loads(
    C: list[list[int]], hot: Mapping[int, tuple[int, ...]], experts_per_rank: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Integer aggregates per rank: (rows, local, remote, replica), as defined in the module doc."""
    W, E = len(C), experts_per_rank
    rows, local, remote, replica = [0] * W, [0] * W, [0] * W, [0] * W
    held = {g: frozenset(h) for g, h in hot.items()}
    for s, row in enumerate(C):
        for g, c in enumerate(row):
            if c == 0:
                continue
            o = g // E
            if s == o or s in held.get(g, ()):
                rows[s] += c
                local[s] += c
            else:
                rows[o] += c
                remote[s] += c
                remote[o] += c
    for g, holders in hot.items():
        replica[g // E] += len(holders)
        for h in holders:
            replica[h] += 1
    return rows, local, remote, replica


class StepModel:
    """The per-rank arithmetic of the module doc, with shape, profile and ``overlap`` bound once.

    ``rank_seconds`` is the single place where seconds are computed; ``predict`` and the planner
    both go through it, so their numbers agree bit for bit.
    """

    __slots__ = (
        "flops_per_row",
        "gemm_flops",
        "token_bytes_per_row",
        "params_bytes",
        "bw",
        "lat",
        "overlap",
        "row_s",
        "replica_s",
        "fixed_s",
        "_factor_41",
        "_divisor_41",
        "bw_inter",
        "bw_near",
        "bw_far",
    )

    def __init__(self, shape: LayerShape, profile: HardwareProfile, overlap: bool) -> None:
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.flops_per_row = shape.flops_per_row
        self.gemm_flops = profile.gemm_flops
        self.token_bytes_per_row = 2 * shape.row_bytes  # sent (= received) per remote row
        self.params_bytes = shape.params_bytes_per_expert
        self.bw = profile.link_bandwidth
        self.lat = profile.link_latency
        # topology (``profile.ranks_per_node``): inter-node bytes at inter_node_bandwidth (loads
        # of 6 rows, ``plan_pricing``); a group spanning nodes pays the slower latency per
        # collective. None: the one link of every pair, as before topology existed.
        per_node = getattr(profile, "ranks_per_node", None)
        self.bw_inter = profile.inter_node_bandwidth if per_node else None
        # a fill's copy of this model (``fill_link``) across nodes: the relay copies' two links
        self.bw_near: float | None = None
        self.bw_far: float | None = None
        if per_node and shape.world_size > per_node:
            self.lat = max(self.lat, profile.inter_node_latency)
        self.overlap = overlap
        self.row_s = profile.row_overhead_s
        self.replica_s = profile.replica_fixed_s
        self.fixed_s = profile.step_fixed_s
        f64 = torch.float64
        self._factor_41 = torch.tensor(
            [self.flops_per_row, self.flops_per_row, self.token_bytes_per_row, self.params_bytes],
            dtype=f64,
        ).view(4, 1)
        self._divisor_41 = torch.tensor(
            [self.gemm_flops, self.gemm_flops, self.bw, self.bw], dtype=f64
        ).view(4, 1)

    def fill_link(self, world_size: int, ranks_per_node: int | None) -> StepModel:
        """The one link the planner's fills search under (``planner.plan_mix``): this model
        where every pair is alike (no topology, or all ``world_size`` ranks on one node); with
        nodes, a copy whose link is the blend a rank's uniformly spread peers see, the time per
        byte averaged over them: ``1 / (f / bw_inter + (1 - f) / bw)``, ``f = (W - P) / (W -
        1)`` the share of peers on other nodes (P ranks per node). The fills' own totals then
        price rows at about what the plan's 6-row pricing charges them (with the intra-node link
        alone, a fill at W = 256 under ``h100-nvlink-ib`` saw a mean of 2.1 ms against a priced
        step of 5.3 ms, and spread rows across nodes as if they were free). The relay's copies
        are not blended: most cross no node (a far node's holders share one inter-node chunk
        each), so the copy keeps both links (``bw_near``, ``bw_far``) and the fills price each
        rank's copies split by the link they take (``split_total_fn``): with the blend alone,
        seeds' shape under ``h100-nvlink-ib`` at W = 64, the fills saw 89% of the copies as
        inter-node where 14-36% were, and left plans 8-10% slower (``docs/results/``
        ``2026-11-27-split-copies.md``). Twin of ``native/plan_mix.cpp``'s fill model (the same
        expressions, bit for bit)."""
        if not ranks_per_node or world_size <= ranks_per_node or self.bw_inter is None:
            return self
        far = (world_size - ranks_per_node) / (world_size - 1)  # peers on other nodes
        blended = copy.copy(self)
        blended.bw = 1.0 / (far / self.bw_inter + (1.0 - far) / self.bw)
        blended.bw_inter = None  # one link for the rows
        blended.bw_near, blended.bw_far = self.bw, self.bw_inter  # two for the copies
        blended._divisor_41 = torch.tensor(
            [self.gemm_flops, self.gemm_flops, blended.bw, blended.bw], dtype=torch.float64
        ).view(4, 1)
        return blended

    def rank_seconds(
        self,
        rows: int,
        local: int,
        remote: int,
        replica: int,
        any_remote: bool,
        any_hot: bool | int,
    ) -> tuple[float, float]:
        """(compute_s, comm_s) of one rank; any_remote / any_hot: whether the token / weight
        collectives run at all (anywhere in the group). ``any_hot`` may be an int: the rounds of
        the replica relay (``relay_degrees``; 0: none), each a fetch and a gradient return, so
        True and 1 price alike."""
        return self._compute_s(rows), self._comm_s(local, remote, replica, any_remote, any_hot)

    def rank_total(
        self,
        rows: int,
        local: int,
        remote: int,
        replica: int,
        any_remote: bool,
        any_hot: bool | int,
    ) -> float:
        """``compute_s + comm_s`` of ``rank_seconds`` without the tuple (the list search makes
        hundreds of calls): the same terms, so the same float."""
        return self._compute_s(rows) + self._comm_s(local, remote, replica, any_remote, any_hot)

    def total_fn(
        self, any_remote: bool, any_hot: bool | int
    ) -> Callable[[int, int, int, int], float]:
        """``rank_total`` with the group-wide flags bound: ``total(rows, local, remote, replica)``
        = the sum of ``seconds_fn``'s pair, ``compute + (token + weight)`` as ``rank_total``
        adds it, so the same float bit for bit (a test checks it); the Python water-fills make
        tens of thousands of calls per plan and the closure skips the attribute look-ups."""
        seconds = self.seconds_fn(any_remote, any_hot)

        def total(rows: int, local: int, remote: int, replica: int) -> float:
            compute, comm = seconds(rows, local, remote, replica)
            return compute + comm

        return total

    def split_total_fn(
        self, any_remote: bool, any_hot: bool | int
    ) -> Callable[[int, int, int, float, float], float]:
        """``total_fn`` of a fill's copy across nodes (``fill_link``): ``total(rows, local,
        remote, replica, replica_inter)``, the rows on the blended link, the copies split as the
        6-row pricing splits them: ``replica_inter`` of them (``relay.relay_inter_copies``) at
        ``bw_far``, the rest at ``bw_near`` (``seconds_W``'s replica term, in its order); twin
        of ``common.h``'s ``Model::total_split``."""
        if self.bw_far is None or self.bw_near is None:
            raise ValueError("split_total_fn needs a fill's copy across nodes (fill_link)")
        head = self.seconds_fn(any_remote, False)  # compute and token: no weight term
        P, near, far, rep_s = self.params_bytes, self.bw_near, self.bw_far, self.replica_s
        weight0 = WEIGHT_COLLECTIVES * any_hot * self.lat if any_hot else 0.0

        def total(rows: int, local: int, remote: int, replica: float, inter: float) -> float:
            compute, token = head(rows, local, remote, 0)
            weight = 0.0
            if any_hot:
                weight = weight0 + ((replica - inter) * P / near + inter * P / far)
                if rep_s:
                    weight = weight + replica * rep_s
            return compute + (token + weight)

        return total

    def seconds_fn(
        self, any_remote: bool, any_hot: bool | int
    ) -> Callable[[int, int, int, int], tuple[float, float]]:
        """``rank_seconds`` with the group-wide flags bound: ``seconds(rows, local, remote,
        replica) -> (compute_s, comm_s)``; ``total_fn``'s expressions in the same order, so
        the same floats bit for bit (a test checks it); ``prediction_lists`` calls it per rank
        (one call instead of ``rank_seconds``' three and their attribute look-ups)."""
        fpr, gf, tbr, bw, P = (
            self.flops_per_row,
            self.gemm_flops,
            self.token_bytes_per_row,
            self.bw,
            self.params_bytes,
        )
        row_s, fixed_s, rep_s, overlap = self.row_s, self.fixed_s, self.replica_s, self.overlap
        token0 = TOKEN_COLLECTIVES * self.lat
        weight0 = WEIGHT_COLLECTIVES * any_hot * self.lat if any_hot else 0.0

        def seconds(rows: int, local: int, remote: int, replica: int) -> tuple[float, float]:
            compute = rows * fpr / gf
            if row_s:
                compute = compute + rows * row_s
            if fixed_s:
                compute = compute + fixed_s
            token = 0.0
            if any_remote:
                token = token0 + tbr * remote / bw
                if overlap:
                    hidden = local * fpr / gf
                    if row_s:
                        hidden = hidden + local * row_s
                    token = max(0.0, token - hidden)
            weight = 0.0
            if any_hot:
                weight = weight0 + P * replica / bw
                if rep_s:
                    weight = weight + replica * rep_s
            return compute, token + weight

        return seconds

    def _compute_s(self, rows: int) -> float:
        compute = rows * self.flops_per_row / self.gemm_flops
        if self.row_s:
            compute = compute + rows * self.row_s
        if self.fixed_s:
            compute = compute + self.fixed_s
        return compute

    def _comm_s(
        self, local: int, remote: int, replica: int, any_remote: bool, any_hot: bool | int
    ) -> float:
        token = 0.0
        if any_remote:
            token = TOKEN_COLLECTIVES * self.lat + self.token_bytes_per_row * remote / self.bw
            if self.overlap:
                hidden = local * self.flops_per_row / self.gemm_flops
                if self.row_s:
                    hidden = hidden + local * self.row_s
                token = max(0.0, token - hidden)
        weight = 0.0
        if any_hot:  # True: one fetch + one return; an int: that many relay rounds of each
            weight = WEIGHT_COLLECTIVES * any_hot * self.lat + self.params_bytes * replica / self.bw
            if self.replica_s:
                weight = weight + replica * self.replica_s
        return token + weight

    def seconds_W(
        self, loads_4W: torch.Tensor, any_remote: bool | torch.Tensor, any_hot: bool | int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rank_seconds`` for a batch. ``loads_4W``: float64 [..., 4, M] holding the integer
        aggregates (rows, local, remote, replica) of M ranks (``LOADS`` order) ->
        (compute_s, comm_s), float64 [..., M].

        Same expressions in the same order as ``rank_seconds``: each ``aggregate * factor /
        divisor`` multiplies two float64-exact integers (rounded once, as Python's int -> float
        rounds the exact product; ``check_exact`` bounds them) and divides, so each entry equals
        ``rank_seconds`` of that entry bit for bit. ``any_remote`` may be a bool tensor that
        broadcasts against [..., M] (one flag per candidate in the planner).
        """
        inter = None
        if loads_4W.shape[-2] == 6:  # topology: rows 4, 5 = the inter-node remote rows, edges
            inter, loads_4W = loads_4W.narrow(-2, 4, 2), loads_4W.narrow(-2, 0, 4)
        # rows, local, remote, replica terms (one unbind: per-op overhead dominates tiny inputs)
        compute, local, remote, replica = (loads_4W * self._factor_41 / self._divisor_41).unbind(-2)
        if inter is not None:  # the inter-node part of each at the inter-node bandwidth
            r_in, e_in = inter.unbind(-2)
            remote_all, replica_all = loads_4W.unbind(-2)[2:]
            tb, P, bw, bwi = self.token_bytes_per_row, self.params_bytes, self.bw, self.bw_inter
            remote = (remote_all - r_in) * tb / bw + r_in * tb / bwi
            replica = (replica_all - e_in) * P / bw + e_in * P / bwi
        if self.row_s:  # the fixed costs: skipped when 0.0, as in rank_seconds (same value)
            rows_n, local_n = loads_4W.unbind(-2)[:2]
            compute = compute + rows_n * self.row_s
            local = local + local_n * self.row_s
        if self.fixed_s:
            compute = compute + self.fixed_s
        token = TOKEN_COLLECTIVES * self.lat + remote
        if self.overlap:
            token = (token - local).clamp_min(0.0)
        if isinstance(any_remote, torch.Tensor):
            token = torch.where(any_remote, token, 0.0)
        elif not any_remote:
            token = torch.zeros_like(compute)
        if not any_hot:
            return compute, token + 0.0
        weight = WEIGHT_COLLECTIVES * any_hot * self.lat + replica
        if self.replica_s:
            weight = weight + loads_4W.select(-2, 3) * self.replica_s
        return compute, token + weight

    def check_exact(self, max_count: int) -> None:
        """Raise ``ValueError`` unless aggregates up to ``max_count`` (rows or replicas) and the
        per-row / per-replica factors are exact in float64 (below 2**53): then every product in
        ``seconds_W`` is rounded once, as Python's int -> float rounds, and equals
        ``rank_seconds`` bit for bit."""
        factors = (self.flops_per_row, self.token_bytes_per_row, self.params_bytes)
        if max_count >= 2**53 or max(factors) >= 2**53:
            raise ValueError(
                f"counts too large for exact cost arithmetic ({max_count} rows, factors "
                f"{factors}); use smaller counts or layer sizes"
            )

    def prediction_W(self, loads_4W: torch.Tensor, rounds: int | None = None) -> Prediction:
        """The ``Prediction`` of per-rank aggregates ``loads_4W`` (float64 [4, W], ``LOADS``).
        ``rounds``: the replica relay's rounds (``plan_pricing``); None: one fetch and one
        return when any replica exists (the flat fan-out)."""
        any_remote = bool(loads_4W[2].any())
        any_hot = bool(loads_4W[3].any()) if rounds is None else rounds
        compute_W, comm_W = self.seconds_W(loads_4W, any_remote, any_hot)
        return self.pack(compute_W, comm_W, loads_4W)

    def pack(
        self, compute_W: torch.Tensor, comm_W: torch.Tensor, loads_4W: torch.Tensor
    ) -> Prediction:
        """The ``Prediction`` of ``seconds_W``'s output and the aggregates it came from."""
        token, weight = 2 * self.token_bytes_per_row, 2 * self.params_bytes
        replica_W = loads_4W[3]
        loads_4W = loads_4W.to(torch.int64)
        # whole copies: exact int64 products; fractional ones (the relay's chunks) rounded to
        # whole bytes as ``_pack_lists`` rounds them (the same IEEE product, half to even)
        whole_W = loads_4W[3].to(torch.float64) == replica_W
        fraction_W = torch.round(replica_W * weight).to(torch.int64)
        if int(loads_4W[2:].max() + 1) * max(token, weight) >= 2**63:  # int64 would overflow
            rows, _, remote = loads_4W[:3].tolist()
            # copies: whole ones as ints, the relay's fractional ones as floats (built only
            # here: a W-long Python pass)
            replica = [int(x) if x.is_integer() else x for x in replica_W.tolist()]
            return self._pack_lists(compute_W.tolist(), comm_W.tolist(), rows, remote, replica)
        # the same values as _pack_lists in fewer host steps (W = 1024 plans pack twice):
        # exact int64 products, and the max of the same IEEE sums
        return Prediction(
            compute_s=tuple(compute_W.tolist()),
            comm_s=tuple(comm_W.tolist()),
            token_bytes=tuple((loads_4W[2] * token).tolist()),
            weight_bytes=tuple(torch.where(whole_W, loads_4W[3] * weight, fraction_W).tolist()),
            rows=tuple(loads_4W[0].tolist()),
            step_s=float((compute_W + comm_W).max()),
        )

    def prediction_lists(
        self,
        rows: list[int],
        local: list[int],
        remote: list[int],
        replica: list[int],
        rounds: int | None = None,
    ) -> Prediction:
        """``prediction_W`` of aggregates held as lists of Python ints, without a tensor (the
        list planner's whole plan costs less than a few tensor ops): ``rank_seconds`` per rank,
        equal to ``seconds_W`` bit for bit, so the same ``Prediction``. ``rounds``: as for
        ``prediction_W``. The caller has run ``check_exact`` on them."""
        any_remote = any(remote)
        any_hot = any(replica) if rounds is None else rounds
        pairs = list(map(self.seconds_fn(any_remote, any_hot), rows, local, remote, replica))
        if not len(rows) == len(local) == len(remote) == len(replica):
            raise ValueError("prediction_lists needs lists of one length W")
        compute, comm = zip(*pairs, strict=True) if pairs else ((), ())
        return self._pack_lists(compute, comm, rows, remote, replica)

    def _pack_lists(
        self,
        compute: list[float] | tuple[float, ...],
        comm: list[float] | tuple[float, ...],
        rows: list[int],
        remote: list[int],
        replica: list[int],
    ) -> Prediction:
        token, weight = 2 * self.token_bytes_per_row, 2 * self.params_bytes
        return Prediction(
            compute_s=tuple(compute),
            comm_s=tuple(comm),
            token_bytes=tuple(map(token.__mul__, remote)),
            weight_bytes=tuple(
                weight * n if isinstance(n, int) else int(round(weight * n)) for n in replica
            ),
            rows=tuple(rows),
            step_s=max(map(operator.add, compute, comm)),
        )

    def prediction(
        self, rows: list[int], local: list[int], remote: list[int], replica: list[int]
    ) -> Prediction:
        """The ``Prediction`` of per-rank aggregates (``rank_loads`` output): ``prediction_W``
        of them, so a prediction never depends on which form the aggregates came in."""
        self.check_exact(max(*rows, *remote, *replica))
        return self.prediction_W(torch.tensor([rows, local, remote, replica], dtype=torch.float64))


@functools.lru_cache(maxsize=64)
def _cached_step_model(shape: LayerShape, profile: HardwareProfile, overlap: bool) -> StepModel:
    return StepModel(shape, profile, overlap)


def step_model(shape: LayerShape, profile: HardwareProfile, overlap: bool) -> StepModel:
    """A ``StepModel`` for (shape, profile, overlap), shared between calls with equal arguments
    (it is immutable; the planners build one per plan, and per-call setup is a visible part of a
    small plan's cost)."""
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    return _cached_step_model(shape, profile, overlap)


def predict(
    counts_WN: object,
    hot: Mapping[int, Iterable[int]] | Iterable,
    shape: LayerShape,
    profile: HardwareProfile,
    overlap: bool = True,
) -> Prediction:
    """Predict one layer step (forward + backward) for the counts ``counts_WN`` ([W, N] ints or
    an integer CPU tensor) and the replica placement ``hot`` (see ``replica_map`` for its forms).
    The model is described in the module docstring."""
    model = StepModel(shape, profile, overlap)
    C = counts_as_lists(counts_WN, shape)
    hot_map = replica_map(hot, C, shape)
    return model.prediction(*rank_loads(C, hot_map, shape.experts_per_rank))


def plan_loads(
    C_WN: torch.Tensor,
    replicas: Iterable[tuple[int, Iterable[int]]],
    experts_per_rank: int,
    *,
    base_4W: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rank_loads`` of a validated int64 ``C_WN`` under ``replicas`` (``(g, holder ranks)``
    pairs, e.g. ``Plan.replicas``): float64 [4, W] in ``LOADS`` order, equal to
    ``rank_loads`` exactly (integers). Starts from ``baseline_loads`` and moves each hot expert's
    holder rows from its owner to the holders; cost: the baseline's two reductions, one gather
    of the hot columns and a few Python ops per holder (the what-if simulator uses it at
    W = 1024, N = 4096). ``base_4W``: ``baseline_loads(C_WN, E)[0]`` when the caller has it
    (a planner pricing several plans of one C: the two reductions once)."""
    E = experts_per_rank
    loads_4W = baseline_loads(C_WN, E)[0] if base_4W is None else base_4W
    replicas = [(g, h) for g, h in ((g, tuple(h)) for g, h in replicas) if h]
    if not replicas:
        return loads_4W
    if C_WN.shape[0] > LIST_PRICING_W:  # the same integers from a few tensor ops
        return plan_loads_tensor(C_WN, replicas, E, loads_4W).to(torch.float64)
    return torch.tensor(_plan_loads_lists(C_WN, replicas, E, loads_4W), dtype=torch.float64)


def _plan_loads_lists(
    C_WN: torch.Tensor, replicas: list[tuple[int, tuple[int, ...]]], E: int, base_4W: torch.Tensor
) -> list[list[int]]:
    """``plan_loads`` on Python ints ([rows, local, remote, replica], W ints each): one gather
    of the hot columns, then a few list updates per holder (a tensor op per hot expert costs
    more at the list planner's sizes). ``replicas``: (g, holders), holders non-empty."""
    rows, local, remote, replica = base_4W.to(torch.int64).tolist()
    if not replicas:
        return [rows, local, remote, replica]
    cols_HW = C_WN[:, [g for g, _ in replicas]].T.tolist()  # [hot, W]: C[s][g] of each hot g
    for (g, holders), col_W in zip(replicas, cols_HW, strict=True):
        o, moved = g // E, 0
        for h in holders:  # a holder computes its own rows of g: local, no longer sent
            c = col_W[h]
            rows[h] += c
            local[h] += c
            remote[h] -= c
            replica[h] += 1
            moved += c
        rows[o] -= moved  # the owner no longer computes (nor receives) them
        remote[o] -= moved
        replica[o] += len(holders)
    return [rows, local, remote, replica]


def plan_pricing(
    C_WN: torch.Tensor,
    plan: object,
    experts_per_rank: int,
    profile: object = None,
    *,
    base_4W: torch.Tensor | None = None,
    colsum_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """The aggregates of a ``Plan`` (float64 [4, W], ``LOADS`` order; [6, W] when ``profile``
    has a topology) and its weight rounds.

    Segments without a share entry follow the replica rule (``plan_loads``). A share entry
    (s, g, runs) puts each run's rows at its rank r: rows[r] += n; local to s when r == s, else
    remote at both s (it sends them) and r (it computes them for s). When ``plan.relay`` is set
    the replica column is each rank's copies in the relay's messages (``relay_degrees``, what
    ``relay_messages`` executes: per copy the sender sends P forward and receives P of
    gradient, the receiver the reverse; fractional chunks: 1 for the owner per link class,
    under 2 for a holder) and the rounds are the most any expert takes (1 for a single
    holder, 2 for a scatter + all-gather, 3 when far holders on 2 or more nodes exchange
    chunks before their in-node all-gather); otherwise the flat fan-out of today (the owner
    serves every holder; one round when any replica exists). A plan without shares and without
    relay prices exactly as ``plan_loads`` / ``predict``. ``profile``: its topology
    (``ranks_per_node``) splits each relay into the owner's node and the far nodes
    (``relay`` module doc) and adds two rows: the remote rows and the relay copies that cross
    nodes, at each rank (``relay_inter_copies``; ``StepModel.seconds_W`` prices them at the
    inter-node bandwidth); None or one link: [4, W].
    ``base_4W``: as for ``plan_loads``; ``colsum_N``: C's column sums (``counts_with_sums``)
    when the caller has them: above ``LIST_PRICING_W`` ranks a plan with ranges then needs no
    gather of its ranged experts' columns (~1.6 ms at W = 1024 with ~100 of them).
    """
    E = experts_per_rank
    distance = node_distance(profile)
    shares = getattr(plan, "shares", ())
    ranges = getattr(plan, "ranges", ()) or getattr(plan, "kept", ())  # either: range code
    relay = getattr(plan, "relay", False)
    rounds = int(bool(plan.replicas))
    if distance is None and not shares:  # compiled where it can run: the same loads
        base_4W = baseline_loads(C_WN, E)[0] if base_4W is None else base_4W
        compiled = _compiled_plan_loads(C_WN, plan, E, base_4W, colsum_N)
        if compiled is not None:
            return compiled
    if distance is not None and not shares:  # nodes of consecutive ranks: compiled too
        compiled = _compiled_nodes_loads(C_WN, plan, E, distance)
        if compiled is not None:
            return compiled
    if distance is None and not shares and C_WN.shape[0] > LIST_PRICING_W:
        return _plan_pricing_tensor(C_WN, plan, E, base_4W, relay, rounds, colsum_N)
    replicas = [(g, h) for g, h in ((g, tuple(h)) for g, h in plan.replicas) if h]
    base_4W = baseline_loads(C_WN, E)[0] if base_4W is None else base_4W
    if not shares and not ranges and not relay and distance is None:  # plan_loads
        if not replicas:
            return base_4W, rounds
        loads = _plan_loads_lists(C_WN, replicas, E, base_4W)
        return torch.tensor(loads, dtype=torch.float64), rounds
    # on Python ints: a few list operations per share entry (tensor element ops cost ~us each)
    if C_WN.shape[0] > LIST_PRICING_W:  # the replica rule's loads from the tensor path
        rows, local, remote, replica = plan_loads_tensor(C_WN, replicas, E, base_4W).tolist()
    else:
        rows, local, remote, replica = _plan_loads_lists(C_WN, replicas, E, base_4W)
    W = len(rows)
    per_node = getattr(profile, "ranks_per_node", None) or W
    remote_inter, replica_inter = _inter_node_loads(C_WN, plan, E, per_node)
    if ranges:  # the ranges' loads in closed form; across nodes, their crossings too
        experts = [(g, r, k, plan.holders(g)) for g, r, k in range_experts(plan)]
        if W > LIST_PRICING_W:
            loads_3W = torch.tensor([rows, local, remote], dtype=torch.int64)
            range_relay_loads_tensor(C_WN, experts, E, loads_3W)
            rows, local, remote = loads_3W.tolist()
        else:
            range_loads(C_WN, plan, E, rows, local, remote)
        if distance is not None and per_node < W:
            crossing = range_crossing_tensor(C_WN, experts, E, per_node).tolist()
            remote_inter = list(map(int.__add__, remote_inter, crossing))
    counts = []
    if shares:
        index = torch.tensor([[s, g] for s, g, _ in shares], dtype=torch.int64)
        counts = C_WN[index[:, 0], index[:, 1]].tolist()
    for (s, g, runs), c in zip(shares, counts, strict=True):
        # the replica rule's placement undone first, then each run placed
        for r, n in ((plan.computed_at(s, g, E), -c), *runs):
            rows[r] += n
            if r == s:
                local[s] += n
            else:
                remote[s] += n
                remote[r] += n
                if s // per_node != r // per_node:
                    remote_inter[s] += n
                    remote_inter[r] += n
    if relay and plan.replicas:
        # copies sent + received per rank (fractional chunks, each on the relay's 2**-24
        # grid, so these sums are exact in any order: ``relay`` module doc)
        replica = [0.0] * W
        replica_inter = [0.0] * W
        rounds = 0
        for g, holders in plan.replicas:
            if distance is None and holders:  # one link: one value for every holder
                copies, depth = near_relay(g // E, holders)
                rounds = max(rounds, depth)
                replica[g // E] += 1.0
                for h in holders:
                    replica[h] += copies
                continue
            degrees, depth = relay_degrees(g // E, holders, distance)
            rounds = max(rounds, depth)  # every expert's rounds run together
            for r, d in degrees.items():
                replica[r] += d
            if distance is not None:
                for r, d in relay_inter_copies(g // E, holders, distance).items():
                    replica_inter[r] += d
    loads = [rows, local, remote, replica]
    if distance is not None:
        loads += [remote_inter, replica_inter]
    return torch.tensor(loads, dtype=torch.float64), rounds


def _compiled_plan_loads(
    C_WN: torch.Tensor,
    plan: object,
    E: int,
    base_4W: torch.Tensor,
    colsum_N: torch.Tensor | None,
) -> tuple[torch.Tensor, int] | None:
    """``plan_pricing`` of a plan without share entries on one link, compiled
    (``native_pricing.plan_loads``: the same loads and rounds; measured ~2-6x faster than the
    list or tensor code on plan_mix's plans at W = 8..1024); None: run the Python."""
    from mixmoe.placement import native_pricing  # imported here: it imports this module

    return native_pricing.plan_loads(C_WN, plan, E, base_4W, colsum_N)


def _compiled_nodes_loads(
    C_WN: torch.Tensor, plan: object, E: int, distance: object
) -> tuple[torch.Tensor, int] | None:
    """``plan_pricing`` with a topology of ``ranks_per_node`` consecutive ranks a node
    (``relay.nodes_of``'s form), compiled (``native_nodes.plan_loads_nodes``: the same 6 rows
    and rounds; h100-nvlink-ib, zipf:1.2: ``plan_none`` W = 1024 ~9.7 ms in the tensor code);
    None: run the Python."""
    from mixmoe.placement import native_nodes  # imported here: it imports this module

    per_node = getattr(distance, "ranks_per_node", None)
    if type(per_node) is not int or per_node < 1:
        return None
    return native_nodes.plan_loads_nodes(C_WN, plan, E, per_node)


def _plan_pricing_tensor(
    C_WN: torch.Tensor,
    plan: object,
    E: int,
    base_4W: torch.Tensor | None,
    relay: bool,
    rounds: int,
    colsum_N: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """``plan_pricing`` of a plan without share entries on one link, on tensors
    (``loads_tensor``: the same integers and grid floats as the list code, bit for bit)."""
    replicas = [(g, h) for g, h in ((g, tuple(h)) for g, h in plan.replicas) if h]
    base_4W = baseline_loads(C_WN, E)[0] if base_4W is None else base_4W
    loads_4W = plan_loads_tensor(C_WN, replicas, E, base_4W)  # int64 [4, W]
    experts = [(g, r, k, plan.holders(g)) for g, r, k in range_experts(plan)]
    range_relay_loads_tensor(C_WN, experts, E, loads_4W, colsum_N)
    if not (relay and plan.replicas):
        return loads_4W.to(torch.float64), rounds
    replica_W, rounds = relay_copies_tensor(replicas, E, C_WN.shape[0])
    return torch.cat([loads_4W[:3].to(torch.float64), replica_W.view(1, -1)]), rounds


def _inter_node_loads(
    C_WN: torch.Tensor, plan: object, E: int, per_node: int
) -> tuple[list[int], list[int]]:
    """Remote rows and flat fan-out edges that cross nodes, per rank, under the replica rule of
    ``plan`` (nodes of ``per_node`` consecutive ranks): a segment (s, g) computed at d != s on
    another node counts at s and d; an owner -> holder copy on another node at both."""
    W, N = C_WN.shape
    if per_node >= W:
        return [0] * W, [0] * W
    if W % per_node == 0:  # whole nodes: two block reductions of C, no [W, N] masks
        replicas = [(g, tuple(h)) for g, h in plan.replicas]
        return inter_node_loads_tensor(C_WN, replicas, E, per_node)
    return _inter_node_loads_masks(C_WN, plan, E, per_node)


def _inter_node_loads_masks(
    C_WN: torch.Tensor, plan: object, E: int, per_node: int
) -> tuple[list[int], list[int]]:
    """``_inter_node_loads`` through [W, N] masks: any node size (a last node with fewer
    ranks), and the twin ``inter_node_loads_tensor`` is tested against."""
    W, N = C_WN.shape
    dest_WN = (torch.arange(N) // E).expand(W, N).clone()  # every row at its owner
    flat = [0] * W
    for g, holders in plan.replicas:
        h = torch.tensor(list(holders), dtype=torch.int64)
        dest_WN[h, g] = h  # a holder computes its own rows
        for r in holders:
            if r // per_node != g // E // per_node:
                flat[r] += 1
                flat[g // E] += 1
    node_W = torch.arange(W) // per_node
    crossing_WN = torch.where(node_W.view(W, 1) != node_W[dest_WN], C_WN, 0)
    remote_W = crossing_WN.sum(1)  # sent by each source
    remote_W = remote_W.index_add_(0, dest_WN.reshape(-1), crossing_WN.reshape(-1))
    return remote_W.tolist(), flat


def predict_plan(
    counts_WN: object, plan: object, shape: LayerShape, profile: HardwareProfile, overlap: bool
) -> Prediction:
    """The ``Prediction`` of a ``Plan`` (shares, relay and the profile's topology included:
    ``plan_pricing``), the price every strategy's plan gets in the planners and the simulator."""
    C_WN = counts_as_tensor(counts_WN, shape)
    model = step_model(shape, profile, overlap)
    loads_4W, rounds = plan_pricing(C_WN, plan, shape.experts_per_rank, profile)
    model.check_exact(max(2 * int(C_WN.sum()), shape.world_size * shape.num_experts))
    return model.prediction_W(loads_4W, rounds)


def prediction_of(model: StepModel, loads: torch.Tensor, rounds: int | None = None) -> Prediction:
    """``model.prediction_W(loads, rounds)``, compiled where it runs: one link (4 rows,
    ``native_pricing.prediction``) or nodes (6 rows with int rounds, byte counts within int64:
    ``native_nodes.prediction_nodes``), the same Prediction field for field (their twin tests);
    else the tensor code."""
    from mixmoe.placement import native_nodes, native_pricing  # they import this module

    if loads.dtype == torch.float64 and loads.dim() == 2:
        if loads.shape[0] == 4:
            out = native_pricing.prediction(model, loads, rounds)
        elif loads.shape[0] == 6 and rounds is not None and model.bw_inter is not None:
            # pack's int64 bound (past it the Python packs unbounded ints)
            top = float(loads[2:4].max()) if loads.shape[1] else 0.0
            fits = (top + 1) * 2 * max(model.token_bytes_per_row, model.params_bytes) < 2**62
            out = native_nodes.prediction_nodes(model, loads, rounds) if fits else None
        else:
            out = None
        if out is not None:
            return out
    return model.prediction_W(loads, rounds)


def reprice(C_WN: torch.Tensor, plan, model: StepModel, profile: HardwareProfile):
    """``plan`` (a ``Plan``) with its prediction and baseline priced by ``plan_pricing`` under
    ``profile`` (its topology included): the planners' prices when the profile has nodes."""
    E = C_WN.shape[1] // C_WN.shape[0]
    none = dataclasses.replace(
        plan, hot=(), replicas=(), shares=(), ranges=(), kept=(), relay=False
    )
    baseline = prediction_of(model, *plan_pricing(C_WN, none, E, profile))
    if not plan.hot and not plan.shares:
        return dataclasses.replace(plan, prediction=baseline, baseline=baseline)
    prediction = prediction_of(model, *plan_pricing(C_WN, plan, E, profile))
    return dataclasses.replace(plan, prediction=prediction, baseline=baseline)
