"""The layer benchmark engine (``mixmoe bench layer``, CLI in ``mixmoe.commands.bench_layer``):
time one MoE layer per strategy on identical inputs.

``run_rank`` times the strategies on this rank (``mixmoe.bench.multiprocess`` runs it on several);
``write_logs`` prints the docs/formats.md section 1 log per strategy (system name
``mixmoe-<strategy>``), ``summary_rows`` the comparison of medians, ``jsonl_records`` one record
per strategy (per-step times; ``mixmoe.formats.results.append_jsonl`` adds config and environment).

Every step is forward + backward + optimizer step (SGD), so anything a strategy caches across
steps (replicas) is paid for as in training. Warm-up steps are printed but excluded from every
statistic. With several ranks, a step's time is the maximum over ranks (synchronised).

``trace`` (a directory): every rank records its timed steps with a ``TraceRecorder`` and writes
``trace_rank{R}.txt`` there (CMD lines, docs/formats.md section 3): per step and strategy the ops
``forward_step``, ``backward_step``, ``optimizer_step`` (``batch_id`` the step, ``mg_state``
warmup / steady, ``description`` ``strategy=S``) with the layer's spans inside, the count
exchange carrying this rank's per-expert counts (``mixmoe simulate --routing trace:DIR``).
Recording costs a few microseconds per span inside the timed steps.

``balanced`` (expert-parallel runs): one more layer, ``a2a`` under UNIFORM routing on the same
inputs (``BALANCED``, logged as ``mixmoe-a2a-uniform``), timed in the same loop, interleaved with
the strategies: the force-balanced bound of this run. ``summary_rows`` then gives every strategy's
``pct_balanced`` = median balanced step / median step (1.0: as fast as perfectly balanced
routing without replication). Not part of the correctness check (other routing, other output),
not traced (``trace`` holds the strategies' steps only).
"""

from __future__ import annotations

import functools
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from mixmoe.bench.timing import StageTimer, median
from mixmoe.comm import Communicator
from mixmoe.config import STRATEGIES, MoEConfig
from mixmoe.formats import layer_log
from mixmoe.gating.synthetic import RoutingSpec, SyntheticGate, synthetic_ids
from mixmoe.layers.moe import MoE
from mixmoe.placement.profile_io import load_profile
from mixmoe.validation import (
    check_bool,
    check_choice,
    check_device,
    check_dtype,
    check_float,
    check_int,
    check_str,
    torch_dtype,
)


@dataclass(frozen=True)
class LayerBenchConfig:
    model_dim: int = 256
    hidden_size: int = 1024
    tokens: int = 2048
    num_local_experts: int = 4
    top_k: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    steps: int = 20
    warmup: int = 5
    routing: str = "gate"
    strategies: tuple[str, ...] = ("local",)
    world_size: int = 1
    threads: int = 0
    seed: int = 0
    lr: float = 1e-3
    jsonl: str | None = None
    profile: str = ""  # preset name or calibrate JSON for the planners ('' = the device default)
    plan_async: bool | None = None  # MoEConfig.plan_async (mix; None: background on CUDA only)
    plan_ahead: bool = False  # MoEConfig.plan_ahead (mix: fit the step before's plan)
    trace: str = ""  # a directory: per-rank CMD traces of the timed steps ('' = no tracing)
    balanced: bool = False  # also time a2a under uniform routing: the balanced bound (W > 1)

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_device(self.device)
        RoutingSpec.parse(self.routing)
        for name, value, lo in (
            ("steps", self.steps, 1),
            ("tokens", self.tokens, 1),
            ("warmup", self.warmup, 0),
            ("world_size", self.world_size, 1),
            ("threads", self.threads, 0),
            ("seed", self.seed, 0),
        ):
            check_int(name, value, lo)
        check_float("lr", self.lr)
        check_bool("balanced", self.balanced)
        check_str("profile", self.profile)
        check_str("trace", self.trace)
        check_str("jsonl", self.jsonl, none=True)
        if not self.strategies:
            raise ValueError(f"no strategy given; use one or more of {', '.join(STRATEGIES)}")
        for strategy in self.strategies:
            check_choice("strategy", strategy, STRATEGIES)
        if self.world_size > 1 and "local" in self.strategies:
            raise ValueError(
                "strategy 'local' runs on one rank; use a2a, shadow or mix with --world-size > 1"
            )
        if self.balanced and self.world_size == 1:
            raise ValueError(
                "the balanced bound (a2a under uniform routing) needs --world-size > 1; drop "
                "--balanced on one rank"
            )
        if self.world_size == 1 and set(self.strategies) != {"local"}:
            raise ValueError(
                f"strategies {list(self.strategies)} need --world-size > 1; use 'local' on one rank"
            )
        self.moe_config(self.strategies[0])  # the layer's own checks (top_k <= experts, ...)
        if self.profile:
            load_profile(self.profile)  # fails early: unknown preset, missing file

    def moe_config(self, strategy: str) -> MoEConfig:
        return MoEConfig(
            model_dim=self.model_dim,
            hidden_dim=self.hidden_size,
            num_experts=self.num_local_experts * self.world_size,
            top_k=self.top_k,
            strategy=strategy,
            plan_async=self.plan_async,
            plan_ahead=self.plan_ahead,
        )


