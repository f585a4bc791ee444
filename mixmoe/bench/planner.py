"""The planner benchmark engine (``mixmoe bench planner``, CLI in ``mixmoe.commands.bench_planner``):
what planning the mixed strategy costs next to the step it plans, for today's planner
(``mixmoe.reference.planner.plan_mix_rescan``) and the restructured one
(``mixmoe.placement.plan_mix``), on the same counts.

Legend: W ranks, N experts, E = N / W experts per rank, T tokens per rank, K top-k.

One case = (routing, W, N): counts_WN drawn once by ``synthetic_counts`` (T tokens per rank, K
distinct experts each, expert popularity shuffled), given to both planners as the int64 tensor
the layer all-gathers. Each planner is timed on one CPU thread (``torch.set_num_threads(1)``):
median of ``repeats`` calls after one untimed call (today's planner: ``old_repeats`` calls, and
skipped above ``old_max_world`` ranks). The predicted steps come from the cost model: mix = the
plan's prediction, a2a = ``plan_none`` (no overlap, as the a2a strategy runs). Target (issue 15):
planner <= max(2% of the predicted mix step, 0.25 ms) for W <= 64, <= 5 ms above.

Beside the plan, what the layer's planning thread does each step (``moe.plan``), as the layer
runs it: C's column and row sums (``CountSums``), reduced on the device on an accelerator, else
one compiled pass here (``sums_ms``, ``native_pricing.count_sums``); the plan given them
(``planner_given_ms``: the same plan, asserted, without its own pass over C); one rank's
``build_step_plan`` of it given them too (``bookkeeping_ms``, rank W // 3). ``host_ms`` is the
thread's span on the CPU (the three), ``host_device_sums_ms`` with the sums from the device (the
last two). Each a median of ``repeats`` calls.

What that span overlaps (``overlap_ms``): each rank computes its rows for its own experts while
its plan is made (``docs/design.md``, step 3), and the dispatch's all_to_all waits for every
rank's plan, so the step pays the span less the shortest such computation, the predicted
forward compute (a third of the step's, ``cost_model``) of the fewest own rows of any rank
(``exposed_ms``, with the device's sums; at least
that: a rank whose own rows the last plan sent to helpers computes none ahead). A rank's own
rows are ~T K / W: at W >= 64 the overlap is a few microseconds and the whole span is exposed.

Under ``MoEConfig.plan_ahead`` the step waits only for the plan of the step before fitted to
its counts (``placement.refit``): ``fit_ms`` times that fit of the case's plan to a fresh draw
of the same popularity (``gating.synthetic.redrawn_counts``), given both steps' sums, and
``fit_over_fresh_step`` is the fitted plan's predicted step over that of a plan made for the
drawn counts. ``ahead_exposed_ms``: what such a step waits for, the fit and the fitted plan's
bookkeeping (its replicas' route built with the plan on the planning thread, as the layer
does, where the fit kept the holders). ``ahead_thread_ms``: the planning thread's job under
``plan_ahead`` (``_plan_routed``: the plan given the sums, its replicas' route), which must end
before the layer's next forward: after the rest of the iteration (the other layers' forwards,
every backward, the optimizer), so a model of L MoE layers of this step hides it where it is
under ~L steps (``ahead_layers``: the fewest such L, from the busy figure). The job holds the
GIL between its compiled calls (the plan's decode, the route's Python), so a main thread busy
in Python delays it: ``ahead_thread_busy_ms`` times it on the thread, from its submission to
its end, while the calling thread issues small torch ops (a stand-in for a step's main thread
launching kernels; each op releases the GIL).

Cold counts (``cold``, the default): before each timed call the counts' cache lines are
flushed (untimed; ``placement.native_cache_lines``), so the call reads C from memory, as the
layer's planning thread reads the counts the device has just copied to the host each step
(``cold_caches``: "lines", or "caches" where every cache was evicted instead). Timed warm
(``cold`` False) every call but the first reads C's hot columns from the cache the call before
filled, faster than the layer would see them.

C is stored by columns (``layout`` "columns", the default), as the mixed strategy's count
exchange brings it to the host (``dispatch.layout``); "rows": row-major, as before 2026-11-27.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from mixmoe.bench.timing import median
from mixmoe.dispatch.replicas import RelayPlan
from mixmoe.dispatch.step_plan import build_step_plan
from mixmoe.gating.synthetic import RoutingSpec, redrawn_counts, synthetic_counts
from mixmoe.placement import (
    CPU_PROFILE,
    GPU_PROFILE,
    HardwareProfile,
    LayerShape,
    Plan,
    native_lib,
    plan_mix,
    plan_none,
)
from mixmoe.placement.cost_model import step_model
from mixmoe.placement.native_cache_lines import CacheEvictor
from mixmoe.placement.native_pricing import count_sums
from mixmoe.placement.planner import SEARCH_WIDTH
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.refit import refit_plan
from mixmoe.placement.relay import node_distance
from mixmoe.reference.planner import plan_mix_rescan
from mixmoe.tracing.heap import frozen_heap
from mixmoe.validation import (
    DTYPE_NAMES,
    check_bool,
    check_choice,
    check_int,
    check_str,
    torch_dtype,
)

__all__ = ["PROFILES", "PlannerBenchConfig", "run_case", "target_ms"]

PROFILES: dict[str, HardwareProfile] = {"gpu": GPU_PROFILE, "cpu": CPU_PROFILE}
LAYOUTS = ("columns", "rows")  # C's storage (module doc)


@dataclass(frozen=True)
class PlannerBenchConfig:
    """cases: (W, N) pairs, N a multiple of W; routings: uniform, zipf:S, hot:P."""

    cases: tuple[tuple[int, int], ...] = ((8, 64), (64, 512), (256, 2048), (1024, 4096))
    routings: tuple[str, ...] = ("uniform", "zipf:1.2", "hot:0.3")
    tokens: int = 8192
    top_k: int = 2
    model_dim: int = 1024
    hidden_size: int = 4096
    dtype: str = "fp16"
    profile: str = "gpu"
    max_replicas: int = 4
    search_width: int = SEARCH_WIDTH
    repeats: int = 21
    old_repeats: int = 3
    old_max_world: int = 1024
    shuffle_experts: bool = True
    seed: int = 0
    cold: bool = True
    layout: str = "columns"
    jsonl: str | None = None

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPE_NAMES)
        check_choice("layout", self.layout, LAYOUTS)
        check_bool("shuffle_experts", self.shuffle_experts)
        check_bool("cold", self.cold)
        check_str("jsonl", self.jsonl, none=True)
        load_profile(self.profile)  # a preset name or a calibrate JSON; clear error otherwise
        for name, value, lo in (
            ("tokens", self.tokens, 0),
            ("top_k", self.top_k, 1),
            ("model_dim", self.model_dim, 1),
            ("hidden_size", self.hidden_size, 1),
            ("max_replicas", self.max_replicas, 0),
            ("search_width", self.search_width, 1),
            ("repeats", self.repeats, 1),
            ("old_repeats", self.old_repeats, 1),
            ("old_max_world", self.old_max_world, 0),
            ("seed", self.seed, 0),
        ):
            check_int(name, value, lo)
        if not self.cases:
            raise ValueError("cases must name at least one WxN pair, e.g. 8x64")
        for W, N in self.cases:
            check_int("world size W", W, 1)
            check_int("experts N", N, 1)
            if N % W:
                raise ValueError(f"case {W}x{N}: N={N} must be a multiple of W={W}")
            if self.top_k > N:
                raise ValueError(f"case {W}x{N}: top_k={self.top_k} exceeds N={N}")
        if not self.routings:
            raise ValueError("routings must name at least one of uniform, zipf:S, hot:P")
        for text in self.routings:
            if RoutingSpec.parse(text).kind == "gate":
                raise ValueError(
                    "routing 'gate' needs a learned gate; use uniform, zipf:S or hot:P"
                )


def target_ms(world_size: int, step_ms: float) -> float:
    """Issue 15's budget for one plan: max(2% of the step, 0.25 ms) up to 64 ranks, else 5 ms."""
    return max(0.02 * step_ms, 0.25) if world_size <= 64 else 5.0


def _time_ms(fn, repeats: int, evictor: CacheEvictor | None = None) -> tuple[float, Plan]:
    with frozen_heap():  # (the process's earlier objects out of the collector's walks)
        plan = fn()  # untimed: first-call effects
        times = []
        for _ in range(repeats):
            if evictor is not None:
                evictor.evict()  # untimed
            start = time.perf_counter()
            plan = fn()
            times.append((time.perf_counter() - start) * 1e3)
    return median(times), plan


def _busy_thread_ms(fn, repeats: int, evictor: CacheEvictor | None = None) -> float:
    """Median ms from submitting ``fn`` to a worker thread to its end while this thread issues
    small torch ops until it is done (module doc: ``ahead_thread_busy_ms``), after one untimed
    call."""
    x = torch.zeros(16)

    def timed() -> float:
        fn()
        return time.perf_counter()

    def busy_ms(worker: ThreadPoolExecutor) -> float:
        start = time.perf_counter()
        job = worker.submit(timed)
        while not job.done():
            x.add_(1.0)
        return (job.result() - start) * 1e3

    times = []
    with ThreadPoolExecutor(1) as worker, frozen_heap():
        busy_ms(worker)  # untimed: first-call effects, the worker started
        for _ in range(repeats):
            if evictor is not None:
                evictor.evict()  # untimed
            times.append(busy_ms(worker))
    return median(times)


