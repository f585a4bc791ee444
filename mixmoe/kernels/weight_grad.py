"""Per-slot weight and bias gradients over the block schedule (no atomics, fixed order).

Legend: Nb blocks, B block size, P = Nb * B padded rows, S weight slots, I input features,
O output features.

    dw[s] = sum over blocks b of slot s (in block order), over valid rows i < rows[b]:
                x_row(p)^T @ dy_row(p)                                  (p = b * B + i)
    db[s] = the same sum of dy_row(p)

where ``x_row(p) = x[x_index[p]]`` (gather) or ``x[p]`` and ``dy_row(p) = scale[p] * dy[dy_index[p]]``
or ``dy[p]``. One program owns one ``BLOCK_M x BLOCK_N`` tile of one slot's gradient and walks that
slot's blocks in increasing block order, so the result is deterministic and each element is
written exactly once (slots without blocks get zeros). fp32 accumulation.
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
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (64, 64, 64, 4, 4),
        (128, 64, 32, 4, 4),
        (64, 128, 32, 4, 3),
    ]
]


def _prune_configs(configs, named_args, **kwargs):
    block_size = kwargs.get("BLOCK_SIZE", named_args.get("BLOCK_SIZE"))
    kept = [c for c in configs if c.kwargs["BLOCK_K"] <= block_size]
    return kept or [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": block_size})]


@triton.jit
def _grouped_weight_grad_kernel(
    # pointers
    x_ptr,
    dy_ptr,
    dw_ptr,
    db_ptr,
    block_order_ptr,
    slot_start_ptr,
    block_rows_ptr,
    x_index_ptr,
    dy_index_ptr,
    dy_scale_ptr,
    # sizes
    I,
    O,
    # strides
    stride_xr,
    stride_xi,
    stride_dyr,
    stride_dyo,
    stride_dws,
    stride_dwi,
    stride_dwo,
    stride_dbs,
    stride_dbo,
    # meta
    BLOCK_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_GATHER: tl.constexpr,
    DY_GATHER: tl.constexpr,
    DY_SCALE: tl.constexpr,
    BLOCKS_CLASS: tl.constexpr,  # autotune key only: bit lengths of the block and slot counts
    SLOTS_CLASS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < I
    n_mask = offs_n < O
    lane_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = tl.load(slot_start_ptr + slot)
    end = tl.load(slot_start_ptr + slot + 1)
    # One flat loop over the slot's row chunks (CHUNKS per block), not a loop over blocks around
    # a loop over chunks: Triton software-pipelines only the innermost loop, and the nested form
    # loaded and multiplied without overlap (H100: fwd+bwd of the expert MLP 1.7x slower; see
    # scripts/gpu/NOTES.md).
    CHUNKS: tl.constexpr = BLOCK_SIZE // BLOCK_K
    for c in range(0, (end - start) * CHUNKS):
        blk = tl.load(block_order_ptr + start + c // CHUNKS).to(tl.int64)
        num_rows = tl.load(block_rows_ptr + blk)
        lane = (c % CHUNKS) * BLOCK_K + lane_k
        r_mask = lane < num_rows  # a chunk past the block's valid rows loads nothing
        prow = blk * BLOCK_SIZE + lane
        if X_GATHER:
            x_rows = tl.load(x_index_ptr + prow, mask=r_mask, other=0).to(tl.int64)
        else:
            x_rows = prow
        if DY_GATHER:
            dy_rows = tl.load(dy_index_ptr + prow, mask=r_mask, other=0).to(tl.int64)
        else:
            dy_rows = prow
        # x^T tile [BLOCK_M, BLOCK_K], read transposed through the strides
        xt = tl.load(
            x_ptr + x_rows[None, :] * stride_xr + offs_m[:, None] * stride_xi,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        dy = tl.load(
            dy_ptr + dy_rows[:, None] * stride_dyr + offs_n[None, :] * stride_dyo,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if DY_SCALE:
            scale = tl.load(dy_scale_ptr + prow, mask=r_mask, other=0.0).to(tl.float32)
            dy_f32 = dy.to(tl.float32) * scale[:, None]
            dy = dy_f32.to(dy.dtype)
        else:
            dy_f32 = dy.to(tl.float32)
        if HAS_BIAS:
            db_acc += tl.sum(dy_f32, axis=0)
        if DOT_FP32:
            acc = tl.dot(xt.to(tl.float32), dy.to(tl.float32), acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(xt, dy, acc, input_precision=INPUT_PRECISION)

    dw_ptrs = (
        dw_ptr + slot * stride_dws + offs_m[:, None] * stride_dwi + offs_n[None, :] * stride_dwo
    )
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    if HAS_BIAS:
        if pid_m == 0:
            db_ptrs = db_ptr + slot * stride_dbs + offs_n * stride_dbo
            tl.store(db_ptrs, db_acc.to(db_ptr.dtype.element_ty), mask=n_mask)


_grouped_weight_grad_autotuned = triton.autotune(
    configs=_AUTOTUNE_CONFIGS,
    key=[
        "I",
        "O",
        "BLOCK_SIZE",
        "HAS_BIAS",
        "X_GATHER",
        "DY_GATHER",
        "DY_SCALE",
        "BLOCKS_CLASS",
        "SLOTS_CLASS",
    ],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_grouped_weight_grad_kernel)


def slot_blocks(block_slot_Nb: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_order_Nb, slot_start_S1): the blocks sorted by slot (stable, so increasing block
    order within a slot) and where each slot's run starts (CSR offsets, S + 1 entries). No host
    sync."""
    block_order_Nb = torch.argsort(block_slot_Nb, stable=True)
    counts_S = torch.bincount(block_slot_Nb, minlength=num_slots)[:num_slots]
    slot_start_S1 = torch.zeros(num_slots + 1, dtype=torch.int64, device=block_slot_Nb.device)
    torch.cumsum(counts_S, 0, out=slot_start_S1[1:])
    return block_order_Nb, slot_start_S1


