"""CPU body of ``token_expert_mlp``: the whole expert MLP (gather, GEMM, activation, GEMM,
weighted K-sum) as one autograd function that walks the pieces of valid rows once.

Legend: T tokens, K top-k, D model dim, F hidden dim, P padded rows, S weight slots.

Same semantics as the fused ops (``mixmoe.ops.fused_linear``) it replaces on CPU:

    y_TD[t] = sum_{k=0..K-1} weights_TK[t, k] * mlp_{slot(p)}(x_TD[t])    p = pos_TK[t, k] < P

Why a separate body: on CPU the fused ops' composition pays for things a GPU kernel gets for free:
``x_TD`` gathered four times for SwiGLU (forward and backward of both input GEMMs), the output
gradient gathered and scaled twice, two K-combines of dx plus an add, elementwise passes over
padding rows, and a zero row padded onto tensors to read dropped choices. Here ``x_TD`` and the
scaled output gradient are gathered once, every GEMM and elementwise op touches only valid rows
(one piece per run of a slot's rows, ``_row_pieces``), dx of W1 and W3 accumulate into one
buffer, and dropped choices read one zero row kept past the last padded row. Padding rows are
never read, whatever they hold. Every reduction runs in a fixed order (deterministic).

Forward and gradients equal the reference composition up to float rounding (tests compare them
with ``assert_close`` on the shapes that take this path; ``token_expert_mlp`` routes only CPU
tensors of one dtype with a mixmoe activation here).
"""

from __future__ import annotations

import torch

from mixmoe.ops.expert_mlp import (
    ACTIVATIONS,
    ExpertWeights,
    activate,
    activate_backward,
    expert_params,
    function_inputs,
    gate_up_fits,
)
from mixmoe.ops.grouped_linear import _row_pieces
from mixmoe.schedule.blocks import BlockSchedule


def cpu_path_applies(
    x_TD: torch.Tensor, pos_TK: torch.Tensor, weights: ExpertWeights, activation: str
) -> bool:
    """True when ``cpu_token_expert_mlp`` handles this call: CPU tensors, one floating dtype for
    ``x_TD`` and every weight, a mixmoe activation, at least one token and one choice."""
    params = expert_params(weights)
    return (
        x_TD.device.type == "cpu"
        and x_TD.dtype.is_floating_point
        and all(p.device.type == "cpu" and p.dtype == x_TD.dtype for p in params)
        and activation in ACTIVATIONS
        and gate_up_fits(weights, activation)
        and x_TD.shape[0] > 0
        and pos_TK.numel() > 0
    )


def _linear_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    if b is None:
        torch.mm(x, w, out=out)
    else:
        torch.addmm(b, x, w, out=out)


def _weight_grad_into(dw_IO: torch.Tensor, x_RI: torch.Tensor, g_RO: torch.Tensor, first: bool):
    """dw = x^T g (a slot's first piece) or dw += x^T g (later pieces)."""
    if first:
        torch.mm(x_RI.t(), g_RO, out=dw_IO)
    else:
        dw_IO.addmm_(x_RI.t(), g_RO)


