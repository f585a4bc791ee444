"""Grouped GEMM over the block schedule, with an optional fused gather and scatter.

Legend: Nb blocks, B block size, P = Nb * B padded rows, S weight slots, I input features,
O output features, n rows of the (gathered) input, M rows of a scattered output.

One program computes a ``BLOCK_M x BLOCK_N`` tile of one block (``B // BLOCK_M`` tiles per block):

    a[i]   = x[row_index[p]]  (gather)  or  x[p]  (padded input),   p = b * B + i
    y[p']  = scale[p] * (a[i] @ w[slot[b]]) + bias[slot[b]]      for i < rows[b]
    p'     = out_index[p]  (scatter)  or  p  (padded output; rows i >= rows[b] are written as 0)

Partial blocks are masked on load (rows past ``rows[b]`` read nothing) and on store (a scattered
output only receives valid rows; a padded output gets zeros there, so the result is fully defined).
Tiles wholly past ``rows[b]`` skip the reduction loop. Products are accumulated in fp32.

``w`` is read through its strides, so ``w.transpose(1, 2)`` gives the transposed-weight GEMM of
the backward pass (dX) without a copy. No autograd here: ``mixmoe.ops`` wraps these launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixmoe.kernels.launch import (
    TileConfig,
    autotune_enabled,
    check_block_size,
    check_float,
    check_index,
    check_out,
    check_schedule,
    common_dtype,
    default_tiles,
    dot_in_fp32,
    input_precision,
)

_AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in [
        (64, 128, 64, 4, 4),
        (64, 256, 64, 8, 3),
        (64, 256, 64, 4, 4),
        (64, 64, 64, 4, 4),
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (32, 128, 64, 4, 4),
        (16, 128, 64, 4, 4),
    ]
]


def _prune_configs(configs, named_args, **kwargs):
    """Keep tiles that divide the block size (a tile never straddles two blocks)."""
    block_size = kwargs.get("BLOCK_SIZE", named_args.get("BLOCK_SIZE"))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= block_size]
    return kept or [triton.Config({"BLOCK_M": block_size, "BLOCK_N": 64, "BLOCK_K": 32})]


@triton.jit
def _grouped_gemm_kernel(
    # pointers
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    block_slot_ptr,
    block_rows_ptr,
    row_index_ptr,
    row_scale_ptr,
    out_index_ptr,
    # sizes
    I,
    O,
    # strides
    stride_xr,
    stride_xi,
    stride_ws,
    stride_wi,
    stride_wo,
    stride_bs,
    stride_bo,
    stride_yr,
    stride_yo,
    # meta
    BLOCK_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATHER: tl.constexpr,
    SCALE: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCKS_CLASS: tl.constexpr,  # autotune key only: bit length of the number of blocks
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // BLOCK_M
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blk = pid_m // TILES_PER_BLOCK
    first = (pid_m % TILES_PER_BLOCK) * BLOCK_M
    slot = tl.load(block_slot_ptr + blk).to(tl.int64)
    num_rows = tl.load(block_rows_ptr + blk)

    lane_m = first + tl.arange(0, BLOCK_M)
    row_mask = lane_m < num_rows
    prow = blk.to(tl.int64) * BLOCK_SIZE + lane_m
    if GATHER:
        src = tl.load(row_index_ptr + prow, mask=row_mask, other=0).to(tl.int64)
    else:
        src = prow
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < O
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + src[:, None] * stride_xr + offs_k[None, :] * stride_xi
    w_ptrs = w_ptr + slot * stride_ws + offs_k[:, None] * stride_wi + offs_n[None, :] * stride_wo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # a tile wholly past the block's valid rows has nothing to reduce
    num_k = tl.where(first < num_rows, tl.cdiv(I, BLOCK_K), 0)
    for kk in range(0, num_k):
        k_mask = offs_k < I - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_xi
        w_ptrs += BLOCK_K * stride_wi

    if SCALE:
        scale = tl.load(row_scale_ptr + prow, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    if HAS_BIAS:
        bias = tl.load(b_ptr + slot * stride_bs + offs_n * stride_bo, mask=n_mask, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    acc = tl.where(row_mask[:, None], acc, 0.0)
    out = acc.to(y_ptr.dtype.element_ty)
    if SCATTER:
        dst = tl.load(out_index_ptr + prow, mask=row_mask, other=0).to(tl.int64)
        y_ptrs = y_ptr + dst[:, None] * stride_yr + offs_n[None, :] * stride_yo
        tl.store(y_ptrs, out, mask=row_mask[:, None] & n_mask[None, :])
    else:
        y_ptrs = y_ptr + prow[:, None] * stride_yr + offs_n[None, :] * stride_yo
        tl.store(y_ptrs, out, mask=n_mask[None, :])


_grouped_gemm_autotuned = triton.autotune(
    configs=_AUTOTUNE_CONFIGS,
    key=["I", "O", "BLOCK_SIZE", "HAS_BIAS", "GATHER", "SCALE", "SCATTER", "BLOCKS_CLASS"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_grouped_gemm_kernel)


def grouped_gemm(
    x: torch.Tensor,
    w_SIO: torch.Tensor,
    b_SO: torch.Tensor | None,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    *,
    block_size: int,
    row_index_P: torch.Tensor | None = None,
    row_scale_P: torch.Tensor | None = None,
    out_index_P: torch.Tensor | None = None,
    num_out_rows: int | None = None,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Block-wise ``y = scale * (x_rows @ w[slot]) + b[slot]`` (see the module docstring).

    x:            [P, I] padded rows, or [n, I] read through ``row_index_P`` (int, [P]; entries of
                  masked rows are never read, so any value - e.g. T for padding - is fine).
    w_SIO:        [S, I, O], any strides (pass ``w.transpose(1, 2)`` for the transposed GEMM).
    b_SO:         [S, O] or None.
    row_scale_P:  optional per-padded-row factor (float, [P]) applied before the bias.
    out_index_P:  optional destination row (int, [P]) of each valid padded row in an output of
                  ``num_out_rows`` rows; destinations must be distinct. Rows no valid padded row
                  maps to are left untouched (``out`` or uninitialised memory).
    Returns ``out``: [P, O] padded (masked rows zero) or [num_out_rows, O], dtype
    ``promote(x, w)``; fp32 accumulation. Mixed input dtypes are cast to that dtype first.
    """
    # check
    check_block_size(block_size)
    check_float("x", x, 2)
    check_float("w_SIO", w_SIO, 3)
    device = x.device
    check_schedule(block_slot_Nb, block_rows_Nb, device)
    S, I, O = w_SIO.shape
    P = block_slot_Nb.shape[0] * block_size
    if x.shape[1] != I:
        raise ValueError(
            f"x has {x.shape[1]} features but w_SIO expects I={I} ({tuple(w_SIO.shape)})"
        )
    if row_index_P is None and x.shape[0] != P:
        raise ValueError(
            f"x has {x.shape[0]} rows; without row_index_P it must be the padded layout "
            f"(num_blocks * block_size = {P} rows)"
        )
    if b_SO is not None and tuple(b_SO.shape) != (S, O):
        raise ValueError(f"b_SO must have shape ({S}, {O}), got {tuple(b_SO.shape)}")
    row_index_P = check_index("row_index_P", row_index_P, P, device)
    row_scale_P = check_index("row_scale_P", row_scale_P, P, device)
    out_index_P = check_index("out_index_P", out_index_P, P, device)
    if (out_index_P is None) != (num_out_rows is None):
        raise ValueError("out_index_P and num_out_rows go together: pass both or neither")
    dtype = common_dtype(x, w_SIO)
    x, w_SIO = x.to(dtype), w_SIO.to(dtype)
    block_slot_Nb, block_rows_Nb = block_slot_Nb.contiguous(), block_rows_Nb.contiguous()

    # allocate
    rows_out = P if out_index_P is None else num_out_rows
    y = check_out(out, (rows_out, O), dtype, device)
    if P == 0 or O == 0:
        return y

    # launch
    dummy = block_rows_Nb  # never read: its flag is off
    args = (
        x,
        w_SIO,
        b_SO if b_SO is not None else dummy,
        y,
        block_slot_Nb,
        block_rows_Nb,
        row_index_P if row_index_P is not None else dummy,
        row_scale_P if row_scale_P is not None else dummy,
        out_index_P if out_index_P is not None else dummy,
        I,
        O,
        x.stride(0),
        x.stride(1),
        w_SIO.stride(0),
        w_SIO.stride(1),
        w_SIO.stride(2),
        b_SO.stride(0) if b_SO is not None else 0,
        b_SO.stride(1) if b_SO is not None else 0,
        y.stride(0),
        y.stride(1),
    )
    flags = {
        "BLOCK_SIZE": block_size,
        "HAS_BIAS": b_SO is not None,
        "GATHER": row_index_P is not None,
        "SCALE": row_scale_P is not None,
        "SCATTER": out_index_P is not None,
        # tune per problem-size class: a config tuned on 16 blocks is a poor choice for 4096
        "BLOCKS_CLASS": block_slot_Nb.shape[0].bit_length(),
        "INPUT_PRECISION": input_precision(dtype),
        "DOT_FP32": dot_in_fp32(_grouped_gemm_kernel, dtype),
    }
    num_blocks = block_slot_Nb.shape[0]
    if config is None and not autotune_enabled():
        config = default_tiles("gemm", dtype, block_size)
    if config is None:

        def grid(meta):
            return (num_blocks * (block_size // meta["BLOCK_M"]), triton.cdiv(O, meta["BLOCK_N"]))

        _grouped_gemm_autotuned[grid](*args, **flags)
    else:
        if config.block_m > block_size:
            raise ValueError(f"config.block_m={config.block_m} exceeds block_size={block_size}")
        grid = (num_blocks * (block_size // config.block_m), triton.cdiv(O, config.block_n))
        _grouped_gemm_kernel[grid](
            *args,
            **flags,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            **config.meta(),
        )
    return y
