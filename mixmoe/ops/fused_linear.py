"""Grouped linear fused with the row movement around it, as ``torch.library`` custom ops.

Legend: T tokens, K top-k, R = T * K choice rows (token-major: row ``t * K + k``), Nb blocks,
B block size, P = Nb * B padded rows, S weight slots, I input features, O output features.

``gather_grouped_linear``   y_PO = grouped_linear(gather_rows(x_TI, token_P), w, b, ...)
``grouped_linear_combine``  y_TO = combine_rows(grouped_linear(h_PI, w, b, ...), pos_TK, weights_TK)

CPU: exactly those compositions of the reference ops (the forward gives the reference's numbers
bit for bit; the backward below, equal up to float rounding). CUDA:
the Triton kernels of ``mixmoe.kernels``: the first GEMM reads its rows of ``x_TI`` through
``token_P`` (no permuted copy of the input), the second writes each valid row straight to
token-choice order and a fixed-order K-sum combines them (no atomics).

Backward (the same formulas on every device, built from the internal ops below):

    gather_grouped_linear:   dx_TI[t] = sum_k (dy_PO @ w^T)[pos_TK[t, k]]      (k = 0..K-1)
                             dw[s], db[s] = per-slot sums over x_TI[token_P] and dy_PO
    grouped_linear_combine:  dh_PI[p] = weight(p) * (dy_TO[token(p)] @ w^T)
                             dw[s], db[s] = per-slot sums over h_PI and weight(p) * dy_TO[token(p)]
                             dweights_TK[t, k] = dy_TO[t] . out[pos_TK[t, k]]   (0 if dropped)

``pos_TK == P`` marks a dropped choice; ``token_P == T`` marks padding. Every reduction runs in a
fixed order, so CUDA results are deterministic run to run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixmoe.ops.grouped_linear import grouped_linear, slot_weight_grad


def choice_of_row_P(pos_TK: torch.Tensor, num_padded_rows: int) -> torch.Tensor:
    """``tk_P``: the choice row ``t * K + k`` held by each padded row, ``T * K`` for padding
    (the inverse of ``pos_TK`` on its valid entries). No host sync."""
    R = pos_TK.numel()
    tk_P = torch.full((num_padded_rows + 1,), R, dtype=torch.int64, device=pos_TK.device)
    # dropped choices all land on the extra entry P, which is cut off
    tk_P.scatter_(0, pos_TK.reshape(-1).to(torch.int64), torch.arange(R, device=pos_TK.device))
    return tk_P[:num_padded_rows]


def _gather_any_pad(x_TI: torch.Tensor, index_P: torch.Tensor) -> torch.Tensor:
    """CPU: ``x_TI[index_P]`` where padding entries (``index == T``) read SOME row of ``x_TI``
    instead of a zero row: one copy of the gathered rows, no padded copy of ``x_TI``. Only for
    consumers that mask padding (``grouped_linear`` fills masked rows, the weight gradient zeroes
    them)."""
    T = x_TI.shape[0]
    if T == 0:
        return x_TI.new_zeros(index_P.shape[0], x_TI.shape[1])
    return x_TI.index_select(0, index_P.clamp(max=T - 1))


def _choice_rows(out_PO: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """``rows_TKO``: ``out_PO[pos_TK]``, zero where ``pos_TK == P`` (dropped), without a padded
    copy of ``out_PO``."""
    P = out_PO.shape[0]
    T, K = pos_TK.shape
    if P == 0:
        return out_PO.new_zeros(T, K, out_PO.shape[1])
    rows = out_PO.index_select(0, pos_TK.reshape(-1).clamp(max=P - 1))
    rows = rows.view(T, K, out_PO.shape[1])
    return rows.masked_fill_((pos_TK == P).unsqueeze(-1), 0.0)


def _row_weights_P(weights_TK: torch.Tensor | None, tk_P: torch.Tensor) -> torch.Tensor | None:
    if weights_TK is None:
        return None
    return F.pad(weights_TK.reshape(-1), (0, 1))[tk_P]


# ---------------------------------------------------------------- public op 1: gather + GEMM


@torch.library.custom_op("mixmoe::gather_grouped_linear", mutates_args=())
def gather_grouped_linear(
    x_TI: torch.Tensor,
    token_P: torch.Tensor,
    pos_TK: torch.Tensor,
    w_SIO: torch.Tensor,
    b_SO: torch.Tensor | None,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``y_PO``: the padded block layout of ``x_TI[token_P] @ w[slot] + b[slot]`` (masked rows
    zero). ``pos_TK`` (the inverse map) is only used by the backward pass, to sum each token's
    K row gradients in a fixed order."""
    return grouped_linear(
        _gather_any_pad(x_TI, token_P), w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size
    )


