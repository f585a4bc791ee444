"""Grouped linear over the padded block layout, as ``torch.library`` custom ops.

Legend: Nb blocks, B block size, P = Nb * B padded rows, S weight slots, I input features,
O output features.

    y[b*B + i] = x[b*B + i] @ w[slot[b]] + bias[slot[b]]   for i <  rows[b]
    y[b*B + i] = 0                                           for i >= rows[b]  (masked)

Backward: dx = grouped_linear(dy, w^T) (no bias), dw[s] = sum over blocks of slot s of
x_block^T @ dy_block, db[s] = column sums of dy over the same rows. Masked rows contribute nothing
and receive zero gradient.

The CPU implementation below loops over *pieces* of valid rows (consecutive blocks of one slot up
to a partial block; about one per segment), never over rows, and its GEMMs never touch padding. The CUDA
implementations (``*_triton``) launch the Triton kernels of ``mixmoe.kernels``, imported lazily.
"""

from __future__ import annotations

import torch


def _padding_rows(block_rows_Nb: torch.Tensor, block_size: int) -> torch.Tensor:
    """Indices of the masked (padding) rows. Masking fills these rows (not a multiply by 0), so
    NaN/inf garbage in padded rows can never leak into outputs or weight gradients."""
    lane_B = torch.arange(block_size, device=block_rows_Nb.device)
    return torch.nonzero((lane_B[None, :] >= block_rows_Nb[:, None]).reshape(-1)).reshape(-1)


def _row_pieces(
    block_slot_Nb: torch.Tensor, block_rows_Nb: torch.Tensor, block_size: int
) -> list[tuple[int, int, int]]:
    """(slot, first padded row, valid rows) of every maximal run of VALID rows that are
    contiguous in the padded layout and share a slot: consecutive full blocks of one slot, up to
    and including a partial block. The CPU GEMMs read only these rows: padding costs nothing."""
    pieces: list[tuple[int, int, int]] = []
    slot, start, n = -1, 0, 0
    for b, (s, rows) in enumerate(zip(block_slot_Nb.tolist(), block_rows_Nb.tolist(), strict=True)):
        if n and s == slot and start + n == b * block_size:
            n += rows
        else:
            if n:
                pieces.append((slot, start, n))
            slot, start, n = s, b * block_size, rows
        if rows < block_size:  # a partial block ends the contiguous run
            pieces.append((slot, start, n))
            n = 0
    if n:
        pieces.append((slot, start, n))
    return pieces


