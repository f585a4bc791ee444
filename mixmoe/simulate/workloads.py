"""The imbalance workload benchmark (``mixmoe bench balance``): how close each strategy's plan
comes to the force-balanced step, by the planners' own cost model.

Legend: W ranks, N experts, E = N / W experts per rank, T tokens per rank, K top-k,
C = counts_WN [W, N] (C[s, g] = rows rank s routes to expert g).

One case = (layer shape, W, workload, strategy). The workload's count matrices come from
``mixmoe.simulate.routing.counts_source`` (``mixmoe.gating.imbalance``; ``rotate`` gives one per
step); for each matrix the strategy's planner runs as the layer runs it
(``mixmoe.dispatch.strategies.planning_spec(...).planner``, the configuration of
``mixmoe.simulate.layer.layer_config``) and the plan's own prediction (``Plan.prediction``, the
cost model's) gives every figure:

- step_ms: the predicted layer step (forward + backward), the mean over the workload's steps;
- balanced_ms: the force-balanced step: ``a2a``'s predicted step under ``uniform`` routing for the
  same shape, W, T, profile and seed;
- pct_balanced: balanced_ms / step_ms (may exceed 1: averages cap every case at 1);
- imbalance: max / mean over ranks of the rows computed per rank after the plan
  (``Prediction.rows``), the mean over steps;
- time_imbalance: max / mean over ranks of each rank's predicted seconds (compute + exposed
  communication, ``Prediction.compute_s`` + ``comm_s``: what the planner balances; on token-bound
  shapes a rank that sends fewer rows may compute more at equal seconds), the mean over steps;
- replica_bytes: bytes sent over the links for replicas in one step, weights in forward and their
  gradients in backward (half the sum over ranks of ``Prediction.weight_bytes``, which counts
  every byte at its sender and its receiver), the mean over steps;
- planning_ms: the median wall-clock time of the planner call on one CPU thread
  (``torch.set_num_threads(1)``; ``repeats`` timed calls per step after one untimed call, the
  step's counts flushed from the caches before each, as the device's copy leaves them:
  ``placement.native_cache_lines``; ``cold`` False: warm, read from the cache the call before
  filled; C stored as the strategy's count exchange stores it: by columns for ``mix`` and
  ``mix-ahead``, row-major for ``a2a`` and ``shadow``, ``dispatch.strategies``);
- pct_with_planning: balanced_ms / (step_ms + planning_ms): the layer waits for its plan
  (its background thread overlaps only each rank's own rows, ~1/W of them: ``mixmoe bench
  planner``'s "exposed ms"), so the step a user sees carries the planning time of this host's
  CPU;
- hot_steps: the replicated experts of every step (``rotate``: the plan follows the hot set).

Every planner re-runs on every step's counts (no plan is carried over); the replica cache
(which replicas a rotating hot set can reuse) is the layer's business and not priced here.

``ahead`` adds the strategy ``mix-ahead``: ``mix`` planned a step ahead, as the layer does under
``MoEConfig.plan_ahead``: each step's plan is ``plan_mix``'s plan of the step before, fitted to
the step's counts (``placement.refit.carried_plan``), or the step's own plan where that fit is
stale (planning_ms: one pass summing the step's counts, the fit, and the plan where it ran;
the plan of the step before is made while that step runs, and its counts' sums come with it,
as the layer keeps them). The step
before step 0 (every step of a one-step workload) is a fresh draw of the same popularity: each
source's rows drawn again, multinomially, from its row of step 0 (seeded by ``seed``); a
rotating hotspot's later steps follow the real step before, whose hot set has moved.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mixmoe.dispatch.strategies import planning_spec, strategy_spec
from mixmoe.gating.imbalance import Workload, check_workload
from mixmoe.gating.synthetic import redrawn_counts
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.native_cache_lines import CacheEvictor
from mixmoe.placement.native_pricing import count_sums
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.refit import carried_plan
from mixmoe.simulate.layer import layer_config
from mixmoe.simulate.routing import counts_source
from mixmoe.tracing.heap import frozen_heap
from mixmoe.validation import check_int

__all__ = [
    "DEFAULT_WORKLOADS",
    "SHAPES",
    "BalanceConfig",
    "ShapeSpec",
    "balanced_step_s",
    "case_records",
    "first_step_mix",
    "layer_shape",
    "profile_name",
    "shape_spec",
    "summarize",
]


@dataclass(frozen=True)
class ShapeSpec:
    """A layer shape independent of W: D, F, top-k, wire dtype bytes, GEMMs per expert (3:
    SwiGLU) and either ``experts_per_rank`` (N grows with W) or ``experts`` (N fixed, a
    multiple of W)."""

    name: str
    model_dim: int
    hidden_dim: int
    top_k: int
    dtype: str
    gemms_per_expert: int = 2
    experts_per_rank: int | None = None
    experts: int | None = None

    def describe(self) -> str:
        experts = (
            f"{self.experts_per_rank} experts/rank"
            if self.experts is None
            else f"{self.experts} experts"
        )
        swiglu = ", SwiGLU" if self.gemms_per_expert == 3 else ""
        return (
            f"{self.name}: D{self.model_dim} F{self.hidden_dim}, {experts}, top-{self.top_k}, "
            f"{self.dtype}{swiglu}"
        )


SHAPES: dict[str, ShapeSpec] = {
    "seeds": ShapeSpec("seeds", 1024, 4096, top_k=2, dtype="fp16", experts_per_rank=4),
    "deepseek": ShapeSpec(
        "deepseek", 2048, 1024, top_k=8, dtype="bf16", gemms_per_expert=3, experts=256
    ),
}
DEFAULT_WORKLOADS = (
    "uniform",
    "zipf:1.2",
    "zipf:2.0",
    "hot:0.2",
    "hot:0.5",
    "hotset:8:0.5",
    "hotrank:0.5",
    "idle:0.25",
    "rotate:8:0.5",
)


@dataclass(frozen=True)
class BalanceConfig:
    """What ``mixmoe bench balance`` runs. ``profile`` None: ``h100-nvlink`` at W <= 8 (one NVLink
    node), ``h100-ib`` above (``profile_name``); else a preset name or a calibrate JSON for every
    W."""

    shapes: tuple[str | ShapeSpec, ...] = ("seeds", "deepseek")
    worlds: tuple[int, ...] = (8, 64, 256)
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    strategies: tuple[str, ...] = ("a2a", "shadow", "mix")
    tokens: int = 8192
    max_replicas: int = 4
    repeats: int = 5
    seed: int = 0
    profile: str | None = None
    ahead: bool = False
    cold: bool = True

    def __post_init__(self) -> None:
        for name, value, lo in (
            ("tokens", self.tokens, 1),
            ("max_replicas", self.max_replicas, 0),
            ("repeats", self.repeats, 1),
            ("seed", self.seed, 0),
        ):
            check_int(name, value, lo)
        for field, values in (
            ("shapes", self.shapes),
            ("worlds", self.worlds),
            ("workloads", self.workloads),
            ("strategies", self.strategies),
        ):
            if not values:
                raise ValueError(f"{field} is empty; name at least one")
        for text in self.workloads:  # understood at all (its own error), before the fits below
            Workload.parse(text)
        for W in self.worlds:
            check_int("world size", W, 2)
            for shape in self.shapes:
                spec = shape_spec(shape)
                ls = layer_shape(spec, W)  # N a multiple of W, clear error otherwise
                for text in self.workloads:  # every case's workload fits its experts
                    try:
                        check_workload(text, W, spec.top_k, ls.num_experts)
                    except ValueError as exc:
                        raise ValueError(f"shape {spec.name!r} at W={W}: {exc}") from None
        for name in self.strategies:
            strategy_spec(name)
        for name, flag in (("ahead", self.ahead), ("cold", self.cold)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if self.profile is not None:
            load_profile(self.profile)


def profile_name(cfg: BalanceConfig, world_size: int) -> str:
    """The profile of ``world_size`` ranks: ``cfg.profile``, else ``h100-nvlink`` for one 8-GPU
    node (W <= 8) and ``h100-ib`` across nodes."""
    if cfg.profile is not None:
        return cfg.profile
    return "h100-nvlink" if world_size <= 8 else "h100-ib"


def shape_spec(shape: str | ShapeSpec) -> ShapeSpec:
    """A ``ShapeSpec`` as is, or the one of ``SHAPES`` named ``shape``."""
    if isinstance(shape, ShapeSpec):
        return shape
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is unknown; use one of {', '.join(SHAPES)}")
    return SHAPES[shape]


def layer_shape(spec: ShapeSpec, world_size: int) -> LayerShape:
    """``spec`` on ``world_size`` ranks; ``ValueError`` when a fixed N is not a multiple of W."""
    if spec.experts is not None:
        if spec.experts % world_size:
            raise ValueError(
                f"shape {spec.name!r} has {spec.experts} experts, not a multiple of W="
                f"{world_size}; use a W that divides {spec.experts}"
            )
        E = spec.experts // world_size
    else:
        E = spec.experts_per_rank or 1
    return LayerShape(
        model_dim=spec.model_dim,
        hidden_dim=spec.hidden_dim,
        experts_per_rank=E,
        world_size=world_size,
        bytes_per_element=4 if spec.dtype == "fp32" else 2,
        gemms_per_expert=spec.gemms_per_expert,
    )


def _storage(C_WN: torch.Tensor) -> torch.Tensor:
    """C's storage as a contiguous tensor: C itself, or C.t() where C is stored by columns."""
    return C_WN if C_WN.is_contiguous() else C_WN.t()


