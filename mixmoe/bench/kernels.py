"""The kernel benchmark engine (``mixmoe bench kernels``, CLI in ``mixmoe.commands.bench_kernels``):
the expert MLP of one MoE layer on four grouped-GEMM providers (``mixmoe.bench.kernel_providers``).

Legend: T tokens, K top-k, E experts, R = T * K routed rows, D model dim, F hidden size.

One sweep point: T = E * rows_per_expert / K tokens, each routed to K distinct experts with the
chosen skew (``uniform``, ``zipf:S``, ``hot:P``; mean rows per expert = ``rows_per_expert``); the
routing layout (sort, counts) is computed once, untimed.

FLOPs: 2 GEMMs (3 with swiglu) x 2 * R * D * F; forward + backward = 3x forward. Before any
timing every provider's forward is checked against an fp32 torch-loop (dense: an fp32 dense).
Times: median of ``repeats`` runs after ``warmup`` (CUDA events on GPU, perf_counter on CPU).
``run_point`` returns one record per (mode, provider) with the times or why it was skipped.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mixmoe.bench.kernel_providers import (
    ACTIVATIONS,
    PROVIDERS,
    Problem,
    forward_fn,
    leaves,
    step_fn,
    unavailable,
)
from mixmoe.bench.timing import median, time_repeated
from mixmoe.gating.synthetic import RoutingSpec
from mixmoe.validation import (
    DTYPE_NAMES,
    check_block_size,
    check_choice,
    check_device,
    check_int,
    torch_dtype,
)

__all__ = ["CPU_DEFAULTS", "GPU_DEFAULTS", "MODES", "KernelBenchConfig", "Point", "run_point"]

MODES = ("fwd", "fwd+bwd")
# (rows per expert, experts, skews, dtypes, model dim, hidden size, warmup, repeats)
GPU_DEFAULTS = (
    (64, 256, 1024, 4096, 8192),
    (4, 16, 64),
    ("uniform", "zipf:1.2", "hot:0.5"),
    ("bf16",),
    1024,
    4096,
    5,
    20,
)
CPU_DEFAULTS = ((64, 256), (4, 8), ("uniform", "zipf:1.2", "hot:0.5"), ("fp32",), 128, 256, 2, 5)


@dataclass(frozen=True)
class KernelBenchConfig:
    rows_per_expert: tuple[int, ...]
    experts: tuple[int, ...]
    skews: tuple[str, ...]
    dtypes: tuple[str, ...]
    model_dim: int
    hidden_size: int
    top_k: int = 2
    activation: str = "gelu"
    block_size: int = 64
    modes: tuple[str, ...] = MODES
    providers: tuple[str, ...] = PROVIDERS
    device: str = "cpu"
    warmup: int = 2
    repeats: int = 5
    seed: int = 0
    jsonl: str | None = None

    def __post_init__(self) -> None:
        for name, values, known in (
            ("provider", self.providers, PROVIDERS),
            ("mode", self.modes, MODES),
            ("dtype", self.dtypes, DTYPE_NAMES),
        ):
            for v in values:
                check_choice(name, v, known)
        check_device(self.device)
        for s in self.skews:
            if RoutingSpec.parse(s).kind == "gate":
                raise ValueError("skew 'gate' needs a learned gate; use uniform, zipf:S or hot:P")
        check_choice("activation", self.activation, ACTIVATIONS)
        check_block_size(self.block_size)
        for name, values in (("rows_per_expert", self.rows_per_expert), ("experts", self.experts)):
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be positive integers, got {values}")
        if min(self.experts) < self.top_k:
            raise ValueError(
                f"every experts value must be >= top_k={self.top_k}, got {self.experts}"
            )
        for name, value, lo in (
            ("model_dim", self.model_dim, 1),
            ("hidden_size", self.hidden_size, 1),
            ("top_k", self.top_k, 1),
            ("warmup", self.warmup, 0),
            ("repeats", self.repeats, 1),
        ):
            check_int(name, value, lo)


@dataclass(frozen=True)
class Point:
    dtype: str
    experts: int
    rows_per_expert: int
    skew: str


def _flops(cfg: KernelBenchConfig, rows: int, mode: str) -> float:
    gemms = 3 if cfg.activation == "swiglu" else 2
    return gemms * 2.0 * rows * cfg.model_dim * cfg.hidden_size * (3 if mode == "fwd+bwd" else 1)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 3e-2


def run_point(cfg: KernelBenchConfig, point: Point) -> list[dict[str, Any]]:
    """Check, then time, every provider at one sweep point in every mode; one record per
    (mode, provider)."""
    prob = Problem(
        **asdict(point),
        top_k=cfg.top_k,
        model_dim=cfg.model_dim,
        hidden_size=cfg.hidden_size,
        activation=cfg.activation,
        block_size=cfg.block_size,
        device=cfg.device,
        seed=cfg.seed,
    )
    base = {
        **asdict(point),
        "tokens": prob.T,
        "rows": prob.R,
        "max_rows_per_expert": max(prob.counts),
        "empty_experts": prob.counts.count(0),
    }
    with torch.no_grad():
        truth = {  # fp32 oracles, computed once per point
            "routed": forward_fn(
                "torch-loop", prob, cfg.activation, leaves("torch-loop", prob, torch.float32)
            )(),
            "dense": forward_fn(
                "dense", prob, cfg.activation, leaves("dense", prob, torch.float32)
            )(),
        }
    records = []
    for mode, provider in itertools.product(cfg.modes, cfg.providers):
        records.append(_run_provider(cfg, prob, mode, provider, {**base, "mode": mode}, truth))
    return records


def _run_provider(
    cfg: KernelBenchConfig,
    prob: Problem,
    mode: str,
    provider: str,
    base: dict[str, Any],
    truth: dict[str, torch.Tensor],
) -> dict[str, Any]:
    device, dtype = torch.device(cfg.device), torch_dtype(base["dtype"])
    rec: dict[str, Any] = {**base, "provider": provider}
    why = unavailable(provider, device, dtype)
    if why:
        return {**rec, "skipped": why}
    try:
        t = leaves(provider, prob)
        fwd = forward_fn(provider, prob, cfg.activation, t)
        with torch.no_grad():
            y = fwd().float()
        ref = truth["dense" if provider == "dense" else "routed"]
        err = (y - ref).abs().max().item() if y.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 1.0
        rec["max_abs_err"] = err
        if not err <= _tolerance(dtype) * max(scale, 1.0):
            return {**rec, "correct": False}
        rec["correct"] = True
        dy = prob.dy_dense if provider == "dense" else prob.dy_TD
        times = time_repeated(step_fn(fwd, t, dy, mode), device, cfg.warmup, cfg.repeats)
        ms = median(times)
        rec.update(ms=ms, tflops=_flops(cfg, prob.R, mode) / (ms * 1e-3) / 1e12, times_ms=times)
    except torch.cuda.OutOfMemoryError:
        rec["skipped"] = "out of memory"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec
