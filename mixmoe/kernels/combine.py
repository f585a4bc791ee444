"""Deterministic combine of each token's K choice rows, and its weight gradient.

Legend: T tokens, K top-k, R = T * K choice rows (token-major: row ``t * K + k``), O features,
P padded rows (``pos_TK == P`` marks a dropped choice).

``combine_choices``:       y[t] = sum over k = 0, 1, ..., K-1 (in this order, fp32) of
                                  w[t, k] * rows[t * K + k]          (dropped choices skipped)
``combine_weights_grad``:  dw[t, k] = dy[t] . rows[t * K + k]  (fp32), 0 for dropped choices.

The grouped GEMM writes ``rows`` straight to token-choice order (its scatter epilogue), so these
kernels read contiguous rows and never need atomics: each output element is written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixmoe.kernels.launch import check_float, check_out


@triton.jit
def _combine_choices_kernel(
    # pointers
    rows_ptr,
    pos_ptr,
    weights_ptr,
    y_ptr,
    # sizes
    T,
    O,
    P,
    # strides
    stride_rr,
    stride_ro,
    stride_pt,
    stride_pk,
    stride_wt,
    stride_wk,
    stride_yt,
    stride_yo,
    # meta
    K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    CLEAR_DROPPED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    t_mask = offs_t < T
    o_mask = offs_o < O
    t64 = offs_t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + t64 * stride_pt + k * stride_pk, mask=t_mask, other=P)
        valid = t_mask & (pos < P)
        row_ptrs = rows_ptr + (t64 * K + k)[:, None] * stride_rr + offs_o[None, :] * stride_ro
        v = tl.load(row_ptrs, mask=valid[:, None] & o_mask[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + t64 * stride_wt + k * stride_wk, mask=valid, other=0.0)
            v = v * w.to(tl.float32)[:, None]
        acc += v
        if CLEAR_DROPPED:  # a dropped choice's row was never written: make it a defined zero
            dropped = t_mask & (pos >= P)
            zero = tl.zeros((BLOCK_T, BLOCK_O), dtype=rows_ptr.dtype.element_ty)
            tl.store(row_ptrs, zero, mask=dropped[:, None] & o_mask[None, :])
    y_ptrs = y_ptr + t64[:, None] * stride_yt + offs_o[None, :] * stride_yo
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & o_mask[None, :])


@triton.jit
def _combine_weights_grad_kernel(
    # pointers
    dy_ptr,
    rows_ptr,
    pos_ptr,
    dw_ptr,
    # sizes
    T,
    O,
    P,
    # strides
    stride_dyt,
    stride_dyo,
    stride_rr,
    stride_ro,
    stride_pt,
    stride_pk,
    stride_dwt,
    stride_dwk,
    # meta
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(1)
    t_mask = offs_t < T
    t64 = offs_t.to(tl.int64)
    pos = tl.load(pos_ptr + t64 * stride_pt + k * stride_pk, mask=t_mask, other=P)
    valid = t_mask & (pos < P)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for first in range(0, O, BLOCK_O):
        offs_o = first + tl.arange(0, BLOCK_O)
        mask = valid[:, None] & (offs_o < O)[None, :]
        dy = tl.load(
            dy_ptr + t64[:, None] * stride_dyt + offs_o[None, :] * stride_dyo, mask=mask, other=0.0
        )
        r = tl.load(
            rows_ptr + (t64 * K + k)[:, None] * stride_rr + offs_o[None, :] * stride_ro,
            mask=mask,
            other=0.0,
        )
        acc += tl.sum(dy.to(tl.float32) * r.to(tl.float32), axis=1)
    tl.store(dw_ptr + t64 * stride_dwt + k * stride_dwk, acc, mask=t_mask)


def _check_pos(pos_TK: torch.Tensor, device: torch.device) -> None:
    if pos_TK.dim() != 2 or pos_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"pos_TK must be a 2-D int tensor, got {pos_TK.dtype} {tuple(pos_TK.shape)}"
        )
    if pos_TK.device != device:
        raise ValueError(f"pos_TK is on {pos_TK.device}, the rows on {device}")


def combine_choices(
    rows_RO: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    *,
    num_padded_rows: int,
    clear_dropped: bool = False,
    out: torch.Tensor | None = None,
    block_t: int = 32,
    block_o: int = 128,
) -> torch.Tensor:
    """``y_TO`` (see the module docstring); ``weights_TK=None`` means unit weights.

    rows_RO:  [T * K, O], row ``t * K + k`` is choice k of token t; rows of dropped choices
              (``pos_TK >= num_padded_rows``) are not read, and with ``clear_dropped`` they are
              overwritten with zeros so the buffer is fully defined afterwards.
    Returns ``y_TO`` in ``rows_RO``'s dtype (fp32 sums, rounded once).
    """
    # check
    check_float("rows_RO", rows_RO, 2)
    device = rows_RO.device
    _check_pos(pos_TK, device)
    T, K = pos_TK.shape
    O = rows_RO.shape[1]
    if rows_RO.shape[0] != T * K:
        raise ValueError(
            f"rows_RO has {rows_RO.shape[0]} rows, pos_TK {tuple(pos_TK.shape)} needs T*K = {T * K}"
        )
    if weights_TK is not None and tuple(weights_TK.shape) != (T, K):
        raise ValueError(f"weights_TK must have shape ({T}, {K}), got {tuple(weights_TK.shape)}")
    for name, value in (("block_t", block_t), ("block_o", block_o)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")

    # allocate
    y = check_out(out, (T, O), rows_RO.dtype, device)
    if T == 0 or O == 0:
        return y

    # launch
    grid = (triton.cdiv(T, block_t), triton.cdiv(O, block_o))
    w = weights_TK if weights_TK is not None else pos_TK  # never read without HAS_WEIGHTS
    _combine_choices_kernel[grid](
        rows_RO,
        pos_TK,
        w,
        y,
        T,
        O,
        num_padded_rows,
        rows_RO.stride(0),
        rows_RO.stride(1),
        pos_TK.stride(0),
        pos_TK.stride(1),
        w.stride(0),
        w.stride(1),
        y.stride(0),
        y.stride(1),
        K=K,
        HAS_WEIGHTS=weights_TK is not None,
        CLEAR_DROPPED=clear_dropped,
        BLOCK_T=block_t,
        BLOCK_O=block_o,
    )
    return y


def combine_weights_grad(
    dy_TO: torch.Tensor,
    rows_RO: torch.Tensor,
    pos_TK: torch.Tensor,
    *,
    num_padded_rows: int,
    out: torch.Tensor | None = None,
    block_t: int = 32,
    block_o: int = 128,
) -> torch.Tensor:
    """``dw_TK`` (float32): ``dy[t] . rows[t * K + k]``, 0 for dropped choices."""
    # check
    check_float("dy_TO", dy_TO, 2)
    check_float("rows_RO", rows_RO, 2)
    device = dy_TO.device
    _check_pos(pos_TK, device)
    T, K = pos_TK.shape
    if tuple(rows_RO.shape) != (T * K, dy_TO.shape[1]) or dy_TO.shape[0] != T:
        raise ValueError(
            f"dy_TO {tuple(dy_TO.shape)} and rows_RO {tuple(rows_RO.shape)} do not match "
            f"pos_TK {tuple(pos_TK.shape)}: need [T, O] and [T*K, O]"
        )
    for name, value in (("block_t", block_t), ("block_o", block_o)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")

    # allocate
    dw = check_out(out, (T, K), torch.float32, device)
    if T == 0 or K == 0:
        return dw

    # launch
    grid = (triton.cdiv(T, block_t), K)
    _combine_weights_grad_kernel[grid](
        dy_TO,
        rows_RO,
        pos_TK,
        dw,
        T,
        dy_TO.shape[1],
        num_padded_rows,
        dy_TO.stride(0),
        dy_TO.stride(1),
        rows_RO.stride(0),
        rows_RO.stride(1),
        pos_TK.stride(0),
        pos_TK.stride(1),
        dw.stride(0),
        dw.stride(1),
        K=K,
        BLOCK_T=block_t,
        BLOCK_O=block_o,
    )
    return dw
