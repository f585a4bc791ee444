"""``mixmoe bench kernels``: the expert MLP of one MoE layer on four grouped-GEMM providers.

Legend: T tokens, K top-k, E experts, R = T * K routed rows, D model dim, F hidden size.

One sweep point: T = E * rows_per_expert / K tokens, each routed to K distinct experts with the
chosen skew (``uniform``, ``zipf:S``, ``hot:P``; mean rows per expert = ``rows_per_expert``), and

    y_TD[t] = sum_k w[t, k] * (act(x[t] @ W1[e] + b1[e]) @ W2[e] + b2[e]),     e = ids[t, k]

from token order to token order; the routing layout (sort, counts) is computed once, untimed.

Providers:
    mixmoe         the Triton kernels: gather fused into GEMM 1, GEMM 2 written straight to token
                   order, fixed-order combine (CUDA only; the CPU interpreter is far too slow)
    torch-loop     gather, one matmul per expert per GEMM, gather-combine
    torch-grouped  gather, ``torch.nn.functional.grouped_mm`` per GEMM (+ bias), gather-combine
    dense          one matmul per GEMM over all R rows with one expert's weights: the same FLOPs
                   without routing, the practical ceiling

FLOPs: 2 GEMMs (3 with swiglu) x 2 * R * D * F; forward + backward = 3x forward. Before any
timing every provider's forward is checked against an fp32 torch-loop (dense: an fp32 dense).
Times: median of ``--repeats`` runs after ``--warmup`` (CUDA events on GPU, perf_counter on CPU).
Output: a table of ms and TFLOP/s, and with ``--jsonl PATH`` one record per (point, provider)
with the configuration and the environment.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mixmoe.bench.environment import environment
from mixmoe.bench.routing import RoutingSpec, synthetic_ids
from mixmoe.bench.timing import StageTimer, median
from mixmoe.dispatch.layout import RowLayout, expert_row_layout
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.token_expert_mlp import token_expert_mlp

PROVIDERS = ("mixmoe", "torch-loop", "torch-grouped", "dense")
MODES = ("fwd", "fwd+bwd")
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swiglu": F.silu}
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
            ("dtype", self.dtypes, DTYPES),
        ):
            for v in values:
                if v not in known:
                    raise ValueError(f"{name} {v!r} is unknown; use one of {sorted(known)}")
        for s in self.skews:
            if RoutingSpec.parse(s).kind == "gate":
                raise ValueError("skew 'gate' needs a learned gate; use uniform, zipf:S or hot:P")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.activation!r} is unknown; use one of {sorted(ACTIVATIONS)}"
            )
        if self.block_size not in (16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 16, 32, 64, 128; got {self.block_size}")
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
            if value < lo:
                raise ValueError(f"{name} must be >= {lo}, got {value}")


@dataclass(frozen=True)
class Point:
    dtype: str
    experts: int
    rows_per_expert: int
    skew: str


class Problem:
    """The tensors of one sweep point (fixed seed), plus the routing layout in both forms: the
    padded block layout (mixmoe) and sorted rows (torch providers)."""

    def __init__(self, cfg: KernelBenchConfig, point: Point) -> None:
        device, dtype = torch.device(cfg.device), DTYPES[point.dtype]
        E, K, D, Fh = point.experts, cfg.top_k, cfg.model_dim, cfg.hidden_size
        T = max(1, E * point.rows_per_expert // K)
        ids_TK = synthetic_ids(
            RoutingSpec.parse(point.skew), T, K, E, torch.Generator().manual_seed(cfg.seed)
        )
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        self.layout: RowLayout = expert_row_layout(ids_TK.to(device), E, cfg.block_size)
        sched = self.layout.schedule
        self.T, self.R, self.E = T, T * K, E
        self.counts = self.layout.counts_host

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        self.x_TD = rand(T, D)
        self.weights_TK = torch.softmax(torch.randn(T, K, generator=gen, device=device), -1).to(
            dtype
        )
        swiglu = cfg.activation == "swiglu"
        self.params = {
            "w1": rand(E, D, Fh, scale=D**-0.5),
            "b1": rand(E, Fh, scale=0.1),
            "w2": rand(E, Fh, D, scale=Fh**-0.5),
            "b2": rand(E, D, scale=0.1),
        }
        if swiglu:
            self.params.update(w3=rand(E, D, Fh, scale=D**-0.5), b3=rand(E, Fh, scale=0.1))
        self.dy_TD = rand(T, D)
        self.x_dense = rand(self.R, D)
        self.dy_dense = rand(self.R, D)
        # sorted rows: the valid padded rows in order
        src_P, P = sched.src_P, sched.num_padded_rows
        valid_P = src_P >= 0
        self.token_R = self.layout.token_P[valid_P]
        pos = self.layout.pos_TK
        self.row_of_choice_TK = torch.where(pos < P, src_P[pos.clamp(max=max(P - 1, 0))], self.R)
        self.expert_R = torch.repeat_interleave(
            torch.arange(E, device=device), self.layout.counts_N, output_size=int(valid_P.sum())
        )
        self.offs_E = torch.cumsum(self.layout.counts_N, 0).to(torch.int32)


# ---------------------------------------------------------------- providers


def _mlp(x, gemm, p, act):
    h = ACTIVATIONS[act](gemm(x, p["w1"], p["b1"]))
    if act == "swiglu":
        h = h * gemm(x, p["w3"], p["b3"])
    return gemm(h, p["w2"], p["b2"])


def _token_mlp_torch(prob: Problem, p: dict, x_TD, weights_TK, act, gemm):
    out_R = _mlp(x_TD[prob.token_R], gemm, p, act)
    rows = F.pad(out_R, (0, 0, 0, 1))[prob.row_of_choice_TK]
    return (rows * weights_TK.unsqueeze(-1).to(rows.dtype)).sum(dim=1)


def _loop_gemm(counts: list[int]) -> Callable:
    def gemm(a, w, b):
        outs, start = [], 0
        for e, c in enumerate(counts):
            outs.append(torch.addmm(b[e], a[start : start + c], w[e]))
            start += c
        return torch.cat(outs)

    return gemm


def _grouped_gemm(prob: Problem) -> Callable:
    def gemm(a, w, b):
        return F.grouped_mm(a, w, offs=prob.offs_E) + b[prob.expert_R]

    return gemm


def _forward_fn(provider: str, prob: Problem, cfg: KernelBenchConfig, t: dict) -> Callable:
    """A closure computing the forward of ``provider`` on the leaves in ``t``."""
    act = cfg.activation
    if provider == "mixmoe":
        lay = prob.layout

        def fwd():
            ew = ExpertWeights(t["w1"], t["w2"], t["b1"], t["b2"], t.get("w3"), t.get("b3"))
            return token_expert_mlp(
                t["x"], lay.token_P, lay.pos_TK, t["g"], ew, lay.schedule, act, fused=True
            )

        return fwd
    if provider in ("torch-loop", "torch-grouped"):
        gemm = _loop_gemm(prob.counts) if provider == "torch-loop" else _grouped_gemm(prob)
        return lambda: _token_mlp_torch(prob, t, t["x"], t["g"], act, gemm)
    assert provider == "dense"
    return lambda: _mlp(t["x"], lambda a, w, b: torch.addmm(b, a, w), t, act)


def _leaves(provider: str, prob: Problem, dtype: torch.dtype | None = None) -> dict:
    """Fresh leaf tensors (requires_grad) for one provider; dense gets expert 0's weights."""
    if provider == "dense":
        src = {"x": prob.x_dense, **{k: v[0] for k, v in prob.params.items()}}
    else:
        src = {"x": prob.x_TD, "g": prob.weights_TK, **prob.params}
    return {k: v.detach().to(dtype or v.dtype).clone().requires_grad_() for k, v in src.items()}