BALANCED = "a2a-uniform"  # the label of the balanced-bound run (``LayerBenchConfig.balanced``)


@dataclass
class StrategyResult:
    strategy: str
    step_ms: list[float] = field(default_factory=list)
    fwd_ms: list[float] = field(default_factory=list)
    bwd_ms: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    # rows each rank routed to each expert in the first forward ([W][N]; the same for every
    # strategy: identical inputs and gate), for ``--save-counts`` and the simulator
    counts_WN: list[list[int]] | None = None


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0

    def step(self) -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def build_layer(
    cfg: LayerBenchConfig,
    strategy: str,
    ids_TK: torch.Tensor | None,
    comm: Communicator | None = None,
) -> torch.nn.Module:
    """The layer for one strategy; every strategy gets identical parameters (same seed)."""
    device, dtype = torch.device(cfg.device), torch_dtype(cfg.dtype)
    moe_cfg = cfg.moe_config(strategy)
    torch.manual_seed(cfg.seed)
    gate = (
        SyntheticGate(moe_cfg, ids_TK, device=device, dtype=dtype) if ids_TK is not None else None
    )
    layer = MoE(moe_cfg, gate=gate, device=device, dtype=dtype)
    if comm is not None and comm.world_size > 1:
        from mixmoe.parallel import parallelize_moe

        profile = load_profile(cfg.profile) if cfg.profile else None
        layer = parallelize_moe(layer, comm, strategy, profile=profile)
    return layer


