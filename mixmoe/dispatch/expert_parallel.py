"""Expert-parallel dispatch: the ``a2a``, ``shadow`` and ``mix`` strategies on one engine.

Legend: T tokens here, K top-k, D model dim, W ranks, E experts per rank, N = W*E experts,
R = T*K routed rows, C the count matrix [W, N], H replicas held here, S rows sent away.

One step on rank r, as three calls (``MoE.forward`` makes them):

  dispatch(x_TD, routing, weights) -> (rows, layout, meta)
    1. count rows per expert; ``exchange_counts``: one all_gather of [fingerprint, version, c_N]
       as int32 words -> C on every rank. THE host sync of the layer: every later size and split
       follows from C.
    2. plan (deterministic, same on every rank) with the strategy's planner (``strategies.py``).
       Under ``mix`` (``MoEConfig.plan_async``) the plan runs on this dispatcher's background
       thread while this rank's rows for its own experts are sorted and computed (when the last
       plan kept them all here: a plan with share entries may send some to helpers); the step
       then waits for the plan (``moe.plan.wait``; ``StepMeta.plan_wait_ms``).
    3. replica fetch: the relay rounds of packed weights (whole rows or chunks), one all_to_all
       each (``replicas.py``; cached under ``mix`` while the plan's replicas, its relay flag
       and the owners' versions are unchanged);
       its backward sends replica gradients home the reverse way.
    4. one sort of the rows into [own | replica | sent | dropped] and the step's index tensors
       from one upload (``step_layout.py``; under share entries the sent rows are grouped by
       receiver, any rank computing a run: ``step_shares.py``); rows computed elsewhere go out
       in one all_to_all (async under ``mix``: waited for only by the experts).
  experts(rows, layout)  (``Experts.forward``): fused expert MLP calls, local work first (it
       overlaps the exchange under ``mix``; the own rows already computed under an async plan),
       then the received rows (with owned weights, and with replicas on a helper), read by
       index and written in return order.
  combine(out, meta) -> y_TD
    5. received results go back by the reverse all_to_all; y = local output + weighted sum of
       the returned rows.
Backward mirrors it through autograd: all_to_alls run with swapped splits, replica gradients are
reduced into the owner's ``.grad``. Every rank joins every collective, with zero rows too.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mixmoe.comm import Communicator
from mixmoe.comm.autograd import all_to_all, all_to_all_start, all_to_all_wait
from mixmoe.config import MoEConfig
from mixmoe.dispatch.layout import count_matrix_to_host
from mixmoe.dispatch.replicas import RelayPlan, ReplicaCache, unpack_experts, weights_version
from mixmoe.dispatch.step import (
    DispatchedRows,
    ExpertLayout,
    ExpertOutputs,
    ExpertWork,
    run_work,
)
from mixmoe.dispatch.step_layout import StepLayout, build_own_layout, build_step_layout
from mixmoe.dispatch.step_plan import StepPlan, build_step_plan
from mixmoe.dispatch.strategies import STRATEGY_SPECS, config_fingerprint, strategy_spec
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.rows import combine_rows
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.counts import CountSums
from mixmoe.placement.native_pricing import count_sums
from mixmoe.placement.plan import Plan
from mixmoe.placement.profile import HardwareProfile, default_profile
from mixmoe.placement.refit import carried_plan
from mixmoe.placement.relay import node_distance
from mixmoe.schedule.sort import expert_counts
from mixmoe.tracing import trace_span
from mixmoe.types import Routing

__all__ = ["STRATEGY_SPECS", "ExpertParallelDispatcher", "StepMeta", "config_fingerprint"]

_HEADER = 3  # the count exchange's header words: fingerprint, weights version (high, low)
_WORD = 31  # bits of a version word: int32 words, never negative
# C's size from which the planning thread sums C once for the plan and the bookkeeping
# (measured, zipf:1.2, one thread: W = 256 x 1024 experts 1.79 -> 1.71 ms a step; W = 64 x 256
# 0.53 -> 0.55 ms: below, the two own passes cost less than one more compiled call)
SHARED_SUMS_MIN = 1 << 18


def _check_sums(C: torch.Tensor, sums: CountSums) -> None:
    """``check_plans``' check of the sums the plan is given: C's, exactly."""
    if not (torch.equal(sums.colsum_N, C.sum(0)) and torch.equal(sums.rowsum_W, C.sum(1))):
        raise RuntimeError(
            "the count sums handed to the planner are not the count matrix's column and row "
            "sums: a bug in the count exchange (dispatch.layout.count_matrix_to_host)"
        )


def _waited(job: Future) -> tuple[object, float]:
    """The planning thread's ``job`` result, and the seconds this thread blocked for it: the
    part of an async plan the step did not hide (``moe.plan.wait`` in a trace)."""
    start = time.perf_counter()
    with trace_span("moe.plan.wait", kind="host"):
        result = job.result()
    return result, time.perf_counter() - start


@dataclass(frozen=True)
class StepMeta:
    """Frozen record of one expert-parallel step on this rank (what ``combine`` needs, and what
    the step did).

    layout:     the step's index tensors (row order, positions, schedules; ``step_layout.py``).
    step:       host-side bookkeeping: experts per group, splits, receive segments, the fetch.
    plan:       the placement plan (replicas, cost-model prediction).
    weights_TK: the routing's combine weights (applied to the returned rows here).
    moving:     whether any row crosses ranks anywhere (all ranks agree; else no all_to_all).
    counts_N:   rows this rank routed to each global expert (device tensor).
    stats:      rows moved, replicas, rows per rank, whether the replicas came from the cache,
                whether the plan was fitted: the same on every rank.
    global_counts_N: rows every rank of the group routed to each expert (int64 CPU, C summed
                over ranks: the step's load for balance metrics and the selection-bias update).
    plan_wait_ms: what this rank's step waited for its planning thread (an async plan's
                unhidden part; ``moe.plan.wait`` in a trace): a timing, this rank's own.
    """

    layout: StepLayout
    step: StepPlan
    plan: Plan
    weights_TK: torch.Tensor
    moving: bool
    counts_N: torch.Tensor
    stats: dict
    global_counts_N: torch.Tensor | None = None
    plan_wait_ms: float = 0.0


class ExpertParallelDispatcher:
    """``dispatch(x_TD, routing, weights) -> (rows, layout, meta)``; ``combine(out, meta) -> y_TD``.

    ``weights`` hold the E experts owned by this rank (global ids rank*E .. rank*E+E-1).
    """

    def __init__(
        self,
        comm: Communicator,
        config: MoEConfig,
        strategy: str,
        profile: HardwareProfile | None = None,
        *,
        compute_own: Callable[[ExpertWork, torch.Tensor, ExpertWeights], torch.Tensor]
        | None = None,
    ) -> None:
        """``compute_own(work, x_TD, weights) -> y_TD``: how the own rows are computed while an
        async plan is made (default: mixmoe's fused expert MLP, ``run_work``). A caller whose
        experts compute differently (a transformers experts layout) passes its own, so the rows
        the dispatcher computes and the rows the caller computes use the same math."""
        self.spec = strategy_spec(strategy)
        self._compute_own = compute_own
        W = comm.world_size
        if config.num_experts % W:
            raise ValueError(
                f"num_experts={config.num_experts} is not divisible by the expert-parallel world "
                f"size {W}; use a multiple of {W}"
            )
        self.comm, self.config = comm, config
        self.name = strategy
        self.experts_per_rank = config.num_experts // W
        self.profile = profile
        self.fingerprint = config_fingerprint(config, W, strategy)
        self._handshake_done = False
        self.replica_cache = ReplicaCache()
        self._distance = node_distance(profile)  # the relay's route splits by node
        self._owned_rows_stayed = True  # last step's plan computed every own row here
        # tests: ``plan_hook(C_WN, plan) -> Plan`` replaces the planner's plan (it must be a
        # deterministic function of its arguments: every rank calls it on the same values)
        self.plan_hook: Callable[[torch.Tensor, Plan], Plan] | None = None
        # every plan checked against C (``Plan.check_shares``) before it is used: always for a
        # hook's plans; for the built-in planners' only when set (they guarantee it, and their
        # tests check it; the check walks every ranged expert's stream in Python: ~20 ms a
        # step at W = 1024, more than the plan itself)
        self.check_plans = False
        # C's size from which the planning thread sums C once for the plan and the bookkeeping
        # (when the sums did not come from the device)
        self.shared_sums_min = SHARED_SUMS_MIN
        self._planner_thread: ThreadPoolExecutor | None = None  # created by the first async plan
        # plan_ahead: (the plan and route of the last step's counts, on the planning thread;
        # those counts; their sums), or None before the first step
        self._ahead: tuple[Future, torch.Tensor, CountSums | None] | None = None

    def plans_async(self, device: torch.device | str = "cpu") -> bool:
        """Whether a step on ``device`` plans on the background thread: the strategy allows it
        and the config asks for it (``plan_async=None``: on CUDA devices only)."""
        if not self.spec.plan_async:
            return False
        if self.config.plan_async is None:
            return torch.device(device).type == "cuda"
        return self.config.plan_async

    def plans_ahead(self) -> bool:
        """Whether each step fits the plan of the step before's counts (``MoEConfig.plan_ahead``,
        under a strategy that plans in the background: ``mix``)."""
        return self.spec.plan_async and self.config.plan_ahead

    def close(self) -> None:
        """Stop the planning thread, if one was started (a later step starts a new one, and
        under ``plan_ahead`` plans its own counts first). Also done when the dispatcher is
        garbage-collected or copied."""
        if self._planner_thread is not None:
            self._planner_thread.shutdown(wait=True)
            self._planner_thread = None
        self._ahead = None

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) starts its own thread when it first plans, afresh
        state = dict(self.__dict__)
        state["_planner_thread"] = None
        state["_ahead"] = None
        return state

    # -- agreement -----------------------------------------------------------------------------
    def _handshake(self, device: torch.device) -> None:
        """Once: a fixed-size exchange so ranks that disagree (a different expert count, whose
        count vectors differ in length, or a different strategy) fail clearly on every rank
        instead of hanging or planning differently."""
        cfg = self.config
        names = sorted(STRATEGY_SPECS)
        mine = torch.tensor(
            [
                self.fingerprint,
                cfg.num_experts,
                cfg.top_k,
                cfg.model_dim,
                cfg.hidden_dim,
                names.index(self.name),
            ],
            dtype=torch.int64,
            device=device,
        )
        every = self.comm.all_gather_rows(mine).tolist()
        if any(row != every[0] for row in every):
            described = "; ".join(
                f"rank {r}: strategy={names[row[5]]!r}, num_experts={row[1]}, top_k={row[2]}, "
                f"model_dim={row[3]}, hidden_dim={row[4]}"
                for r, row in enumerate(every)
            )
            raise ValueError(
                f"MoE config or strategy differs across ranks ({described}); build the layer "
                "with the same MoEConfig and call parallelize_moe with the same strategy on "
                "every rank"
            )
        self._handshake_done = True

    def exchange_counts(
        self, counts_N: torch.Tensor, version: int
    ) -> tuple[torch.Tensor, list[int], CountSums | None]:
        """THE host sync: all_gather [fingerprint, version, counts] and bring C to the host.
        Returns ``C_WN`` (int64 CPU tensor), every rank's weights version and C's
        ``CountSums`` when they were reduced on the device (else None).

        On the wire every word is int32 (C's counts widened to int64 where they land): a
        rank's count of an expert is at most its routed rows (``dispatch`` refuses 2**31 of
        them), the fingerprint is 31 bits, the version goes in two 31-bit words. Half the
        bytes of int64 words: the exchange grows as W * N (W = 1024, N = 4096: 16 MiB into
        every rank per layer step instead of 32)."""
        if not 0 <= version < 1 << (2 * _WORD):
            raise ValueError(
                f"weights version {version} must be an int in [0, 2**62): a counter of writes "
                "to the experts' weights (replicas.weights_version's)"
            )
        words = [self.fingerprint, version >> _WORD, version & ((1 << _WORD) - 1)]
        header = torch.tensor(words, dtype=torch.int32, device=counts_N.device)
        with trace_span(
            "moe.count_exchange",
            kind="comm",
            comm_func="allgather",
            group="exp",
            shape=(counts_N.numel() + _HEADER,),
            dtype=torch.int32,
            counts=counts_N,  # this rank's row of C, for the simulator (converted at flush)
        ):
            gathered = self.comm.all_gather_rows(torch.cat([header, counts_N.to(torch.int32)]))
            C_WN, headers_WH, sums = count_matrix_to_host(
                gathered, _HEADER, self.spec.counts_by_column
            )
        fingerprints_W = headers_WH[:, 0]
        if bool((fingerprints_W != fingerprints_W[0]).any()):
            raise ValueError(
                "MoE config fingerprints differ across ranks in the count exchange "
                f"({fingerprints_W.tolist()}); use the same MoEConfig and strategy everywhere"
            )
        versions_W = (headers_WH[:, 1] << _WORD) + headers_WH[:, 2]  # (int64: widened on the host)
        return C_WN, versions_W.tolist(), sums

    def invalidate_replicas(self) -> None:
        """Forget cached replicas (needed only after writing expert weights through ``.data``).
        Call it on every rank."""
        self.replica_cache.invalidate()

    # -- planning ------------------------------------------------------------------------------
    def _shape(self, dtype: torch.dtype) -> LayerShape:
        cfg = self.config
        return LayerShape(
            model_dim=cfg.model_dim,
            hidden_dim=cfg.hidden_dim,
            experts_per_rank=self.experts_per_rank,
            world_size=self.comm.world_size,
            bytes_per_element=torch.finfo(dtype).bits // 8,
            gemms_per_expert=3 if cfg.activation == "swiglu" else 2,
        )

    def _plan(
        self,
        C: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        sums: CountSums | None = None,
    ) -> Plan:
        cfg = self.config
        shape = self._shape(dtype)
        profile = self.profile or default_profile(device.type)
        checked = self.check_plans
        if checked and sums is not None:
            _check_sums(C, sums)
        plan = self.spec.planner(C, shape, profile, cfg, sums=sums)
        if self.plan_hook is not None:
            plan, checked = self.plan_hook(C, plan), True
        if checked and (plan.shares or plan.ranges or plan.kept):
            plan.check_shares(C, self.experts_per_rank, cfg.block_size)
        return plan

    def _plan_step(
        self,
        C: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        sums: CountSums | None = None,
    ) -> tuple[Plan, StepPlan]:
        """The plan and this rank's bookkeeping: host work only, from C alone (any thread).
        ``sums``: C's ``CountSums`` from the device, else summed here in one compiled pass
        that the plan and the bookkeeping share, for a C of at least ``shared_sums_min``
        counts (smaller, or where it cannot run: each sums C itself)."""
        with trace_span("moe.plan", kind="host"):
            E = self.experts_per_rank
            if sums is None and C.numel() >= self.shared_sums_min:
                sums = count_sums(C, E)
            plan = self._plan(C, dtype, device, sums)
            step = build_step_plan(C, plan, self.comm.rank, E, self._distance, sums)
            return plan, step

    def _submit_plan(
        self,
        C: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        sums: CountSums | None = None,
        job: Callable | None = None,
    ) -> Future:
        """Start ``job`` (default ``_plan_step``) on the planning thread (one worker: steps plan
        in order). It runs in a copy of this context, so an active trace recorder records its
        span."""
        if self._planner_thread is None:
            self._planner_thread = ThreadPoolExecutor(1, thread_name_prefix="mixmoe-plan")
        context = contextvars.copy_context()
        job = self._plan_step if job is None else job
        return self._planner_thread.submit(context.run, job, C, dtype, device, sums)

    def _plan_ahead_step(
        self,
        C: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        sums: CountSums | None = None,
    ) -> tuple[Plan, StepPlan, bool, float]:
        """``plan_ahead``'s step: the plan of the step before's counts (made on the planning
        thread while that step ran) fitted to C (``refit.carried_plan``), or, on the first step
        or when the fit is stale, C's own plan; then this rank's bookkeeping, and C's plan
        started on the thread for the next step (kept as it is when it was just made here).
        Whether the plan was fitted comes third, the seconds waited for the planning thread
        fourth. Every rank takes the same branch: each is a function of the same counts. An
        error of the background plan is raised here, on every rank, before any further
        collective."""
        waited = 0.0
        with trace_span("moe.plan", kind="host"):
            E = self.experts_per_rank
            if sums is None and C.numel() >= self.shared_sums_min:
                sums = count_sums(C, E)
            plan, fetch = None, None
            if self._ahead is not None:
                made, before, before_sums = self._ahead
                self._ahead = None  # (a raise below leaves the next step to plan afresh)
                profile = self.profile or default_profile(device.type)
                (ahead, ahead_fetch), waited = _waited(made)
                plan = carried_plan(ahead, before, C, self._shape(dtype), profile,
                                    block_size=self.config.block_size, before_sums=before_sums,
                                    after_sums=sums)  # fmt: skip
                if plan is not None and self.check_plans and (plan.ranges or plan.kept):
                    plan.check_shares(C, E, self.config.block_size)
                same = plan is not None and plan.relay == ahead.relay
                if same and plan.replicas == ahead.replicas:
                    fetch = ahead_fetch  # the fit kept the holders: their route is built
            fitted = plan is not None
            if plan is None:
                plan = self._plan(C, dtype, device, sums)
            step = build_step_plan(C, plan, self.comm.rank, E, self._distance, sums, fetch)
        if fitted:  # C's own plan, for the next step, made while this step runs
            made = self._submit_plan(C, dtype, device, sums, job=self._plan_routed)
        else:  # made already
            made = Future()
            made.set_result((plan, step.fetch))
        self._ahead = (made, C, sums)
        return plan, step, fitted, waited

    def _plan_routed(
        self,
        C: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        sums: CountSums | None = None,
    ) -> tuple[Plan, RelayPlan]:
        """``plan_ahead``'s background job: C's plan and its replicas' route for this rank
        (``RelayPlan.build``), so that a step whose fit keeps the holders does not build it
        again (W = 1024 under nodes: ~1 ms of the step's bookkeeping)."""
        plan = self._plan(C, dtype, device, sums)
        W, E = self.comm.world_size, self.experts_per_rank
        fetch = RelayPlan.build(plan.replicas, self.comm.rank, W, E, self._distance,
                                relay=plan.relay)  # fmt: skip
        return plan, fetch

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
                return all_to_all_start(self.comm, x_RD, out_splits, in_splits, (name, "exp"))
            return all_to_all(self.comm, x_RD, out_splits, in_splits, (name, "exp")), None

    def _fetch(self, weights: ExpertWeights, plan: Plan, step: StepPlan, versions: list[int]):
        """Replica weights for this step (None if nothing is replicated) and whether the fetch
        was served from the cache (``ReplicaCache``: keyed on the replicas, the relay flag and
        the owners' versions)."""
        if not plan.replicas:
            return None, False
        E = self.experts_per_rank
        # the relay flag too: the same replicas fetched by another route are other buffers
        key = (plan.replicas, plan.relay, tuple(versions[g // E] for g, _ in plan.replicas))
        replicas_HQ, hit = self.replica_cache.fetch(
            self.comm, weights, step.fetch, key, self.spec.cache_replicas
        )
        return unpack_experts(replicas_HQ, weights), hit

    # -- the step ------------------------------------------------------------------------------
    def dispatch(
        self,
        x_TD: torch.Tensor,
        routing: Routing,
        weights: ExpertWeights,
        *,
        version: int | None = None,
    ) -> tuple[DispatchedRows, ExpertLayout, StepMeta]:
        """``version``: the owned weights' version the replica cache is keyed on (it travels in
        the count exchange); None: ``weights_version(weights)``, their in-place version counters.
        A caller whose weights are refilled in place without a version change (FSDP2's
        all-gathered parameters) passes one that does change, e.g. the sharded parameters'."""
        E, W, r, N = (
            self.experts_per_rank,
            self.comm.world_size,
            self.comm.rank,
            self.config.num_experts,
        )
        if weights.num_slots != E:
            raise ValueError(
                f"dispatcher expects the {E} experts owned by rank {r}, got {weights.num_slots}"
            )
        if not self._handshake_done:
            self._handshake(x_TD.device)

        # 1. count, exchange counts (the host sync; int32 counts on the wire)
        if routing.ids_TK.numel() >= 1 << 31:
            raise ValueError(
                f"{routing.ids_TK.numel()} routed rows on rank {r} in one call: at most 2**31 - 1 "
                "(the count exchange's int32 counts); split the batch"
            )
        counts_N = expert_counts(routing.ids_TK, N)
        if version is None:
            version = weights_version(weights)
        C, versions, sums = self.exchange_counts(counts_N, version)

        # 2. plan: the same on every rank. Under an async plan, this rank's rows for its own
        # experts are sorted and computed while the plan is made, if the last plan kept them
        # all here (a share plan may send some to helpers: then the plan comes first)
        counts_r = C[r].tolist()
        B = self.config.block_size
        local_done_TD = None
        fitted, waited = False, 0.0  # (waited: seconds this thread waited for the planning one)
        if self.plans_ahead():  # the fit of the step before's plan: short, on this thread
            plan, step, fitted, waited = self._plan_ahead_step(C, x_TD.dtype, x_TD.device, sums)
            own = None
        elif self.plans_async(x_TD.device) and self._owned_rows_stayed:
            planned = self._submit_plan(C, x_TD.dtype, x_TD.device, sums)
            try:
                own = build_own_layout(routing, counts_r, r, E, B)
                if self._compute_own is None:
                    local_done_TD = run_work(own.own, x_TD, weights, self.config.activation)
                else:
                    with trace_span(own.own.span, kind="compute"):
                        local_done_TD = self._compute_own(own.own, x_TD, weights)
            finally:
                # wait even if the own rows failed: no plan is left running behind an error.
                # A planner error is raised here; it is a function of C alone (the planner is
                # deterministic), so every rank raises it before any further collective
                (plan, step), waited = _waited(planned)
        else:
            plan, step = self._plan_step(C, x_TD.dtype, x_TD.device, sums)
            own = None
        self._owned_rows_stayed = step.owned_rows_stay()
        if not self._owned_rows_stayed:
            # the plan sends some own rows to helpers: the share layout builds the own item,
            # and an own output computed ahead (under a now wrong guess) is dropped unused
            own, local_done_TD = None, None
        elif own is None and step.runs is None:  # (a share layout sorts the own rows itself)
            own = build_own_layout(routing, counts_r, r, E, B)
        moving = step.rows_moved > 0

        # 3. replica fetch (the relay rounds of packed weights, or the cache)
        replicas, cached = self._fetch(weights, plan, step, versions)

        # 4. the rest of the layout (one upload); send the rows of experts computed elsewhere.
        # A rank holding no replica still runs the (empty) replica work when any replica exists:
        # the fetch must be in its graph so that its backward joins the gradient all_to_alls
        layout = build_step_layout(
            routing, own, counts_r, step, B, with_replicas=replicas is not None
        )
        recv_RD, pending = self._exchange(
            "moe.dispatch", x_TD[layout.send_token_S], step.out_splits, step.in_splits, moving
        )
        received: list[torch.Tensor] = []

        def receive() -> torch.Tensor:  # the experts call it after their local work
            if not received:
                received.append(recv_RD if pending is None else all_to_all_wait(recv_RD, pending))
            return received[0]

        work = () if local_done_TD is not None else (layout.own,)
        work += ((layout.replica,) if layout.replica else ()) + (layout.received,)
        if layout.received_replica is not None:  # rows this helper computes with its replicas
            work += (layout.received_replica,)
        rows_W = plan.prediction.rows
        stats = {
            "rows_moved": step.rows_moved,
            "replicas": sum(len(h) for _, h in plan.replicas),
            "max_rows": max(rows_W),
            "mean_rows": sum(rows_W) / W,
            "replica_cached": cached,
            "plan_fitted": fitted,  # plan_ahead: the step before's plan, fitted to C
            # helper entries: segments, ranges, experts with kept holders
            "shares": len(plan.shares) + len(plan.ranges) + len(plan.kept),
        }
        # every rank's rows of each expert: summed on the planning thread's pass over C when
        # the bookkeeping ran compiled (W = 1024: C.sum(dim=0) here takes ~3.4 ms)
        global_N = C.sum(dim=0) if step.expert_rows_N is None else step.expert_rows_N
        meta = StepMeta(layout, step, plan, routing.weights_TK, moving, counts_N, stats, global_N,
                        plan_wait_ms=waited * 1e3)  # fmt: skip
        rows = DispatchedRows(x_TD, replicas, receive, local_done_TD)
        return rows, ExpertLayout(work), meta

    def combine(self, out: ExpertOutputs, meta: StepMeta) -> torch.Tensor:
        """Send the received rows' results home and add the weighted returned rows to the local
        output (every rank joins the return all_to_all whenever any row moved anywhere)."""
        step = meta.step
        back_RD, pending = self._exchange(
            "moe.return", out.received_RD, step.in_splits, step.out_splits, meta.moving
        )
        with trace_span("moe.combine", kind="compute"):
            if pending is not None:
                back_RD = all_to_all_wait(back_RD, pending)
            if not meta.moving:
                return out.local_TD
            # also with nothing sent from here: the returned rows must stay in the graph so that
            # this rank joins the backward all_to_alls the other ranks start
            return out.local_TD + combine_rows(back_RD, meta.layout.pos_back_TK, meta.weights_TK)