def _unavailable(
    provider: str, cfg: KernelBenchConfig, prob: Problem, dtype: torch.dtype
) -> str | None:
    """Why ``provider`` cannot run here, or None."""
    device = torch.device(cfg.device)
    if provider == "mixmoe":
        if device.type != "cuda":
            return (
                "the Triton kernels need a CUDA device (the CPU interpreter checks correctness "
                "in tests but is far too slow to time)"
            )
        try:
            import mixmoe.kernels  # noqa: F401
        except ImportError as exc:
            return str(exc)
    if provider == "torch-grouped":
        if not hasattr(F, "grouped_mm"):
            return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
        try:
            a = torch.zeros(16, 16, device=device, dtype=dtype)
            F.grouped_mm(
                a,
                torch.zeros(2, 16, 16, device=device, dtype=dtype),
                offs=torch.tensor([8, 16], device=device, dtype=torch.int32),
            )
        except (RuntimeError, NotImplementedError) as exc:
            return f"grouped_mm does not run here ({device}, {dtype}): {str(exc).splitlines()[0]}"
    return None


def _step_fn(fwd: Callable, t: dict, dy: torch.Tensor, mode: str) -> Callable:
    if mode == "fwd":

        def step():
            with torch.no_grad():
                fwd()

        return step
    leaves = list(t.values())

    def step():
        torch.autograd.grad(fwd(), leaves, dy)

    return step