@gather_grouped_linear.register_fake
def _(x_TI, token_P, pos_TK, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size):
    dtype = torch.promote_types(x_TI.dtype, w_SIO.dtype)
    return x_TI.new_empty(token_P.shape[0], w_SIO.shape[2], dtype=dtype)


@gather_grouped_linear.register_kernel("cuda")
def gather_grouped_linear_triton(
    x_TI, token_P, pos_TK, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size, *, config=None
):
    from mixmoe import kernels

    return kernels.grouped_gemm(
        x_TI,
        w_SIO,
        b_SO,
        block_slot_Nb,
        block_rows_Nb,
        block_size=block_size,
        row_index_P=token_P,
        config=config,
    )


def _gather_setup_context(ctx, inputs, output) -> None:
    x_TI, token_P, pos_TK, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size = inputs
    ctx.save_for_backward(x_TI, token_P, pos_TK, w_SIO, block_slot_Nb, block_rows_Nb)
    ctx.block_size = block_size
    ctx.with_bias = b_SO is not None


def _gather_backward(ctx, dy_PO):
    x_TI, token_P, pos_TK, w_SIO, block_slot_Nb, block_rows_Nb = ctx.saved_tensors
    B = ctx.block_size
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx, _ = _grouped_linear_combine(
            dy_PO, w_SIO.transpose(1, 2), None, block_slot_Nb, block_rows_Nb, B, pos_TK, None
        )
        dx = dx.to(x_TI.dtype)
    if ctx.needs_input_grad[3] or (ctx.with_bias and ctx.needs_input_grad[4]):
        dw, db = gathered_weight_grad(  # x in the forward's dtype: dw comes back in x's dtype
            x_TI.to(torch.promote_types(x_TI.dtype, w_SIO.dtype)),
            token_P,
            dy_PO,
            None,
            None,
            block_slot_Nb,
            block_rows_Nb,
            w_SIO.shape[0],
            B,
            ctx.with_bias,
        )
        dw = dw.to(w_SIO.dtype)
        db = db.to(w_SIO.dtype) if ctx.with_bias else None
    return dx, None, None, dw, db, None, None, None


gather_grouped_linear.register_autograd(_gather_backward, setup_context=_gather_setup_context)


# ---------------------------------------------------------------- public op 2: GEMM + combine