def grouped_weight_grad(
    x: torch.Tensor,
    dy: torch.Tensor,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    *,
    num_slots: int,
    block_size: int,
    with_bias: bool,
    x_index_P: torch.Tensor | None = None,
    dy_index_P: torch.Tensor | None = None,
    dy_scale_P: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dw_SIO, db_SO)`` (see the module docstring).

    x:  [P, I] padded, or [n, I] read through ``x_index_P`` (int, [P]).
    dy: [P, O] padded, or [m, O] read through ``dy_index_P``; ``dy_scale_P`` (float, [P]) scales
        its rows. Masked rows of either are never read.
    Returns ``dw_SIO`` in ``x``'s dtype and ``db_SO`` in ``dy``'s dtype (an empty [S, 0] tensor
    when ``with_bias`` is False), as ``mixmoe::grouped_weight_grad`` defines them. ``out`` may
    pass both buffers. Mixed input dtypes are multiplied in their promoted dtype.
    """
    # check
    check_block_size(block_size)
    check_float("x", x, 2)
    check_float("dy", dy, 2)
    device = x.device
    check_schedule(block_slot_Nb, block_rows_Nb, device)
    if dy.device != device:
        raise ValueError(f"dy is on {dy.device}, x on {device}")
    if num_slots < 0:
        raise ValueError(f"num_slots must be >= 0, got {num_slots}")
    P = block_slot_Nb.shape[0] * block_size
    for name, t, index in (("x", x, x_index_P), ("dy", dy, dy_index_P)):
        if index is None and t.shape[0] != P:
            raise ValueError(
                f"{name} has {t.shape[0]} rows; without {name}_index_P it must be the padded "
                f"layout (num_blocks * block_size = {P} rows)"
            )
    x_index_P = check_index("x_index_P", x_index_P, P, device)
    dy_index_P = check_index("dy_index_P", dy_index_P, P, device)
    dy_scale_P = check_index("dy_scale_P", dy_scale_P, P, device)
    I, O = x.shape[1], dy.shape[1]
    dw_dtype, db_dtype = x.dtype, dy.dtype
    dtype = common_dtype(x, dy)
    x, dy = x.to(dtype), dy.to(dtype)
    block_rows_Nb = block_rows_Nb.contiguous()

    # allocate
    dw_out, db_out = out if out is not None else (None, None)
    dw = check_out(dw_out, (num_slots, I, O), dw_dtype, device, "out[0]")
    db = check_out(db_out, (num_slots, O if with_bias else 0), db_dtype, device, "out[1]")
    if num_slots == 0 or O == 0 or I == 0:
        dw.zero_()
        db.zero_()
        return dw, db
    block_order_Nb, slot_start_S1 = slot_blocks(block_slot_Nb, num_slots)

    # launch
    dummy = block_rows_Nb  # never read: its flag is off
    args = (
        x,
        dy,
        dw,
        db if with_bias else dummy,
        block_order_Nb,
        slot_start_S1,
        block_rows_Nb,
        x_index_P if x_index_P is not None else dummy,
        dy_index_P if dy_index_P is not None else dummy,
        dy_scale_P if dy_scale_P is not None else dummy,
        I,
        O,
        x.stride(0),
        x.stride(1),
        dy.stride(0),
        dy.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        db.stride(0) if with_bias else 0,
        db.stride(1) if with_bias else 0,
    )
    flags = {
        "BLOCK_SIZE": block_size,
        "HAS_BIAS": with_bias,
        "X_GATHER": x_index_P is not None,
        "DY_GATHER": dy_index_P is not None,
        "DY_SCALE": dy_scale_P is not None,
        # tune per problem-size class: a config tuned on 16 blocks is a poor choice for 4096
        "BLOCKS_CLASS": block_slot_Nb.shape[0].bit_length(),
        "SLOTS_CLASS": num_slots.bit_length(),
        "INPUT_PRECISION": input_precision(dtype),
        "DOT_FP32": dot_in_fp32(_grouped_weight_grad_kernel, dtype),
    }
    if config is None and not autotune_enabled():
        config = default_tiles("weight_grad", dtype, block_size)
    if config is None:

        def grid(meta):
            return (num_slots, triton.cdiv(I, meta["BLOCK_M"]), triton.cdiv(O, meta["BLOCK_N"]))

        _grouped_weight_grad_autotuned[grid](*args, **flags)
    else:
        if config.block_k > block_size:
            raise ValueError(f"config.block_k={config.block_k} exceeds block_size={block_size}")
        grid = (num_slots, triton.cdiv(I, config.block_m), triton.cdiv(O, config.block_n))
        _grouped_weight_grad_kernel[grid](
            *args,
            **flags,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            **config.meta(),
        )
    return dw, db