@torch.library.custom_op("mixmoe::grouped_linear", mutates_args=())
def grouped_linear(
    x_PI: torch.Tensor,
    w_SIO: torch.Tensor,
    b_SO: torch.Tensor | None,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``y_PO``: each block of ``x_PI`` times its slot's weight (+ bias), masked rows zero.
    Dtype ``promote(x, w)``: mixed inputs (and the bias) are cast to it first, as the Triton
    launcher does (``mixmoe.kernels.grouped_gemm``); one dtype: no copy."""
    out_dtype = torch.promote_types(x_PI.dtype, w_SIO.dtype)
    x_PI, w_SIO = x_PI.to(out_dtype), w_SIO.to(out_dtype)
    b_SO = None if b_SO is None else b_SO.to(out_dtype)
    y_PO = x_PI.new_empty(x_PI.shape[0], w_SIO.shape[2], dtype=out_dtype)  # valid rows written
    for slot, first, n in _row_pieces(block_slot_Nb, block_rows_Nb, block_size):
        rows = slice(first, first + n)
        if b_SO is None:
            torch.matmul(x_PI[rows], w_SIO[slot], out=y_PO[rows])
        else:
            torch.addmm(b_SO[slot], x_PI[rows], w_SIO[slot], out=y_PO[rows])
    return y_PO.index_fill_(0, _padding_rows(block_rows_Nb, block_size), 0.0)


@grouped_linear.register_fake
def _(x_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size):
    dtype = torch.promote_types(x_PI.dtype, w_SIO.dtype)  # as the real implementations
    return x_PI.new_empty(x_PI.shape[0], w_SIO.shape[2], dtype=dtype)


@grouped_linear.register_kernel("cuda")
def grouped_linear_triton(
    x_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size, *, config=None
):
    from mixmoe import kernels  # Triton is imported only when a CUDA tensor gets here

    return kernels.grouped_gemm(
        x_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size=block_size, config=config
    )


@torch.library.custom_op("mixmoe::grouped_weight_grad", mutates_args=())
def grouped_weight_grad(
    x_PI: torch.Tensor,
    dy_PO: torch.Tensor,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    num_slots: int,
    block_size: int,
    with_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dw_SIO, db_SO): per-slot reductions over that slot's blocks (masked rows excluded).
    ``db_SO`` is an empty [S, 0] tensor when ``with_bias`` is False."""
    return slot_weight_grad(
        x_PI, dy_PO, block_slot_Nb, block_rows_Nb, num_slots, block_size, with_bias
    )


def slot_weight_grad(
    x_PI: torch.Tensor,
    dy_PO: torch.Tensor,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    num_slots: int,
    block_size: int,
    with_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU body of the weight gradient: one GEMM per piece of valid rows (``_row_pieces``), so
    padding rows are never read (whatever they hold); a slot's first piece writes, later pieces
    accumulate, slots without rows get zeros. ``dw_SIO`` in ``x_PI``'s dtype, ``db_SO`` in
    ``dy_PO``'s; mixed inputs are multiplied in their promoted dtype (the Triton launcher's
    contract, ``mixmoe.kernels.grouped_weight_grad``)."""
    if x_PI.dtype != dy_PO.dtype:
        dtype = torch.promote_types(x_PI.dtype, dy_PO.dtype)
        dw_SIO, db_SO = slot_weight_grad(
            x_PI.to(dtype),
            dy_PO.to(dtype),
            block_slot_Nb,
            block_rows_Nb,
            num_slots,
            block_size,
            with_bias,
        )
        return dw_SIO.to(x_PI.dtype), db_SO.to(dy_PO.dtype)
    dw_SIO = x_PI.new_empty(num_slots, x_PI.shape[1], dy_PO.shape[1])
    db_SO = dy_PO.new_zeros(num_slots, dy_PO.shape[1] if with_bias else 0)
    written = set()
    for slot, first, n in _row_pieces(block_slot_Nb, block_rows_Nb, block_size):
        rows = slice(first, first + n)
        if slot in written:
            dw_SIO[slot].addmm_(x_PI[rows].t(), dy_PO[rows])
        else:
            torch.mm(x_PI[rows].t(), dy_PO[rows], out=dw_SIO[slot])
            written.add(slot)
        if with_bias:
            db_SO[slot] += dy_PO[rows].sum(dim=0)
    for slot in set(range(num_slots)) - written:
        dw_SIO[slot].zero_()
    return dw_SIO, db_SO


@grouped_weight_grad.register_fake
def _(x_PI, dy_PO, block_slot_Nb, block_rows_Nb, num_slots, block_size, with_bias):
    return (
        x_PI.new_empty(num_slots, x_PI.shape[1], dy_PO.shape[1]),
        dy_PO.new_empty(num_slots, dy_PO.shape[1] if with_bias else 0),
    )


@grouped_weight_grad.register_kernel("cuda")
def grouped_weight_grad_triton(
    x_PI, dy_PO, block_slot_Nb, block_rows_Nb, num_slots, block_size, with_bias, *, config=None
):
    from mixmoe import kernels

    return kernels.grouped_weight_grad(
        x_PI,
        dy_PO,
        block_slot_Nb,
        block_rows_Nb,
        num_slots=num_slots,
        block_size=block_size,
        with_bias=with_bias,
        config=config,
    )


def _setup_context(ctx, inputs, output) -> None:
    x_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size = inputs
    ctx.save_for_backward(x_PI, w_SIO, block_slot_Nb, block_rows_Nb)
    ctx.block_size = block_size
    ctx.with_bias = b_SO is not None


def _backward(ctx, dy_PO):
    x_PI, w_SIO, block_slot_Nb, block_rows_Nb = ctx.saved_tensors
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = grouped_linear(
            dy_PO, w_SIO.transpose(1, 2), None, block_slot_Nb, block_rows_Nb, ctx.block_size
        ).to(x_PI.dtype)
    if ctx.needs_input_grad[1] or (ctx.with_bias and ctx.needs_input_grad[2]):
        # x in the forward's dtype: the op returns dw in x's dtype, which would round the
        # gradient of float32 weights fed a bfloat16 x to bfloat16 (the op casts x anyway)
        dw, db = grouped_weight_grad(
            x_PI.to(torch.promote_types(x_PI.dtype, w_SIO.dtype)),
            dy_PO,
            block_slot_Nb,
            block_rows_Nb,
            w_SIO.shape[0],
            ctx.block_size,
            ctx.with_bias,
        )
        dw = dw.to(w_SIO.dtype)
        db = db.to(w_SIO.dtype) if ctx.with_bias else None
    return dx, dw, db, None, None, None


grouped_linear.register_autograd(_backward, setup_context=_setup_context)