class _CpuTokenExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_P, pos_TK, weights_TK, w1, b1, w3, b3, w2, b2, pieces, activation):
        T, D = x_TD.shape
        P = token_P.shape[0]
        Fh = w2.shape[1]
        swiglu = activation == "swiglu"
        # swiglu with w3 None: w1 is [gate | up] ([S, D, 2F]), one GEMM computes both halves
        cat = swiglu and w3 is None
        # token_P == T (padding) reads row T - 1: padding rows are never read below
        x_PD = x_TD.index_select(0, token_P.clamp(max=T - 1))
        if cat:
            au_PF = x_TD.new_empty(P, 2 * Fh)
            a_PF, u_PF = au_PF[:, :Fh], au_PF[:, Fh:]
        else:
            a_PF = x_TD.new_empty(P, Fh)
            u_PF = x_TD.new_empty(P, Fh) if swiglu else None
        s_PF = x_TD.new_empty(P, Fh) if swiglu else None  # silu(a), kept for the backward
        h_PF = x_TD.new_empty(P, Fh)
        out_PD = x_TD.new_empty(P + 1, w2.shape[2])
        out_PD[P].zero_()  # the row every dropped choice (pos_TK == P) reads
        for s, r0, n in pieces:
            rows = slice(r0, r0 + n)
            first_out = au_PF if cat else a_PF
            _linear_into(first_out[rows], x_PD[rows], w1[s], None if b1 is None else b1[s])
            if swiglu and not cat:
                _linear_into(u_PF[rows], x_PD[rows], w3[s], None if b3 is None else b3[s])
            if swiglu:
                torch.ops.aten.silu.out(a_PF[rows], out=s_PF[rows])
                torch.mul(s_PF[rows], u_PF[rows], out=h_PF[rows])
            else:
                h_PF[rows] = activate(a_PF[rows], activation)
            _linear_into(out_PD[rows], h_PF[rows], w2[s], None if b2 is None else b2[s])
        rows_TKD = out_PD.index_select(0, pos_TK.reshape(-1)).view(T, pos_TK.shape[1], -1)
        if weights_TK is None:
            y_TD = rows_TKD.sum(dim=1)
        else:  # k = 0..K-1 in order, one pass per choice (no weighted [T, K, D] copy)
            w_TK = weights_TK.to(rows_TKD.dtype)
            y_TD = rows_TKD[:, 0] * w_TK[:, 0:1]
            for k in range(1, pos_TK.shape[1]):
                y_TD.addcmul_(rows_TKD[:, k], w_TK[:, k : k + 1])
        keep_rows = rows_TKD if weights_TK is not None else None  # for d weights_TK only
        ctx.save_for_backward(
            x_PD, token_P, pos_TK, weights_TK, w1, w3, w2, a_PF, u_PF, s_PF, h_PF, keep_rows
        )
        ctx.pieces, ctx.activation = pieces, activation
        ctx.has_bias = (b1 is not None, b3 is not None, b2 is not None)
        ctx.num_tokens = T
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        x_PD, token_P, pos_TK, weights_TK, w1, w3, w2, a_PF, u_PF, s_PF, h_PF, rows_TKD = (
            ctx.saved_tensors
        )
        need = ctx.needs_input_grad
        T, K = pos_TK.shape
        P = token_P.shape[0]
        swiglu = ctx.activation == "swiglu"
        dy_TD = dy_TD.contiguous()

        dweights_TK = None
        if weights_TK is not None and need[3]:
            acc = torch.float64 if dy_TD.dtype == torch.float64 else torch.float32
            # an elementwise product and a row sum: bmm of [K, D] x [D, 1] per token is slower
            dots_TK = (rows_TKD.to(acc) * dy_TD.to(acc).unsqueeze(1)).sum(dim=-1)
            dweights_TK = torch.where(pos_TK < P, dots_TK, 0.0).to(weights_TK.dtype)

        # g_PD[p] = weight(p) * dy_TD[token(p)]: the gradient of each valid output row
        g_PD = dy_TD.index_select(0, token_P.clamp(max=T - 1))
        if weights_TK is not None:
            scale_P = torch.ones(P + 1, dtype=weights_TK.dtype)
            scale_P.scatter_(0, pos_TK.reshape(-1), weights_TK.detach().reshape(-1))
            g_PD.mul_(scale_P[:P].unsqueeze(-1).to(g_PD.dtype))

        want_w = need[4] or need[6] or need[8]
        want_b = need[5] or need[7] or need[9]
        grads = {}
        for name, w, has_b in (("1", w1, ctx.has_bias[0]), ("3", w3, ctx.has_bias[1])) + (
            ("2", w2, ctx.has_bias[2]),
        ):
            if w is None:
                continue
            # written by each slot's first piece, accumulated by later ones (no zero pass)
            grads["w" + name] = torch.empty_like(w) if want_w else None
            grads["b" + name] = w.new_zeros(w.shape[0], w.shape[2]) if has_b and want_b else None
        dx_PD = x_PD.new_empty(P + 1, x_PD.shape[1]) if need[0] else None
        if dx_PD is not None:
            dx_PD[P].zero_()  # dropped choices read it: they get no gradient

        written: set[int] = set()
        for s, r0, n in ctx.pieces:
            rows = slice(r0, r0 + n)
            g, a = g_PD[rows], a_PF[rows]
            first = s not in written
            written.add(s)
            if want_w:
                _weight_grad_into(grads["w2"][s], h_PF[rows], g, first)
            if grads.get("b2") is not None:
                grads["b2"][s] += g.sum(dim=0)
            dh = torch.mm(g, w2[s].t())
            if swiglu:
                u = u_PF[rows]
                du = dh * s_PF[rows]
                da = torch.ops.aten.silu_backward(dh.mul_(u), a)
            else:
                du = None
                da = activate_backward(dh, a, ctx.activation)
            x = x_PD[rows]
            if w3 is None and du is not None:  # [gate | up] in one weight: one GEMM each
                da = torch.cat([da, du], dim=1)
                du = None
            if want_w:
                _weight_grad_into(grads["w1"][s], x, da, first)
            if grads.get("b1") is not None:
                grads["b1"][s] += da.sum(dim=0)
            if du is not None:
                if want_w:
                    _weight_grad_into(grads["w3"][s], x, du, first)
                if grads.get("b3") is not None:
                    grads["b3"][s] += du.sum(dim=0)
            if dx_PD is not None:
                torch.mm(da, w1[s].t(), out=dx_PD[rows])
                if du is not None:
                    dx_PD[rows].addmm_(du, w3[s].t())

        if want_w:
            for s in set(range(w1.shape[0])) - written:  # slots without rows
                for name in ("w1", "w3", "w2"):
                    if grads.get(name) is not None:
                        grads[name][s].zero_()
        dx_TD = None
        if dx_PD is not None:  # fixed-order K-sum of each token's row gradients
            dx_TD = dx_PD.index_select(0, pos_TK.reshape(-1)).view(T, K, -1).sum(dim=1)
        return (
            dx_TD,
            None,
            None,
            dweights_TK,
            grads.get("w1") if need[4] else None,
            grads.get("b1") if need[5] else None,
            grads.get("w3") if need[6] else None,
            grads.get("b3") if need[7] else None,
            grads.get("w2") if need[8] else None,
            grads.get("b2") if need[9] else None,
            None,
            None,
        )


def cpu_token_expert_mlp(
    x_TD: torch.Tensor,
    token_P: torch.Tensor,
    pos_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    weights: ExpertWeights,
    schedule: BlockSchedule,
    activation: str,
) -> torch.Tensor:
    """``token_expert_mlp``'s fused computation on CPU (check ``cpu_path_applies`` first)."""
    pieces = _row_pieces(schedule.block_slot_Nb, schedule.block_rows_Nb, schedule.block_size)
    return _CpuTokenExpertMLP.apply(
        *function_inputs(x_TD, token_P, pos_TK, weights_TK, weights),
        pieces,
        activation,
    )