@torch.library.custom_op("mixmoe::grouped_linear_combine", mutates_args=())
def _grouped_linear_combine(
    h_PI: torch.Tensor,
    w_SIO: torch.Tensor,
    b_SO: torch.Tensor | None,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    block_size: int,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y_TO, rows_RO)``: the combined output and the unweighted choice rows
    ``out[pos_TK[t, k]]`` in token-choice order (zero for dropped choices; saved for the weight
    gradient). ``weights_TK=None`` means unit weights."""
    out_PO = grouped_linear(h_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size)
    rows_TKO = _choice_rows(out_PO, pos_TK)
    if weights_TK is None:
        y_TO = rows_TKO.sum(dim=1)
    else:  # combine_rows' arithmetic, on the rows gathered once
        y_TO = (rows_TKO * weights_TK.unsqueeze(-1).to(rows_TKO.dtype)).sum(dim=1)
    return y_TO, rows_TKO.reshape(-1, out_PO.shape[1])


@_grouped_linear_combine.register_fake
def _(h_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size, pos_TK, weights_TK):
    T, K = pos_TK.shape
    dtype = torch.promote_types(h_PI.dtype, w_SIO.dtype)
    O = w_SIO.shape[2]
    return h_PI.new_empty(T, O, dtype=dtype), h_PI.new_empty(T * K, O, dtype=dtype)


@_grouped_linear_combine.register_kernel("cuda")
def grouped_linear_combine_triton(
    h_PI,
    w_SIO,
    b_SO,
    block_slot_Nb,
    block_rows_Nb,
    block_size,
    pos_TK,
    weights_TK,
    *,
    config=None,
):
    from mixmoe import kernels

    T, K = pos_TK.shape
    P = h_PI.shape[0]
    rows_RO = kernels.grouped_gemm(
        h_PI,
        w_SIO,
        b_SO,
        block_slot_Nb,
        block_rows_Nb,
        block_size=block_size,
        out_index_P=choice_of_row_P(pos_TK, P),
        num_out_rows=T * K,
        config=config,
    )
    y_TO = kernels.combine_choices(
        rows_RO, pos_TK, weights_TK, num_padded_rows=P, clear_dropped=True
    )
    return y_TO, rows_RO


def _combine_setup_context(ctx, inputs, output) -> None:
    h_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size, pos_TK, weights_TK = inputs
    _, rows_RO = output
    ctx.mark_non_differentiable(rows_RO)
    ctx.save_for_backward(h_PI, w_SIO, block_slot_Nb, block_rows_Nb, pos_TK, weights_TK, rows_RO)
    ctx.block_size = block_size
    ctx.with_bias = b_SO is not None


def _combine_backward(ctx, dy_TO, _unused_rows_grad):
    h_PI, w_SIO, block_slot_Nb, block_rows_Nb, pos_TK, weights_TK, rows_RO = ctx.saved_tensors
    B, P = ctx.block_size, h_PI.shape[0]
    T, K = pos_TK.shape
    tk_P = choice_of_row_P(pos_TK, P)
    token_P = torch.div(tk_P, max(K, 1), rounding_mode="floor")  # padding: T*K // K = T
    scale_P = _row_weights_P(weights_TK, tk_P)
    dh = dw = db = dweights = None
    if ctx.needs_input_grad[0]:
        dh = scaled_gather_grouped_linear(
            dy_TO, token_P, scale_P, w_SIO.transpose(1, 2), block_slot_Nb, block_rows_Nb, B
        ).to(h_PI.dtype)
    if ctx.needs_input_grad[1] or (ctx.with_bias and ctx.needs_input_grad[2]):
        dw, db = gathered_weight_grad(  # h in the forward's dtype: dw comes back in h's dtype
            h_PI.to(torch.promote_types(h_PI.dtype, w_SIO.dtype)),
            None,
            dy_TO,
            token_P,
            scale_P,
            block_slot_Nb,
            block_rows_Nb,
            w_SIO.shape[0],
            B,
            ctx.with_bias,
        )
        dw = dw.to(w_SIO.dtype)
        db = db.to(w_SIO.dtype) if ctx.with_bias else None
    if weights_TK is not None and ctx.needs_input_grad[7]:
        dweights = combine_weights_grad(dy_TO, rows_RO, pos_TK, P).to(weights_TK.dtype)
    return dh, dw, db, None, None, None, None, dweights


_grouped_linear_combine.register_autograd(_combine_backward, setup_context=_combine_setup_context)


def grouped_linear_combine(
    h_PI: torch.Tensor,
    w_SIO: torch.Tensor,
    b_SO: torch.Tensor | None,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    block_size: int,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
) -> torch.Tensor:
    """``y_TO[t] = sum_k weights_TK[t, k] * (h_PI @ w[slot] + b[slot])[pos_TK[t, k]]``, summed
    over k = 0..K-1 in order (dropped choices, ``pos_TK == P``, contribute nothing).
    ``weights_TK=None``: unit weights (with K = 1, the output rows in the order ``pos_TK`` names).
    Differentiable in ``h_PI``, ``w_SIO``, ``b_SO`` and ``weights_TK``; dtype ``promote(h, w)``."""
    y_TO, _ = _grouped_linear_combine(
        h_PI, w_SIO, b_SO, block_slot_Nb, block_rows_Nb, block_size, pos_TK, weights_TK
    )
    return y_TO


# ---------------------------------------------------------------- internal ops (backward only)


@torch.library.custom_op("mixmoe::scaled_gather_grouped_linear", mutates_args=())
def scaled_gather_grouped_linear(
    x_TI: torch.Tensor,
    token_P: torch.Tensor,
    scale_P: torch.Tensor | None,
    w_SIO: torch.Tensor,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``y_PO = (scale_P * x_TI[token_P]) @ w[slot]`` (no bias, masked rows zero). Not
    differentiable: backward passes only."""
    x_PI = _gather_any_pad(x_TI, token_P)
    if scale_P is not None:
        x_PI.mul_(scale_P.unsqueeze(-1).to(x_PI.dtype))
    return grouped_linear(x_PI, w_SIO, None, block_slot_Nb, block_rows_Nb, block_size)


@scaled_gather_grouped_linear.register_fake
def _(x_TI, token_P, scale_P, w_SIO, block_slot_Nb, block_rows_Nb, block_size):
    dtype = torch.promote_types(x_TI.dtype, w_SIO.dtype)
    return x_TI.new_empty(token_P.shape[0], w_SIO.shape[2], dtype=dtype)


