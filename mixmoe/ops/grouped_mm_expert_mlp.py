"""``token_expert_mlp`` on torch's grouped GEMM when the blocks are sorted by slot.

Legend: T tokens, K top-k, D model dim, F hidden dim, P padded rows, S weight slots, Nb blocks,
B block size.

When every slot's blocks are contiguous and in slot order (``BlockSchedule.slot_ends``: the
one-device layout and every expert-parallel work item), the padded layout is exactly what ``torch._grouped_mm`` takes: one group
per slot, group ``s`` = padded rows ``[slot_ends[s-1], slot_ends[s])``, weights ``w[s]``. On a
Hopper GPU that is CUTLASS's grouped GEMM (about twice the rate of mixmoe's Triton GEMM measured
on an H100, scripts/gpu/NOTES.md). The rows around it are mixmoe's: ``x_TD`` gathered once by
``token_P``, the K choices combined in a fixed order, the backward written out by hand (no
autograd through an index, whose scatter-add backward was the slow part of the torch-grouped
provider):

    forward   x_PD = x_TD[token_P];  a = x_PD @ w1 (+ b1) per group;  h = act(a) [* (x_PD @ w3)]
              out_PD = h @ w2 (+ b2);  y_TD[t] = sum_k weights_TK[t, k] * out_PD[pos_TK[t, k]]
    backward  g_PD = weight(p) * dy_TD[token(p)] (0 on padding rows);  dW2 = h^T g, dh = g w2^T
              da (du) = act'(...);  dW1 = x_PD^T da, dx_PD = da w1^T (+ du w3^T)
              dx_TD[t] = sum_k dx_PD[pos_TK[t, k]];  db = per-slot sums of g (da, du)

Padding rows sit inside their slot's group: their gradient rows are zero (``torch.where``, so no
NaN from a padding row can reach a weight gradient), so they add nothing to dW or db. Slots
without rows get zero gradients. Every reduction runs in a fixed order (deterministic).

The op is numerically the same function as the fused ops (tests compare forward and every
gradient with the reference composition, on CPU where ``torch._grouped_mm`` also runs float32);
``token_expert_mlp`` takes it on CUDA for bf16 inputs on compute capability >= 9.0 unless
``MIXMOE_GROUPED_MM=0``, and never inside ``torch.compile`` (see ``grouped_mm_path_applies``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from mixmoe.ops.expert_mlp import (
    ACTIVATIONS,
    ExpertWeights,
    activate,
    activate_backward,
    expert_params,
    function_inputs,
    gate_up_fits,
)
from mixmoe.schedule.blocks import BlockSchedule

GROUPED_MM_ENV = "MIXMOE_GROUPED_MM"


def grouped_mm_enabled() -> bool:
    """``MIXMOE_GROUPED_MM=0`` turns the grouped-GEMM path off (the Triton kernels run instead)."""
    value = os.environ.get(GROUPED_MM_ENV, "1").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{GROUPED_MM_ENV}={value!r} is not understood; set it to 1 or 0")


def grouped_mm_path_applies(
    x_TD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights: ExpertWeights,
    schedule: BlockSchedule,
    activation: str,
) -> bool:
    """True when ``token_expert_mlp`` runs ``grouped_mm_token_expert_mlp`` by default: a
    slot-sorted layout, CUDA bf16 tensors of one dtype on a GPU of compute capability >= 9.0
    (CUTLASS's grouped GEMM), feature sizes the GEMM accepts, at least one row."""
    if x_TD.device.type != "cuda" or x_TD.dtype != torch.bfloat16:
        return False  # fp16 and fp32 keep the Triton kernels: only bf16 was checked on a GPU
    if not hasattr(torch, "_grouped_mm") or not grouped_mm_enabled():
        return False
    if torch.compiler.is_compiling():
        # measured on an H100 (torch 2.11): under torch.compile this function's dx came out wrong
        # (96% of elements off); compiled graphs keep the Triton custom ops, which compile right
        return False
    if torch.cuda.get_device_capability(x_TD.device) < (9, 0):
        return False
    return layout_fits(x_TD, pos_TK, weights, schedule, activation)


def layout_fits(
    x_TD: torch.Tensor,
    pos_TK: torch.Tensor,
    weights: ExpertWeights,
    schedule: BlockSchedule,
    activation: str,
) -> bool:
    """The device-independent part of ``grouped_mm_path_applies``."""
    D, Fh = weights.w2_SFD.shape[2], weights.w2_SFD.shape[1]
    return (
        schedule.slot_ends is not None
        and len(schedule.slot_ends) == weights.num_slots
        and schedule.num_padded_rows > 0
        and x_TD.shape[0] > 0
        and activation in ACTIVATIONS
        and gate_up_fits(weights, activation)
        and D % 8 == 0
        and Fh % 8 == 0  # 16-byte strides for 16-bit operands
        and all(p.device == x_TD.device and p.dtype == x_TD.dtype for p in expert_params(weights))
    )


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def _add_bias(y_PO: torch.Tensor, b_SO: torch.Tensor | None, slot_P: torch.Tensor) -> None:
    if b_SO is not None:
        y_PO.add_(b_SO.index_select(0, slot_P))


def _slot_sums(g_PO: torch.Tensor, offs: torch.Tensor, empty: list[int]) -> torch.Tensor:
    """db_SO[s] = sum of g over slot s's padded rows (padding rows hold 0), as one more grouped
    GEMM: ones^T @ g per group (fp32 accumulation, fixed order). A float64 block-sum + prefix-sum
    version cost ~0.6 ms per bias on an H100 (E=64 x 1024 rows) against ~0.85 ms per GEMM."""
    ones_PW = g_PO.new_ones(g_PO.shape[0], 16)  # 16 columns: 16-byte-aligned strides
    db_SO = _gmm(ones_PW.t(), g_PO.contiguous(), offs)[:, 0]
    if empty:
        db_SO[empty] = 0
    return db_SO


class _GroupedTokenExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_P, pos_TK, weights_TK, w1, b1, w3, b3, w2, b2, ends, activation):
        slot_ends, block_size = ends
        T, D = x_TD.shape
        P = token_P.shape[0]
        K = pos_TK.shape[1]
        Fh = w2.shape[1]
        device = x_TD.device
        offs = torch.tensor(slot_ends, dtype=torch.int32, device=device)
        lengths = torch.diff(offs, prepend=offs.new_zeros(1))
        slot_P = torch.repeat_interleave(
            torch.arange(len(slot_ends), device=device), lengths, output_size=P
        )
        swiglu = activation == "swiglu"
        cat = swiglu and w3 is None
        x_PD = x_TD.index_select(0, token_P.clamp(max=T - 1))  # padding reads some real row
        a_PF = _gmm(x_PD, w1, offs)
        _add_bias(a_PF, b1, slot_P)
        if cat:
            a_PF, u_PF = a_PF[:, :Fh], a_PF[:, Fh:]
        elif swiglu:
            u_PF = _gmm(x_PD, w3, offs)
            _add_bias(u_PF, b3, slot_P)
        else:
            u_PF = None
        if swiglu:
            s_PF = F.silu(a_PF)
            h_PF = s_PF * u_PF
        else:
            s_PF = None
            h_PF = activate(a_PF, activation)
        out_PD = _gmm(h_PF, w2, offs)
        _add_bias(out_PD, b2, slot_P)
        kept_TK1 = (pos_TK < P).unsqueeze(-1)
        rows_TKD = out_PD.index_select(0, pos_TK.clamp(max=P - 1).reshape(-1)).view(T, K, -1)
        rows_TKD = torch.where(kept_TK1, rows_TKD, 0.0)
        if weights_TK is None:
            y_TD = rows_TKD.sum(dim=1)
        else:  # k = 0..K-1 in order
            w_TK = weights_TK.to(rows_TKD.dtype)
            y_TD = rows_TKD[:, 0] * w_TK[:, 0:1]
            for k in range(1, K):
                y_TD.addcmul_(rows_TKD[:, k], w_TK[:, k : k + 1])
        keep_rows = rows_TKD if weights_TK is not None else None
        ctx.save_for_backward(
            x_PD, token_P, pos_TK, weights_TK, w1, w3, w2, a_PF, u_PF, s_PF, h_PF, keep_rows, offs
        )
        ctx.activation = activation
        ctx.slot_ends, ctx.block_size = slot_ends, block_size
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        (x_PD, token_P, pos_TK, weights_TK, w1, w3, w2, a_PF, u_PF, s_PF, h_PF, rows_TKD, offs) = (
            ctx.saved_tensors
        )
        need = ctx.needs_input_grad
        T, K = pos_TK.shape
        P = token_P.shape[0]
        swiglu = ctx.activation == "swiglu"
        cat = swiglu and w3 is None
        dy_TD = dy_TD.contiguous()

        dweights_TK = None
        if weights_TK is not None and need[3]:
            # fp32 products and sums (inputs are 16-bit or fp32); a dropped choice's row is 0
            dots_TK = (rows_TKD.float() * dy_TD.float().unsqueeze(1)).sum(dim=-1)
            dweights_TK = dots_TK.to(weights_TK.dtype)

        # g_PD[p] = weight(p) * dy_TD[token(p)], exactly 0 on padding rows
        g_PD = dy_TD.index_select(0, token_P.clamp(max=T - 1))
        if weights_TK is not None:
            scale_P = torch.zeros(P + 1, dtype=weights_TK.dtype, device=dy_TD.device)
            scale_P.scatter_(0, pos_TK.reshape(-1), weights_TK.detach().reshape(-1))
            g_PD = g_PD * scale_P[:P].unsqueeze(-1).to(g_PD.dtype)
        g_PD = torch.where((token_P < T).unsqueeze(-1), g_PD, 0.0)

        empty = [
            s
            for s, (lo, hi) in enumerate(zip((0,) + ctx.slot_ends[:-1], ctx.slot_ends, strict=True))
            if lo == hi
        ]

        def weight_grad(x, g):
            dw = _gmm(x.t(), g, offs)
            if empty:  # a group without rows: make its gradient exactly zero
                dw[empty] = 0
            return dw

        dw2 = weight_grad(h_PF, g_PD) if need[8] else None
        db2 = _slot_sums(g_PD, offs, empty) if need[9] else None
        dh_PF = _gmm(g_PD, w2.transpose(1, 2), offs)
        if swiglu:
            du_PF = dh_PF * s_PF
            da_PF = torch.ops.aten.silu_backward(dh_PF * u_PF, a_PF)
        else:
            du_PF = None
            da_PF = activate_backward(dh_PF, a_PF, ctx.activation)
        if cat:
            da_PF = torch.cat([da_PF, du_PF], dim=1)
            du_PF = None
        dw1 = weight_grad(x_PD, da_PF) if need[4] else None
        db1 = _slot_sums(da_PF, offs, empty) if need[5] else None
        dw3 = weight_grad(x_PD, du_PF) if du_PF is not None and need[6] else None
        db3 = _slot_sums(du_PF, offs, empty) if du_PF is not None and need[7] else None
        dx_TD = None
        if need[0]:
            dx_PD = _gmm(da_PF, w1.transpose(1, 2), offs)
            if du_PF is not None:
                dx_PD = dx_PD + _gmm(du_PF, w3.transpose(1, 2), offs)
            rows = dx_PD.index_select(0, pos_TK.clamp(max=P - 1).reshape(-1)).view(T, K, -1)
            dx_TD = torch.where((pos_TK < P).unsqueeze(-1), rows, 0.0).sum(dim=1)
        return (dx_TD, None, None, dweights_TK, dw1, db1, dw3, db3, dw2, db2, None, None)


def grouped_mm_token_expert_mlp(
    x_TD: torch.Tensor,
    token_P: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    weights: ExpertWeights,
    schedule: BlockSchedule,
    activation: str,
) -> torch.Tensor:
    """``token_expert_mlp``'s computation through ``torch._grouped_mm`` (check ``layout_fits``,
    or ``grouped_mm_path_applies`` for the default choice, first)."""
    if not layout_fits(x_TD, pos_TK, weights, schedule, activation):
        raise ValueError(
            "grouped_mm_token_expert_mlp needs a slot-sorted layout (schedule.slot_ends), one "
            "dtype and device for x and every weight, D and F multiples of 8 and at least one row; "
            "use token_expert_mlp, which picks a path that fits"
        )
    return _GroupedTokenExpertMLP.apply(
        *function_inputs(x_TD, token_P, pos_TK, weights_TK, weights),
        (tuple(schedule.slot_ends), schedule.block_size),
        activation,
    )
