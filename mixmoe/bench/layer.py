"""``mixmoe bench layer``: time one MoE layer per strategy on identical inputs.

Writes, per strategy, the FORMATS.md section 1 log (system name ``mixmoe-<strategy>``) to stdout,
a progress bar to stderr, then one comparison table of medians and a JSONL record per strategy
(config, environment, per-step times).

Every step is forward + backward + optimizer step (SGD), so anything a strategy caches across
steps (replicas) is paid for as in training. Warm-up steps are printed but excluded from every
statistic. With several ranks, a step's time is the maximum over ranks (synchronised).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixmoe.bench import log_format
from mixmoe.bench.environment import environment
from mixmoe.bench.routing import RoutingSpec, SyntheticGate, synthetic_ids
from mixmoe.bench.timing import StageTimer, median
from mixmoe.config import MoEConfig
from mixmoe.layers.moe import MoE

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is unknown; use one of {sorted(DTYPES)}")
        RoutingSpec.parse(self.routing)
        for name, value in (("steps", self.steps), ("tokens", self.tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.world_size > 1 and "local" in self.strategies:
            raise ValueError(
                "strategy 'local' runs on one rank; use a2a, shadow or mix with --world-size > 1"
            )
        if self.world_size == 1 and set(self.strategies) != {"local"}:
            raise ValueError(
                f"strategies {list(self.strategies)} need --world-size > 1; use 'local' on one rank"
            )

    def moe_config(self, strategy: str) -> MoEConfig:
        return MoEConfig(
            model_dim=self.model_dim,
            hidden_dim=self.hidden_size,
            num_experts=self.num_local_experts * self.world_size,
            top_k=self.top_k,
            strategy=strategy,
        )


@dataclass
class StrategyResult:
    strategy: str
    step_ms: list[float] = field(default_factory=list)
    fwd_ms: list[float] = field(default_factory=list)
    bwd_ms: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


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
    cfg: LayerBenchConfig, strategy: str, ids_TK: torch.Tensor | None, comm=None
) -> torch.nn.Module:
    """The layer for one strategy; every strategy gets identical parameters (same seed)."""
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    moe_cfg = cfg.moe_config(strategy)
    torch.manual_seed(cfg.seed)
    gate = (
        SyntheticGate(moe_cfg, ids_TK, device=device, dtype=dtype) if ids_TK is not None else None
    )
    layer = MoE(moe_cfg, gate=gate, device=device, dtype=dtype)
    if comm is not None and comm.world_size > 1:
        from mixmoe.parallel import parallelize_moe

        layer = parallelize_moe(layer, comm, strategy)
    return layer


def _inputs(
    cfg: LayerBenchConfig, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
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


def run_rank(cfg: LayerBenchConfig, comm=None) -> list[StrategyResult]:
    """Run the interleaved benchmark on this rank; all ranks return the synchronised results."""
    rank = 0 if comm is None else comm.rank
    x_TD, dy_TD, ids_TK = _inputs(cfg, rank)
    layers = {s: build_layer(cfg, s, ids_TK, comm) for s in cfg.strategies}
    opts = {s: torch.optim.SGD(layer.parameters(), lr=cfg.lr) for s, layer in layers.items()}
    results = {s: StrategyResult(s) for s in cfg.strategies}
    with torch.no_grad():
        _check_agreement({s: layer(x_TD)[0] for s, layer in layers.items()}, DTYPES[cfg.dtype])
    total = cfg.warmup + cfg.steps
    progress = _Progress(total * len(layers), "bench layer") if rank == 0 else None
    for _ in range(total):
        for s, layer in layers.items():
            if comm is not None:
                comm.barrier()
            timer = StageTimer(torch.device(cfg.device))
            timer.mark()
            y_TD, aux = layer(x_TD)
            timer.mark()
            torch.autograd.backward([y_TD, aux.loss], [dy_TD, torch.ones_like(aux.loss)])
            timer.mark()
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
    return list(results.values())


def _steady_mean(values: list[float], warmup: int) -> float:
    steady = values[warmup:]
    return sum(steady) / len(steady)


def write_logs(cfg: LayerBenchConfig, results: list[StrategyResult], out=None) -> None:
    out = out or sys.stdout
    for r in results:
        print(
            log_format.header_line(
                world_size=cfg.world_size,
                dtype=str(DTYPES[cfg.dtype]).replace("torch.", ""),
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
            tf = log_format.nominal_tflops(
                cfg.tokens, cfg.model_dim, cfg.hidden_size, cfg.top_k, st
            )
            print(log_format.step_line(i, st, fw, bw, tf), file=out)
        step, fwd, bwd = (_steady_mean(v, cfg.warmup) for v in (r.step_ms, r.fwd_ms, r.bwd_ms))
        print(
            log_format.summary_line(
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
    m = slice(cfg.warmup, None)
    base = next((r for r in results if r.strategy == "a2a"), results[0])
    base_ms = median(base.step_ms[m])
    rows = []
    for r in results:
        step = median(r.step_ms[m])
        rows.append(
            {
                "strategy": r.strategy,
                "step_ms": step,
                "fwd_ms": median(r.fwd_ms[m]),
                "bwd_ms": median(r.bwd_ms[m]),
                "tflops": log_format.nominal_tflops(
                    cfg.tokens, cfg.model_dim, cfg.hidden_size, cfg.top_k, step
                ),
                f"vs_{base.strategy}": step / base_ms,
                **r.stats,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    for row in rows[1:]:
        keys += [k for k in row if k not in keys]

    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    table = [keys] + [[cell(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_jsonl(cfg: LayerBenchConfig, results: list[StrategyResult], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    env = environment(torch.device(cfg.device))
    with open(path, "a") as f:
        for r in results:
            f.write(
                json.dumps(
                    {
                        "kind": "bench_layer",
                        "config": asdict(cfg),
                        "environment": env,
                        "strategy": r.strategy,
                        "warmup": cfg.warmup,
                        "step_ms": r.step_ms,
                        "fwd_ms": r.fwd_ms,
                        "bwd_ms": r.bwd_ms,
                        "stats": r.stats,
                    }
                )
                + "\n"
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LayerBenchConfig()
    p.add_argument("--model-dim", type=int, default=d.model_dim)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank (samples)")
    p.add_argument("--num-local-experts", type=int, default=d.num_local_experts)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPES))
    p.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N")
    p.add_argument("--steps", type=int, default=d.steps, help="measured steps")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (not measured)")
    p.add_argument("--routing", default=d.routing, help="gate | uniform | zipf:S | hot:P")
    p.add_argument(
        "--strategy",
        default=None,
        help="comma list of local, a2a, shadow, mix (default: local, or mix,a2a,shadow with >1 rank)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks; on CPU spawns gloo processes (default: torchrun's WORLD_SIZE or 1)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: leave as is)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--jsonl", default="runs/bench-layer.jsonl", help="append JSONL records here ('' for none)"
    )


def config_from_args(args: argparse.Namespace) -> LayerBenchConfig:
    import os

    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    default = "local" if world == 1 else "mix,a2a,shadow"
    strategies = tuple(s.strip() for s in (args.strategy or default).split(",") if s.strip())
    return LayerBenchConfig(
        model_dim=args.model_dim,
        hidden_size=args.hidden_size,
        tokens=args.tokens,
        num_local_experts=args.num_local_experts,
        top_k=args.top_k,
        dtype=args.dtype,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        routing=args.routing,
        strategies=strategies,
        world_size=world,
        threads=args.threads,
        seed=args.seed,
        jsonl=args.jsonl or None,
    )


def report(cfg: LayerBenchConfig, results: list[StrategyResult]) -> None:
    write_logs(cfg, results)
    print(f"routing = {cfg.routing}; medians over {cfg.steps} steps after {cfg.warmup} warm-up")
    print(format_table(summary_rows(cfg, results)))
    if cfg.jsonl:
        write_jsonl(cfg, results, cfg.jsonl)
        print(f"JSONL appended to {cfg.jsonl}")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.world_size > 1:
        from mixmoe.bench.multiprocess import run_distributed

        return run_distributed(cfg, report)
    report(cfg, run_rank(cfg))
    return 0