@scaled_gather_grouped_linear.register_kernel("cuda")
def scaled_gather_grouped_linear_triton(
    x_TI, token_P, scale_P, w_SIO, block_slot_Nb, block_rows_Nb, block_size, *, config=None
):
    from mixmoe import kernels

    return kernels.grouped_gemm(
        x_TI,
        w_SIO,
        None,
        block_slot_Nb,
        block_rows_Nb,
        block_size=block_size,
        row_index_P=token_P,
        row_scale_P=scale_P,
        config=config,
    )


@torch.library.custom_op("mixmoe::gathered_weight_grad", mutates_args=())
def gathered_weight_grad(
    x: torch.Tensor,
    x_index_P: torch.Tensor | None,
    dy: torch.Tensor,
    dy_index_P: torch.Tensor | None,
    dy_scale_P: torch.Tensor | None,
    block_slot_Nb: torch.Tensor,
    block_rows_Nb: torch.Tensor,
    num_slots: int,
    block_size: int,
    with_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mixmoe::grouped_weight_grad`` of ``x[x_index_P]`` and ``dy_scale_P * dy[dy_index_P]``
    (each index optional: without it the operand is already padded)."""
    # the CPU weight gradient reads valid rows only: padding rows need no zeroing
    x_PI = x if x_index_P is None else _gather_any_pad(x, x_index_P)
    dy_PO = dy if dy_index_P is None else _gather_any_pad(dy, dy_index_P)
    if dy_scale_P is not None:
        scale = dy_scale_P.unsqueeze(-1).to(dy_PO.dtype)
        dy_PO = dy_PO.mul_(scale) if dy_index_P is not None else dy_PO * scale
    return slot_weight_grad(
        x_PI, dy_PO, block_slot_Nb, block_rows_Nb, num_slots, block_size, with_bias
    )


@gathered_weight_grad.register_fake
def _(
    x,
    x_index_P,
    dy,
    dy_index_P,
    dy_scale_P,
    block_slot_Nb,
    block_rows_Nb,
    num_slots,
    block_size,
    with_bias,
):
    return (
        x.new_empty(num_slots, x.shape[1], dy.shape[1]),
        dy.new_empty(num_slots, dy.shape[1] if with_bias else 0),
    )


@gathered_weight_grad.register_kernel("cuda")
def gathered_weight_grad_triton(
    x,
    x_index_P,
    dy,
    dy_index_P,
    dy_scale_P,
    block_slot_Nb,
    block_rows_Nb,
    num_slots,
    block_size,
    with_bias,
    *,
    config=None,
):
    from mixmoe import kernels

    return kernels.grouped_weight_grad(
        x,
        dy,
        block_slot_Nb,
        block_rows_Nb,
        num_slots=num_slots,
        block_size=block_size,
        with_bias=with_bias,
        x_index_P=x_index_P,
        dy_index_P=dy_index_P,
        dy_scale_P=dy_scale_P,
        config=config,
    )


@torch.library.custom_op("mixmoe::combine_weights_grad", mutates_args=())
def combine_weights_grad(
    dy_TO: torch.Tensor, rows_RO: torch.Tensor, pos_TK: torch.Tensor, num_padded_rows: int
) -> torch.Tensor:
    """``dweights_TK``: ``dy_TO[t] . rows_RO[t * K + k]``, 0 for dropped choices; accumulated and
    returned in float32 (float64 for float64 inputs: no precision lost below the inputs')."""
    T, K = pos_TK.shape
    acc = _weights_grad_dtype(dy_TO.dtype)
    dots_TK = torch.bmm(
        rows_RO.view(T, K, rows_RO.shape[1]).to(acc), dy_TO.to(acc).unsqueeze(-1)
    ).squeeze(-1)
    return torch.where(pos_TK < num_padded_rows, dots_TK, 0.0)


def _weights_grad_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@combine_weights_grad.register_fake
def _(dy_TO, rows_RO, pos_TK, num_padded_rows):
    return dy_TO.new_empty(pos_TK.shape, dtype=_weights_grad_dtype(dy_TO.dtype))


@combine_weights_grad.register_kernel("cuda")
def combine_weights_grad_triton(dy_TO, rows_RO, pos_TK, num_padded_rows):
    from mixmoe import kernels

    return kernels.combine_weights_grad(dy_TO, rows_RO, pos_TK, num_padded_rows=num_padded_rows)
