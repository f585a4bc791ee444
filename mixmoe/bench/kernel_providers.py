"""The four grouped-GEMM providers of ``mixmoe bench kernels`` and the problem they solve.

Legend: T tokens, K top-k, E experts, R = T * K routed rows, D model dim, F hidden size.

``Problem``: the tensors of one sweep point (fixed seed) and its routing layout in both forms, the
padded block layout (mixmoe) and sorted rows (torch providers). ``forward_fn(provider, ...)``
computes, from token order to token order,

    y_TD[t] = sum_k w[t, k] * (act(x[t] @ W1[e] + b1[e]) @ W2[e] + b2[e]),     e = ids[t, k]

Providers:
    mixmoe         the Triton kernels: gather fused into GEMM 1, GEMM 2 written straight to token
                   order, fixed-order combine (CUDA only; the CPU interpreter is far too slow)
    torch-loop     gather, one matmul per expert per GEMM, gather-combine
    torch-grouped  gather, ``torch.nn.functional.grouped_mm`` per GEMM (+ bias), gather-combine
    dense          one matmul per GEMM over all R rows with one expert's weights: the same FLOPs
                   without routing, the practical ceiling
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mixmoe.dispatch.layout import RowLayout, expert_row_layout
from mixmoe.gating.synthetic import RoutingSpec, synthetic_ids
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.token_expert_mlp import token_expert_mlp
from mixmoe.validation import torch_dtype

__all__ = ["ACTIVATIONS", "PROVIDERS", "Problem", "forward_fn", "leaves", "step_fn", "unavailable"]

PROVIDERS = ("mixmoe", "torch-loop", "torch-grouped", "dense")
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swiglu": F.silu}


class Problem:
    """The tensors of one sweep point (fixed seed), plus the routing layout in both forms: the
    padded block layout (mixmoe) and sorted rows (torch providers)."""

    def __init__(
        self,
        *,
        dtype: str,
        experts: int,
        rows_per_expert: int,
        skew: str,
        top_k: int,
        model_dim: int,
        hidden_size: int,
        activation: str,
        block_size: int,
        device: str,
        seed: int,
    ) -> None:
        device_, dtype_ = torch.device(device), torch_dtype(dtype)
        E, K, D, Fh = experts, top_k, model_dim, hidden_size
        T = max(1, E * rows_per_expert // K)
        ids_TK = synthetic_ids(
            RoutingSpec.parse(skew), T, K, E, torch.Generator().manual_seed(seed)
        )
        gen = torch.Generator(device=device_).manual_seed(seed)
        self.layout: RowLayout = expert_row_layout(ids_TK.to(device_), E, block_size)
        sched = self.layout.schedule
        self.T, self.R, self.E = T, T * K, E
        self.counts = self.layout.counts_host

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=device_) * scale).to(dtype_)

        self.x_TD = rand(T, D)
        self.weights_TK = torch.softmax(torch.randn(T, K, generator=gen, device=device_), -1).to(
            dtype_
        )
        swiglu = activation == "swiglu"
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
            torch.arange(E, device=device_), self.layout.counts_N, output_size=int(valid_P.sum())
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


def forward_fn(provider: str, prob: Problem, activation: str, t: dict) -> Callable:
    """A closure computing the forward of ``provider`` on the leaves in ``t``."""
    act = activation
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


def leaves(provider: str, prob: Problem, dtype: torch.dtype | None = None) -> dict:
    """Fresh leaf tensors (requires_grad) for one provider; dense gets expert 0's weights."""
    if provider == "dense":
        src = {"x": prob.x_dense, **{k: v[0] for k, v in prob.params.items()}}
    else:
        src = {"x": prob.x_TD, "g": prob.weights_TK, **prob.params}
    return {k: v.detach().to(dtype or v.dtype).clone().requires_grad_() for k, v in src.items()}


def unavailable(provider: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``provider`` cannot run here, or None."""
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


def step_fn(fwd: Callable, t: dict, dy: torch.Tensor, mode: str) -> Callable:
    if mode == "fwd":

        def step():
            with torch.no_grad():
                fwd()

        return step
    leaves = list(t.values())

    def step():
        torch.autograd.grad(fwd(), leaves, dy)

    return step