def _inputs(
    cfg: LayerBenchConfig, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    device, dtype = torch.device(cfg.device), torch_dtype(cfg.dtype)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    x_TD = torch.randn(cfg.tokens, cfg.model_dim, generator=gen).to(device, dtype)
    dy_TD = torch.randn(cfg.tokens, cfg.model_dim, generator=gen).to(device, dtype)
    spec = RoutingSpec.parse(cfg.routing)
    ids_TK = None
    if spec.kind != "gate":
        ids_TK = synthetic_ids(
            spec, cfg.tokens, cfg.top_k, cfg.num_local_experts * cfg.world_size, gen
        )
    return x_TD, dy_TD, ids_TK


def _check_agreement(outputs: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Correctness before timing: every strategy must produce the same first forward."""
    names = list(outputs)
    tol = {torch.float32: (1e-4, 1e-4)}.get(dtype, (2e-2, 2e-2))
    for name in names[1:]:
        torch.testing.assert_close(
            outputs[name],
            outputs[names[0]],
            rtol=tol[0],
            atol=tol[1],
            msg=lambda m, n=name: f"strategy {n} disagrees with {names[0]}: {m}",
        )


def _traced_op(
    recorder, step: int, state: str, strategy: str, name: str
) -> AbstractContextManager[None]:
    """``recorder.op`` of one stage of a timed step (nothing without a recorder)."""
    if recorder is None:
        return nullcontext()
    return recorder.op(name, batch_id=step, mg_state=state, description=f"strategy={strategy}")


def run_rank(cfg: LayerBenchConfig, comm: Communicator | None = None) -> list[StrategyResult]:
    """Run the interleaved benchmark on this rank; all ranks return the synchronised results."""
    rank = 0 if comm is None else comm.rank
    x_TD, dy_TD, ids_TK = _inputs(cfg, rank)
    layers = {s: build_layer(cfg, s, ids_TK, comm) for s in cfg.strategies}
    if cfg.balanced:  # a2a on uniform ids of its own: the force-balanced bound, timed alike
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 500_000)
        N = cfg.num_local_experts * cfg.world_size
        uniform_TK = synthetic_ids(RoutingSpec("uniform"), cfg.tokens, cfg.top_k, N, gen)
        layers[BALANCED] = build_layer(cfg, "a2a", uniform_TK, comm)
    opts = {s: torch.optim.SGD(layer.parameters(), lr=cfg.lr) for s, layer in layers.items()}
    results = {s: StrategyResult(s) for s in layers}
    with torch.no_grad():
        first = {s: layer(x_TD) for s, layer in layers.items()}
        same = {s: y for s, (y, _) in first.items() if s != BALANCED}  # same routing, same y
        _check_agreement(same, torch_dtype(cfg.dtype))
    counts_N = next(iter(first.values()))[1].counts_N.to(torch.int64)
    if comm is not None and comm.world_size > 1:
        counts_WN = comm.all_gather_rows(counts_N).cpu().tolist()
    else:
        counts_WN = [counts_N.cpu().tolist()]
    del first
    total = cfg.warmup + cfg.steps
    progress = _Progress(total * len(layers), "bench layer") if rank == 0 else None
    recorder = None
    if cfg.trace:
        from mixmoe.tracing import TraceRecorder

        recorder = TraceRecorder(rank=rank, stage_id=0, device=cfg.device)
    for i in range(total):
        for s, layer in layers.items():
            if comm is not None:
                comm.barrier()
            # the balanced run is not traced: traces (and the counts they carry) are the
            # strategies' own, as without it
            op = functools.partial(
                _traced_op,
                None if s == BALANCED else recorder,
                i,
                "warmup" if i < cfg.warmup else "steady",
                s,
            )
            timer = StageTimer(torch.device(cfg.device))
            timer.mark()
            with op("forward_step"):
                y_TD, aux = layer(x_TD)
            timer.mark()
            with op("backward_step"):
                torch.autograd.backward([y_TD, aux.loss], [dy_TD, torch.ones_like(aux.loss)])
            timer.mark()
            with op("optimizer_step"):
                opts[s].step()
                opts[s].zero_grad(set_to_none=True)
            timer.mark()
            fwd, bwd, opt = timer.elapsed_ms()
            r = results[s]
            r.fwd_ms.append(fwd)
            r.bwd_ms.append(bwd)
            r.step_ms.append(fwd + bwd + opt)
            if aux.stats is not None:
                r.stats = dict(aux.stats)
            if progress:
                progress.step()
    if comm is not None and comm.world_size > 1:
        for r in results.values():
            times = torch.tensor([r.step_ms, r.fwd_ms, r.bwd_ms], dtype=torch.float64)
            times = comm.all_reduce_max(times)
            r.step_ms, r.fwd_ms, r.bwd_ms = (row.tolist() for row in times)
    for r in results.values():
        r.counts_WN = counts_WN
    if recorder is not None:
        out = Path(cfg.trace)
        out.mkdir(parents=True, exist_ok=True)
        recorder.write_cmd(out / f"trace_rank{rank}.txt")
    return list(results.values())


def _steady_mean(values: list[float], warmup: int) -> float:
    steady = values[warmup:]
    return sum(steady) / len(steady)


def write_logs(
    cfg: LayerBenchConfig, results: list[StrategyResult], out: TextIO | None = None
) -> None:
    """The docs/formats.md section 1 log of every strategy (header, steps, summary) to ``out``."""
    out = out or sys.stdout
    for r in results:
        print(
            layer_log.header_line(
                world_size=cfg.world_size,
                dtype=str(torch_dtype(cfg.dtype)).replace("torch.", ""),
                model_dim=cfg.model_dim,
                hidden_size=cfg.hidden_size,
                samples=cfg.tokens,
                num_local_experts=cfg.num_local_experts,
                top_k=cfg.top_k,
                device=cfg.device,
            ),
            file=out,
        )
        for i, (st, fw, bw) in enumerate(zip(r.step_ms, r.fwd_ms, r.bwd_ms, strict=True)):
            tf = layer_log.nominal_tflops(cfg.tokens, cfg.model_dim, cfg.hidden_size, cfg.top_k, st)
            print(layer_log.step_line(i, st, fw, bw, tf), file=out)
        step, fwd, bwd = (_steady_mean(v, cfg.warmup) for v in (r.step_ms, r.fwd_ms, r.bwd_ms))
        print(
            layer_log.summary_line(
                f"mixmoe-{r.strategy}",
                cfg.num_local_experts,
                round(step, 3),
                round(fwd, 3),
                round(bwd, 3),
            ),
            file=out,
        )
        print(file=out)


def summary_rows(cfg: LayerBenchConfig, results: list[StrategyResult]) -> list[dict[str, Any]]:
    """One row of medians per result; with a balanced run (``BALANCED``), every row's
    ``pct_balanced`` = the balanced run's median step / this row's."""
    m = slice(cfg.warmup, None)
    base = next((r for r in results if r.strategy == "a2a"), results[0])
    base_ms = median(base.step_ms[m])
    balanced = next((r for r in results if r.strategy == BALANCED), None)
    rows = []
    for r in results:
        step = median(r.step_ms[m])
        extra = {} if balanced is None else {"pct_balanced": median(balanced.step_ms[m]) / step}
        rows.append(
            {
                "strategy": r.strategy,
                "step_ms": step,
                "fwd_ms": median(r.fwd_ms[m]),
                "bwd_ms": median(r.bwd_ms[m]),
                "tflops": layer_log.nominal_tflops(
                    cfg.tokens, cfg.model_dim, cfg.hidden_size, cfg.top_k, step
                ),
                f"vs_{base.strategy}": step / base_ms,
                **extra,
                **r.stats,
            }
        )
    return rows


def jsonl_records(cfg: LayerBenchConfig, results: list[StrategyResult]) -> list[dict[str, Any]]:
    """One record per strategy: per-step times (warm-up included, ``warmup`` says how many)."""
    return [
        {
            "strategy": r.strategy,
            "warmup": cfg.warmup,
            "step_ms": r.step_ms,
            "fwd_ms": r.fwd_ms,
            "bwd_ms": r.bwd_ms,
            "stats": r.stats,
        }
        for r in results
    ]
