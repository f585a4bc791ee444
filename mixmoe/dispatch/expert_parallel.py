"""Expert-parallel dispatch: the ``a2a``, ``shadow`` and ``mix`` strategies on one engine.

Legend: T tokens here, K top-k, D model dim, W ranks, E experts per rank, N = W*E experts,
R = T*K routed rows, C the count matrix [W, N], H replicas held here, P padded rows.

One step on rank r:
  1. sort rows by expert; count; ``exchange_counts``: one all_gather of [fingerprint, version, c_N]
     -> C on every rank. THE host sync of the layer: every later size and split follows from C.
  2. plan (deterministic, same on every rank): which experts are replicated where.
       a2a    nothing;  shadow  FasterMoE's rule, broadcast to every rank;  mix  the cost model.
  3. replica fetch: one all_to_all of packed weights (cached under ``mix`` while the owners'
     versions are unchanged); its backward sends replica gradients home.
  4. rows of experts owned here or replicated here stay ("local"); the others go to their owner
     in one all_to_all ("remote"). ``mix`` starts it asynchronously and computes local blocks
     while it is in flight; the others wait at once.
  5. expert MLP over 64-row blocks: local-owned, local-replica, then received blocks.
  6. received results go back by the reverse all_to_all (async under ``mix``, overlapped with the
     combine of local results); y = combine(local) + combine(returned).
Backward mirrors it through autograd: all_to_alls run with swapped splits, replica gradients are
reduced into the owner's ``.grad``. Every rank joins every collective, with zero rows too.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from mixmoe.comm.autograd import all_to_all, all_to_all_start, all_to_all_wait
from mixmoe.config import MoEConfig
from mixmoe.dispatch.layout import counts_to_host
from mixmoe.dispatch.replicas import FetchPlan, fetch_replicas, unpack_experts, weights_version
from mixmoe.dispatch.result import DispatchResult
from mixmoe.dispatch.segments import concat_ranges, exclusive_cumsum
from mixmoe.dispatch.step_plan import StepPlan, build_step_plan
from mixmoe.ops.expert_mlp import ExpertWeights, expert_mlp
from mixmoe.ops.rows import combine_rows, gather_rows
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.planner import Plan, plan_mix, plan_none, plan_shadow
from mixmoe.placement.profile import HardwareProfile, default_profile
from mixmoe.schedule.blocks import BlockSchedule, build_block_schedule
from mixmoe.tracing import trace_span
from mixmoe.types import Routing


@dataclass(frozen=True)
class StrategySpec:
    name: str
    overlap: bool  # local blocks computed while the token all_to_all is in flight
    cache_replicas: bool  # reuse fetched replicas while their owners' weights are unchanged


STRATEGY_SPECS = {
    "a2a": StrategySpec("a2a", overlap=False, cache_replicas=False),
    "shadow": StrategySpec("shadow", overlap=False, cache_replicas=False),
    "mix": StrategySpec("mix", overlap=True, cache_replicas=True),
}

_HEADER = 2  # fingerprint, weights version


def config_fingerprint(config: MoEConfig, world_size: int) -> int:
    """A stable 31-bit digest of everything all ranks must agree on."""
    key = (
        config.num_experts,
        config.top_k,
        config.model_dim,
        config.hidden_dim,
        config.activation,
        config.bias,
        config.block_size,
        config.strategy,
        world_size,
    )
    return zlib.crc32(repr(key).encode()) & 0x7FFFFFFF


def _schedule(counts: list[int], slots: list[int], block_size: int, device) -> BlockSchedule:
    nb = sum(-(-c // block_size) for c in counts)
    return build_block_schedule(
        torch.tensor(counts, dtype=torch.int64, device=device),
        torch.tensor(slots, dtype=torch.int64, device=device),
        nb,
        block_size,
        num_rows=sum(counts),
    )


def _padded_source(schedule: BlockSchedule, rows_R: torch.Tensor, fill: int) -> torch.Tensor:
    """For each padded row: ``rows_R[src]`` or ``fill`` for masked padding."""
    src_P = schedule.src_P
    if rows_R.numel() == 0:
        return torch.full_like(src_P, fill)
    return torch.where(src_P >= 0, rows_R[src_P.clamp(min=0)], fill)


class ExpertParallelDispatcher:
    """Callable strategy: ``(x_TD, routing, owned weights, activation) -> DispatchResult``.

    ``weights`` hold the E experts owned by this rank (global ids rank*E .. rank*E+E-1).
    """

    def __init__(
        self, comm, config: MoEConfig, strategy: str, profile: HardwareProfile | None = None
    ) -> None:
        if strategy not in STRATEGY_SPECS:
            raise ValueError(
                f"strategy {strategy!r} is not expert-parallel; use one of {sorted(STRATEGY_SPECS)}"
            )
        W = comm.world_size
        if config.num_experts % W:
            raise ValueError(
                f"num_experts={config.num_experts} is not divisible by the expert-parallel world "
                f"size {W}; use a multiple of {W}"
            )
        self.comm, self.config, self.spec = comm, config, STRATEGY_SPECS[strategy]
        self.name = strategy
        self.experts_per_rank = config.num_experts // W
        self.profile = profile
        self.fingerprint = config_fingerprint(config, W)
        self._handshake_done = False
        self._cache_key: tuple | None = None
        self._cache_HQ: torch.Tensor | None = None
        self._last_fetch: FetchPlan | None = None

    # -- agreement -----------------------------------------------------------------------------
    def _handshake(self, device: torch.device) -> None:
        """Once: a fixed-size exchange so ranks with a different expert count (whose count vectors
        differ in length) fail clearly instead of hanging in the count exchange."""
        cfg = self.config
        mine = torch.tensor(
            [self.fingerprint, cfg.num_experts, cfg.top_k, cfg.model_dim, cfg.hidden_dim],
            dtype=torch.int64,
            device=device,
        )
        every = self.comm.all_gather_rows(mine).tolist()
        if any(row != every[0] for row in every):
            described = "; ".join(
                f"rank {r}: num_experts={row[1]}, top_k={row[2]}, model_dim={row[3]}, hidden_dim={row[4]}"
                for r, row in enumerate(every)
            )
            raise ValueError(
                f"MoE config differs across ranks ({described}); build the layer with "
                "the same MoEConfig on every rank"
            )
        self._handshake_done = True

    def exchange_counts(
        self, counts_N: torch.Tensor, version: int
    ) -> tuple[list[list[int]], list[int]]:
        """THE host sync: all_gather [fingerprint, version, counts] and bring C to the host."""
        header = torch.tensor(
            [self.fingerprint, version], dtype=torch.int64, device=counts_N.device
        )
        with trace_span(
            "moe.count_exchange",
            kind="comm",
            comm_func="allgather",
            group="exp",
            shape=(counts_N.numel() + _HEADER,),
            dtype=torch.int64,
        ):
            every = counts_to_host(self.comm.all_gather_rows(torch.cat([header, counts_N])))
        fingerprints = {row[0] for row in every}
        if len(fingerprints) != 1:
            raise ValueError(
                "MoE config fingerprints differ across ranks in the count exchange "
                f"({[row[0] for row in every]}); use the same MoEConfig everywhere"
            )
        return [row[_HEADER:] for row in every], [row[1] for row in every]

    def invalidate_replicas(self) -> None:
        """Forget cached replicas (needed only after writing expert weights through ``.data``).
        Call it on every rank."""
        self._cache_key, self._cache_HQ = None, None

    # -- planning ------------------------------------------------------------------------------
    def _plan(self, C: list[list[int]], dtype: torch.dtype, device: torch.device) -> Plan:
        cfg, E = self.config, self.experts_per_rank
        shape = LayerShape(
            model_dim=cfg.model_dim,
            hidden_dim=cfg.hidden_dim,
            experts_per_rank=E,
            world_size=self.comm.world_size,
            bytes_per_element=torch.finfo(dtype).bits // 8,
            gemms_per_expert=3 if cfg.activation == "swiglu" else 2,
        )
        profile = self.profile or default_profile(device.type)
        if self.name == "a2a":
            return plan_none(C, shape, profile)
        if self.name == "shadow":
            return plan_shadow(C, shape, profile)
        return plan_mix(C, shape, profile, cfg.max_replicas)

    def _exchange(self, name: str, x_RD: torch.Tensor, out_splits, in_splits, moving: bool):
        """Token all_to_all: async under overlap (returns a pending handle), else synchronous;
        skipped on every rank alike when nothing moves."""
        with trace_span(
            name,
            kind="comm",
            comm_func="all_to_all",
            group="exp",
            shape=tuple(x_RD.shape),
            dtype=x_RD.dtype,
            in_splits=in_splits,
            out_splits=out_splits,
        ):
            if not moving:
                return x_RD[:0], None
            if self.spec.overlap:
                return all_to_all_start(self.comm, x_RD, out_splits, in_splits)
            return all_to_all(self.comm, x_RD, out_splits, in_splits), None

    def _fetch(self, weights: ExpertWeights, plan: Plan, step: StepPlan, versions: list[int]):
        """Replica weights for this step (None if nothing is replicated) and whether the fetch
        was served from the cache."""
        if not plan.replicas:
            return None, False
        E = self.experts_per_rank
        key = (plan.replicas, tuple(versions[g // E] for g, _ in plan.replicas))
        cached = self._cache_HQ if self.spec.cache_replicas and key == self._cache_key else None
        with trace_span(
            "moe.replica_fetch",
            kind="comm",
            comm_func="all_to_all",
            group="exp",
            in_splits=step.fetch.in_splits,
            out_splits=step.fetch.out_splits,
        ):
            replicas_HQ = fetch_replicas(self.comm, weights, step.fetch, cached)
        if self.spec.cache_replicas:
            self._cache_key, self._cache_HQ = key, replicas_HQ.detach()
        self._last_fetch = step.fetch
        return unpack_experts(replicas_HQ, weights), cached is not None

    # -- the step ------------------------------------------------------------------------------
    def __call__(
        self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights, activation: str
    ) -> DispatchResult:
        E, B = self.experts_per_rank, self.config.block_size
        W, r, N = self.comm.world_size, self.comm.rank, self.config.num_experts
        T, K = routing.ids_TK.shape
        device = x_TD.device
        if weights.num_slots != E:
            raise ValueError(
                f"dispatcher expects the {E} experts owned by rank {r}, got {weights.num_slots}"
            )
        if not self._handshake_done:
            self._handshake(device)

        # 1. sort rows by expert, count, exchange counts (the host sync)
        key_R = torch.where(routing.ids_TK >= 0, routing.ids_TK, N).reshape(-1)
        order_R = torch.argsort(key_R, stable=True)
        counts_N = torch.bincount(key_R, minlength=N + 1)[:N]
        C, versions = self.exchange_counts(counts_N, weights_version(weights))
        c = C[r]

        # 2. plan: the same on every rank
        with trace_span("moe.plan", kind="host"):
            plan = self._plan(C, x_TD.dtype, device)
            step = build_step_plan(C, plan, r, E)
        moving = step.rows_moved > 0

        # 3. replica fetch (one all_to_all of packed weights, or the cache)
        replica_weights, cached = self._fetch(weights, plan, step, versions)

        # 4. rows (positions in expert-sorted order): local-owned, local-replica, remote
        start = exclusive_cumsum(c)

        def rows_of(experts: tuple[int, ...]) -> torch.Tensor:
            return concat_ranges([start[g] for g in experts], [c[g] for g in experts], device)

        token_R = order_R // K
        own_rows, rep_rows, send_rows = (
            rows_of(step.own_experts),
            rows_of(step.rep_experts),
            rows_of(step.send_experts),
        )
        recv_RD, pending = self._exchange(
            "moe.dispatch", x_TD[token_R[send_rows]], step.out_splits, step.in_splits, moving
        )

        # 5. experts: local blocks first (overlapping the all_to_all under mix), then received
        with trace_span("moe.experts_local", kind="compute"):
            sched_own = _schedule([c[g] for g in step.own_experts], list(range(E)), B, device)
            out_own_PD = expert_mlp(
                gather_rows(x_TD, _padded_source(sched_own, token_R[own_rows], T)),
                weights,
                sched_own,
                activation,
            )
            rep_counts = [c[g] for g in step.rep_experts]
            sched_rep = _schedule(rep_counts, list(range(len(rep_counts))), B, device)
            out_rep_PD = out_own_PD[:0]
            if replica_weights is not None:
                out_rep_PD = expert_mlp(
                    gather_rows(x_TD, _padded_source(sched_rep, token_R[rep_rows], T)),
                    replica_weights,
                    sched_rep,
                    activation,
                )
        if pending is not None:
            recv_RD = all_to_all_wait(recv_RD, pending)
        with trace_span("moe.experts_remote", kind="compute"):
            sched_recv = _schedule(step.recv_counts, step.recv_slots, B, device)
            n_recv = recv_RD.shape[0]
            all_recv_R = torch.arange(n_recv, device=device)
            out_recv_PD = expert_mlp(
                gather_rows(recv_RD, _padded_source(sched_recv, all_recv_R, n_recv)),
                weights,
                sched_recv,
                activation,
            )
            out_recv_RD = out_recv_PD[sched_recv.padded_position_R()]

        # 6. results home (overlapped with the local combine under mix), combine
        back_RD, back_pending = self._exchange(
            "moe.return", out_recv_RD, step.in_splits, step.out_splits, moving
        )
        with trace_span("moe.combine", kind="compute"):
            out_loc_PD = torch.cat([out_own_PD, out_rep_PD])
            n_loc, n_send = out_loc_PD.shape[0], send_rows.numel()
            inv_R = torch.empty_like(order_R)
            inv_R[order_R] = torch.arange(order_R.numel(), device=device)
            pos_loc = torch.full((T * K,), n_loc, dtype=torch.int64, device=device)
            pos_loc[own_rows] = sched_own.padded_position_R()
            pos_loc[rep_rows] = sched_own.num_padded_rows + sched_rep.padded_position_R()
            pos_back = torch.full((T * K,), n_send, dtype=torch.int64, device=device)
            pos_back[send_rows] = torch.arange(n_send, device=device)
            y_TD = combine_rows(out_loc_PD, pos_loc[inv_R].view(T, K), routing.weights_TK)
            if back_pending is not None:
                back_RD = all_to_all_wait(back_RD, back_pending)
            y_TD = y_TD + combine_rows(back_RD, pos_back[inv_R].view(T, K), routing.weights_TK)

        rows_W = plan.prediction.rows
        stats = {
            "rows_moved": step.rows_moved,
            "replicas": sum(len(h) for _, h in plan.replicas),
            "max_rows": max(rows_W),
            "mean_rows": sum(rows_W) / W,
            "replica_cached": cached,
        }
        return DispatchResult(y_TD, counts_N, stats)