def _time_ms(step: Callable, device: torch.device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        timer = StageTimer(device)
        timer.mark()
        step()
        timer.mark()
        times.append(timer.elapsed_ms()[0])
    return times


def _flops(cfg: KernelBenchConfig, rows: int, mode: str) -> float:
    gemms = 3 if cfg.activation == "swiglu" else 2
    return gemms * 2.0 * rows * cfg.model_dim * cfg.hidden_size * (3 if mode == "fwd+bwd" else 1)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 3e-2


def run_point(cfg: KernelBenchConfig, point: Point) -> list[dict[str, Any]]:
    """Check, then time, every provider at one sweep point in every mode; one record per
    (mode, provider)."""
    prob = Problem(cfg, point)
    base = {
        **asdict(point),
        "tokens": prob.T,
        "rows": prob.R,
        "max_rows_per_expert": max(prob.counts),
        "empty_experts": prob.counts.count(0),
    }
    with torch.no_grad():
        truth = {  # fp32 oracles, computed once per point
            "routed": _forward_fn(
                "torch-loop", prob, cfg, _leaves("torch-loop", prob, torch.float32)
            )(),
            "dense": _forward_fn("dense", prob, cfg, _leaves("dense", prob, torch.float32))(),
        }
    records = []
    for mode, provider in itertools.product(cfg.modes, cfg.providers):
        records.append(_run_provider(cfg, prob, mode, provider, {**base, "mode": mode}, truth))
    return records


def _run_provider(cfg, prob, mode, provider, base, truth) -> dict[str, Any]:
    device, dtype = torch.device(cfg.device), DTYPES[base["dtype"]]
    rec: dict[str, Any] = {**base, "provider": provider}
    why = _unavailable(provider, cfg, prob, dtype)
    if why:
        return {**rec, "skipped": why}
    try:
        t = _leaves(provider, prob)
        fwd = _forward_fn(provider, prob, cfg, t)
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
        times = _time_ms(_step_fn(fwd, t, dy, mode), device, cfg.warmup, cfg.repeats)
        ms = median(times)
        rec.update(ms=ms, tflops=_flops(cfg, prob.R, mode) / (ms * 1e-3) / 1e12, times_ms=times)
    except torch.cuda.OutOfMemoryError:
        rec["skipped"] = "out of memory"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


# ---------------------------------------------------------------- CLI


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _words(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--providers",
        type=_words,
        default=PROVIDERS,
        help=f"comma list of {', '.join(PROVIDERS)} (default: all)",
    )
    p.add_argument(
        "--rows-per-expert",
        type=_ints,
        default=None,
        help="comma list, mean routed rows per expert (default GPU: 64..8192; CPU: 64,256)",
    )
    p.add_argument(
        "--experts", type=_ints, default=None, help="comma list (default GPU: 4,16,64; CPU: 4,8)"
    )
    p.add_argument(
        "--skew",
        type=_words,
        default=None,
        help="comma list of uniform, zipf:S, hot:P (default: uniform,zipf:1.2,hot:0.5)",
    )
    p.add_argument(
        "--dtype",
        type=_words,
        default=None,
        help="comma list of bf16, fp16, fp32 (default GPU: bf16; CPU: fp32)",
    )
    p.add_argument("--model-dim", type=int, default=None, help="D (default GPU: 1024; CPU: 128)")
    p.add_argument("--hidden-size", type=int, default=None, help="F (default GPU: 4096; CPU: 256)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--activation", default="gelu", choices=sorted(ACTIVATIONS))
    p.add_argument("--block-size", type=int, default=64, help="rows per block of the schedule")
    p.add_argument(
        "--mode", type=_words, default=MODES, help="comma list of fwd, fwd+bwd (default: both)"
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed runs per provider (default GPU 5, CPU 2)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed runs per provider (default GPU 20, CPU 5)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--jsonl", default=None, help="append one JSON record per (point, provider) here"
    )


def config_from_args(args: argparse.Namespace) -> KernelBenchConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows, experts, skews, dtypes, D, Fh, warmup, repeats = (
        GPU_DEFAULTS if torch.device(device).type == "cuda" else CPU_DEFAULTS
    )
    return KernelBenchConfig(
        rows_per_expert=args.rows_per_expert or rows,
        experts=args.experts or experts,
        skews=args.skew or skews,
        dtypes=args.dtype or dtypes,
        model_dim=args.model_dim or D,
        hidden_size=args.hidden_size or Fh,
        top_k=args.top_k,
        activation=args.activation,
        block_size=args.block_size,
        modes=args.mode,
        providers=args.providers,
        device=device,
        warmup=warmup if args.warmup is None else args.warmup,
        repeats=repeats if args.repeats is None else args.repeats,
        seed=args.seed,
        jsonl=args.jsonl,
    )


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per timed or failed (point, mode, provider); skipped providers are listed apart."""

    def key(r):
        return (r["mode"], r["dtype"], r["experts"], r["rows_per_expert"], r["skew"])

    dense_ms = {key(r): r["ms"] for r in records if r["provider"] == "dense" and "ms" in r}
    rows = []
    for r in records:
        if "skipped" in r:
            continue
        ms = r.get("ms")
        rows.append(
            {
                "mode": r["mode"],
                "dtype": r["dtype"],
                "E": r["experts"],
                "rows/E": r["rows_per_expert"],
                "skew": r["skew"],
                "max rows/E": r["max_rows_per_expert"],
                "provider": r["provider"],
                "ms": ms if ms is not None else "-",
                "TFLOP/s": r["tflops"] if ms is not None else "-",
                "% of dense": 100 * dense_ms[key(r)] / ms if ms and key(r) in dense_ms else "-",
                "check": "ok" if r.get("correct") else f"WRONG (err {r['max_abs_err']:.2g})",
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Right-aligned columns, floats with 3 decimals, a rule under the header."""
    keys = list(rows[0])
    cells = [keys] + [
        [f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_jsonl(cfg: KernelBenchConfig, records: list[dict[str, Any]], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    env = environment(torch.device(cfg.device))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    with open(path, "a") as f:
        for r in records:
            f.write(
                json.dumps(
                    {"kind": "bench_kernels", "config": asdict(cfg), "environment": env, **r}
                )
                + "\n"
            )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    points = [
        Point(d, e, r, s)
        for d, e, r, s in itertools.product(cfg.dtypes, cfg.experts, cfg.rows_per_expert, cfg.skews)
    ]
    print(
        f"bench kernels on {cfg.device}: D={cfg.model_dim} F={cfg.hidden_size} top-{cfg.top_k} "
        f"{cfg.activation}, block {cfg.block_size}; {len(points)} points x {len(cfg.providers)} "
        f"providers; median of {cfg.repeats} after {cfg.warmup} warm-up",
        file=sys.stderr,
    )
    records = []
    for i, point in enumerate(points):
        print(f"\r  point {i + 1}/{len(points)}", end="", file=sys.stderr, flush=True)
        records.extend(run_point(cfg, point))
    print(file=sys.stderr)
    records.sort(key=lambda r: cfg.modes.index(r["mode"]))  # stable: one table block per mode
    reasons = {r["provider"]: r["skipped"] for r in records if "skipped" in r}
    for provider, why in reasons.items():
        print(f"{provider} skipped: {why}")
    rows = table_rows(records)
    print(format_table(rows) if rows else "nothing was timed")
    if cfg.jsonl:
        write_jsonl(cfg, records, cfg.jsonl)
        print(f"JSONL appended to {cfg.jsonl}")
    wrong = [r for r in records if r.get("correct") is False]
    for r in wrong:
        point = Point(r["dtype"], r["experts"], r["rows_per_expert"], r["skew"])
        print(
            f"WRONG: {r['provider']} ({r['mode']}) at {point}: max abs error "
            f"{r['max_abs_err']:.3g}",
            file=sys.stderr,
        )
    return 1 if wrong else 0