def _overlap_ms(counts_WN: torch.Tensor, shape: LayerShape, profile: HardwareProfile) -> float:
    """The predicted forward compute (ms) of the fewest rows any rank routes to its own experts:
    what every rank's planning thread overlaps at most (module doc)."""
    W, E = shape.world_size, shape.experts_per_rank
    own_W = counts_WN.view(W, W, E).diagonal(0, 0, 1).sum(0)  # [s, owner, e] -> s == owner
    model = step_model(shape, profile, True)
    per_row = (model.flops_per_row / model.gemm_flops + model.row_s) / 3  # forward: 1/3
    return int(own_W.min()) * per_row * 1e3


def run_case(
    cfg: PlannerBenchConfig, routing: str, world_size: int, num_experts: int
) -> dict[str, Any]:
    """One record: the case, both planners' times (ms), predicted steps (ms) and ratios."""
    W, N = world_size, num_experts
    spec = RoutingSpec.parse(routing)
    gen = torch.Generator().manual_seed(cfg.seed)
    counts_WN = synthetic_counts(
        spec, W, cfg.tokens, cfg.top_k, N, gen, shuffle_experts=cfg.shuffle_experts
    )
    shape = LayerShape(
        model_dim=cfg.model_dim,
        hidden_dim=cfg.hidden_size,
        experts_per_rank=N // W,
        world_size=W,
        bytes_per_element=torch.finfo(torch_dtype(cfg.dtype)).bits // 8,
    )
    profile = load_profile(cfg.profile)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    after_WN = redrawn_counts(counts_WN, cfg.seed + 1)  # plan_ahead's next step (below)
    if cfg.layout == "columns":  # the same counts, stored as the layer's count exchange stores them
        counts_WN, after_WN = (C.t().contiguous().t() for C in (counts_WN, after_WN))
    storage = [C.t() if cfg.layout == "columns" else C for C in (counts_WN, after_WN)]
    evictor = CacheEvictor(storage) if cfg.cold else None
    try:
        new_ms, new = _time_ms(
            lambda: plan_mix(
                counts_WN, shape, profile, cfg.max_replicas, search_width=cfg.search_width
            ),
            cfg.repeats,
            evictor,
        )
        # the layer's planning thread: C's sums (from the device, or one pass here), the plan
        # given them, and one rank's bookkeeping of it, the relay split by node as the layer's
        sums_ms, sums = _time_ms(lambda: count_sums(counts_WN, N // W), cfg.repeats, evictor)
        given_ms, given = _time_ms(
            lambda: plan_mix(
                counts_WN,
                shape,
                profile,
                cfg.max_replicas,
                search_width=cfg.search_width,
                sums=sums,
            ),
            cfg.repeats,
            evictor,
        )
        if repr(given) != repr(new):
            raise RuntimeError("plan_mix given C's sums planned differently: a planner bug")
        rank, distance = W // 3, node_distance(profile)
        keeping_ms, _ = _time_ms(
            lambda: build_step_plan(counts_WN, new, rank, N // W, distance, sums),
            cfg.repeats,
            evictor,
        )
        # plan_ahead: the plan fitted to the next step's counts (a fresh draw of the same
        # popularity), as the layer runs it, given both steps' sums
        after_sums = count_sums(after_WN, N // W)
        fit_ms, fit = _time_ms(
            lambda: refit_plan(
                new, counts_WN, after_WN, shape, profile, before_sums=sums, after_sums=after_sums
            ),  # fmt: skip
            cfg.repeats,
            evictor,
        )
        # and the fitted plan's bookkeeping, its replicas' route built with the plan (on the
        # planning thread) where the fit kept the holders, as the layer's step does
        route = None
        if (fit.replicas, fit.relay) == (new.replicas, new.relay):
            route = RelayPlan.build(new.replicas, rank, W, N // W, distance, relay=new.relay)
        ahead_keeping_ms, _ = _time_ms(
            lambda: build_step_plan(after_WN, fit, rank, N // W, distance, after_sums, route),
            cfg.repeats,
            evictor,
        )
        fresh = plan_mix(after_WN, shape, profile, cfg.max_replicas, search_width=cfg.search_width)

        def ahead_job() -> Plan:  # plan_ahead's planning thread (module doc)
            plan = plan_mix(counts_WN, shape, profile, cfg.max_replicas,
                            search_width=cfg.search_width, sums=sums)  # fmt: skip
            RelayPlan.build(plan.replicas, rank, W, N // W, distance, relay=plan.relay)
            return plan

        job_ms, _ = _time_ms(ahead_job, cfg.repeats, evictor)
        job_busy_ms = _busy_thread_ms(ahead_job, cfg.repeats, evictor)
        old_ms, old = None, None
        if W <= cfg.old_max_world:
            old_ms, old = _time_ms(
                lambda: plan_mix_rescan(counts_WN, shape, profile, cfg.max_replicas),
                cfg.old_repeats,
                evictor,
            )
    finally:
        torch.set_num_threads(threads)
    a2a_ms = plan_none(counts_WN, shape, profile).prediction.step_s * 1e3
    step_ms = new.prediction.step_s * 1e3
    overlap_ms = _overlap_ms(counts_WN, shape, profile)
    record: dict[str, Any] = {
        "routing": str(spec),
        "world_size": W,
        "num_experts": N,
        "planner_ms": new_ms,
        "step_ms": step_ms,
        "planner_over_step": new_ms / step_ms if step_ms else None,
        "target_ms": target_ms(W, step_ms),
        "meets_target": new_ms <= target_ms(W, step_ms),
        "sums_ms": sums_ms,
        "planner_given_ms": given_ms,
        "meets_target_given": given_ms <= target_ms(W, step_ms),
        "bookkeeping_ms": keeping_ms,
        "host_ms": sums_ms + given_ms + keeping_ms,
        "host_device_sums_ms": given_ms + keeping_ms,
        "fit_ms": fit_ms,
        "fit_over_fresh_step": fit.prediction.step_s / fresh.prediction.step_s,
        "ahead_exposed_ms": fit_ms + ahead_keeping_ms,
        "ahead_thread_ms": job_ms,
        "ahead_thread_busy_ms": job_busy_ms,
        "ahead_layers": max(1, math.ceil(job_busy_ms / step_ms)) if step_ms else None,
        "overlap_ms": overlap_ms,
        "exposed_ms": max(0.0, given_ms + keeping_ms - overlap_ms),
        "a2a_step_ms": a2a_ms,
        "mix_over_a2a": step_ms / a2a_ms if a2a_ms else None,
        "hot": len(new.hot),
        # whether the fill ran compiled (``native_lib``) or in Python: planning time differs ~5x
        "compiled_fill": native_lib.available(),
        "cold_caches": evictor.how if evictor is not None else None,
        "layout": cfg.layout,
        "old_planner_ms": old_ms,
        "old_step_ms": old.prediction.step_s * 1e3 if old else None,
        "old_mix_over_a2a": old.prediction.step_s * 1e3 / a2a_ms if old and a2a_ms else None,
        "old_hot": len(old.hot) if old else None,
    }
    if old is not None and a2a_ms:
        record["quality_gap"] = record["mix_over_a2a"] - record["old_mix_over_a2a"]
    return record