def _timed_plans(
    planner, counts_WN: torch.Tensor, repeats: int, evictor: CacheEvictor | None = None
) -> tuple[Any, list[float]]:
    """The plan and ``repeats`` wall-clock times (ms) of ``planner(counts_WN)`` on one thread,
    ``evictor.evict()`` before each (untimed; None: warm), the heap the process held before
    frozen out of the collector (``tracing.heap``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with frozen_heap():
            plan = planner(counts_WN)  # untimed: first-call effects
            times = []
            for _ in range(repeats):
                if evictor is not None:
                    evictor.evict()
                start = time.perf_counter()
                plan = planner(counts_WN)
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return plan, times


def _planner(name: str, shape: LayerShape, profile: HardwareProfile, cfg: BalanceConfig, K: int):
    spec = planning_spec(name, shape.world_size)
    config = layer_config(shape, top_k=K, max_replicas=cfg.max_replicas)
    return lambda C_WN, sums=None: spec.planner(C_WN, shape, profile, config, sums=sums)


def _step_planners(
    name: str, shape: LayerShape, profile: HardwareProfile, cfg: BalanceConfig, K: int, steps
) -> list[tuple[Any, list[torch.Tensor]]]:
    """The planner of each step, with the counts it reads besides the step's own: the
    strategy's (none); for ``mix-ahead`` the fit of ``mix``'s plan of the step before (module
    doc) to the step's counts (the step before's)."""
    if name != "mix-ahead":
        return [(_planner(name, shape, profile, cfg, K), [])] * len(steps)
    mix = _planner("mix", shape, profile, cfg, K)
    first = redrawn_counts(steps[0], cfg.seed)
    if not steps[0].is_contiguous():  # stored by columns, as the steps' own counts
        first = first.t().contiguous().t()
    before = [first, *steps[:-1]]
    E = shape.experts_per_rank
    return [
        (
            functools.partial(
                _carried,
                mix(B_WN),
                B_WN,
                mix=mix,
                shape=shape,
                profile=profile,
                before_sums=count_sums(B_WN, E),
            ),
            [B_WN],
        )
        for B_WN in before
    ]


def _carried(plan, before_WN, after_WN, *, mix, shape, profile, before_sums):
    """The layer's plan_ahead step: the fit, or the step's own plan where it is stale. The
    step before's sums come with its plan (the layer keeps them); the step's own are summed
    once, here (the layer's one pass on the CPU, as ``mix``'s planner sums C itself), and serve
    the fit and a fresh plan alike."""
    after_sums = count_sums(after_WN, shape.experts_per_rank)
    fitted = carried_plan(plan, before_WN, after_WN, shape, profile, before_sums=before_sums,
                          after_sums=after_sums)  # fmt: skip
    return mix(after_WN, sums=after_sums) if fitted is None else fitted


@functools.lru_cache(maxsize=32)
def balanced_step_s(cfg: BalanceConfig, shape: str | ShapeSpec, world_size: int) -> float:
    """The force-balanced step (s): ``a2a``'s predicted step under ``uniform`` routing, for the
    shape, W, T, seed and profile (``profile_name``) of ``cfg`` (cached: every workload of a
    (shape, W) divides by it)."""
    spec = shape_spec(shape)
    layer = layer_shape(spec, world_size)
    profile = load_profile(profile_name(cfg, world_size))
    (C_WN,) = counts_source(
        "uniform", world_size, layer.num_experts, cfg.tokens, spec.top_k, seed=cfg.seed
    )
    return _planner("a2a", layer, profile, cfg, spec.top_k)(C_WN).prediction.step_s


def first_step_mix(
    cfg: BalanceConfig, shape: str | ShapeSpec, world_size: int, workload: str
) -> tuple[LayerShape, HardwareProfile, torch.Tensor, Callable[[HardwareProfile], Any]]:
    """A case's layer, profile (``profile_name``), first step's counts and ``mix``'s planner of
    them under a profile given per call (``plan(profile) -> Plan``): what the what-if scripts
    (``scripts/rows_tradeoff.py``, ``scripts/transit_route.py``) plan, as the layer would."""
    spec = shape_spec(shape)
    layer = layer_shape(spec, world_size)
    C_WN = counts_source(workload, world_size, layer.num_experts, cfg.tokens, spec.top_k,
                         seed=cfg.seed)[0]  # fmt: skip
    mix = planning_spec("mix", world_size).planner
    config = layer_config(layer, top_k=spec.top_k, max_replicas=cfg.max_replicas)
    profile = load_profile(profile_name(cfg, world_size))
    return layer, profile, C_WN, lambda prof: mix(C_WN, layer, prof, config)


def case_records(
    cfg: BalanceConfig, shape_name: str | ShapeSpec, world_size: int, workload: str
) -> list[dict[str, Any]]:
    """One record per strategy of ``cfg`` for one (shape, W, workload) (module doc)."""
    spec = shape_spec(shape_name)
    shape = layer_shape(spec, world_size)
    pname = profile_name(cfg, world_size)
    profile = load_profile(pname)
    balanced = balanced_step_s(cfg, shape_name, world_size)
    steps = counts_source(
        workload, world_size, shape.num_experts, cfg.tokens, spec.top_k, seed=cfg.seed
    )
    records = []
    strategies = [*cfg.strategies, *(["mix-ahead"] if cfg.ahead else [])]
    by_column = [C.t().contiguous().t() for C in steps]  # the same counts (module doc)
    for name in strategies:
        stored = by_column if strategy_spec(name.removesuffix("-ahead")).counts_by_column else steps
        planners = _step_planners(name, shape, profile, cfg, spec.top_k, stored)
        step_s, imbalance, seconds, moved, copies, hot, times = [], [], [], [], [], [], []
        for (planner, reads), C_WN in zip(planners, stored, strict=True):
            # the storage of each count matrix read, flushed line by line
            evictor = CacheEvictor([_storage(C) for C in (C_WN, *reads)]) if cfg.cold else None
            plan, ms = _timed_plans(planner, C_WN, cfg.repeats, evictor)
            rows_W = plan.prediction.rows
            step_s.append(plan.prediction.step_s)
            imbalance.append(max(rows_W) * len(rows_W) / sum(rows_W))  # max / mean
            total_W = list(map(float.__add__, plan.prediction.compute_s, plan.prediction.comm_s))
            seconds.append(max(total_W) * len(total_W) / sum(total_W))  # max / mean
            moved.append(sum(plan.prediction.weight_bytes) // 2)  # each byte sent once
            copies.append(sum(len(h) for _, h in plan.replicas))
            hot.append(list(plan.hot))
            times.append(ms)
        mean_step = sum(step_s) / len(step_s)
        planning_ms = statistics.median(t for ms in times for t in ms)
        records.append(
            {
                "shape": spec.name,
                "world_size": world_size,
                "num_experts": shape.num_experts,
                "experts_per_rank": shape.experts_per_rank,
                "top_k": spec.top_k,
                "profile": pname,
                "workload": workload,
                "strategy": name,
                "steps": len(steps),
                "step_ms": 1e3 * mean_step,
                "step_ms_per_step": [1e3 * s for s in step_s],
                "balanced_ms": 1e3 * balanced,
                "pct_balanced": balanced / mean_step,
                "imbalance": sum(imbalance) / len(imbalance),
                "time_imbalance": sum(seconds) / len(seconds),
                "replica_bytes": sum(moved) / len(moved),
                "replicas": sum(copies) / len(copies),
                "planning_ms": planning_ms,
                "cold_caches": evictor.how if evictor is not None else None,
                "pct_with_planning": balanced / (mean_step + planning_ms / 1e3),
                "hot_steps": hot,
            }
        )
    return records


def _capped(records: Iterable[Mapping[str, Any]], key: str = "pct_balanced") -> list[float]:
    return [min(1.0, r[key]) for r in records]


def summarize(records: list[Mapping[str, Any]], rel_tol: float = 1e-9) -> dict[str, Any]:
    """Per strategy: cases, the average and worst % of force-balanced (each case capped at 1),
    the worst case, the worst imbalance (rows, and seconds) and the slowest planning, and the
    same average and worst with the planning time on the step; and the cases (shape, W,
    workload) where ``mix`` is predicted slower (by more than ``rel_tol``) than ``a2a`` or
    ``shadow``, with both steps in ms."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        by.setdefault(r["strategy"], []).append(r)
    out: dict[str, Any] = {"strategies": {}}
    for name, rs in by.items():
        capped = _capped(rs)
        worst = min(range(len(rs)), key=capped.__getitem__)
        out["strategies"][name] = {
            "cases": len(rs),
            "mean_pct_balanced": sum(capped) / len(capped),
            "worst_pct_balanced": capped[worst],
            "worst_case": _case(rs[worst]),
            "max_imbalance": max(r["imbalance"] for r in rs),
            "max_time_imbalance": max(r.get("time_imbalance", 0.0) for r in rs),
            "max_planning_ms": max(r["planning_ms"] for r in rs),
        }
        if all("pct_with_planning" in r for r in rs):  # (records of older runs lack it)
            timed = _capped(rs, "pct_with_planning")
            slow = min(range(len(rs)), key=timed.__getitem__)
            out["strategies"][name].update(
                mean_pct_with_planning=sum(timed) / len(timed),
                worst_pct_with_planning=timed[slow],
                worst_case_with_planning=_case(rs[slow]),
            )
    step = {(_case(r), r["strategy"]): r["step_ms"] for r in records}
    slower = []
    for r in by.get("mix", []):
        for other in ("a2a", "shadow"):
            theirs = step.get((_case(r), other))
            if theirs is not None and r["step_ms"] > theirs * (1 + rel_tol):
                slower.append({"case": _case(r), "than": other, "mix_ms": r["step_ms"],
                               "other_ms": theirs})  # fmt: skip
    out["mix_slower"] = slower
    return out


def _case(r: Mapping[str, Any]) -> str:
    return f"{r['shape']} W={r['world_size']} {r['workload']}"
