"""Differentiable ops over the block layout: ``grouped_linear``, ``expert_mlp`` and the row
movement ops, against dense per-row loops and ``torch.autograd.gradcheck`` in float64.

Legend: G segments, S slots, Nb blocks, B block size, P padded rows, I/O in/out features,
D model dim, F hidden dim, T tokens, K top-k.
"""

from __future__ import annotations

import pytest
import torch
from _unit_helpers import seed_for
from torch.autograd import gradcheck
from torch.testing import assert_close

from mixmoe.ops import combine_rows, gather_rows, grouped_linear, grouped_weight_grad
from mixmoe.ops.expert_mlp import ExpertWeights, expert_mlp
from mixmoe.ops.grouped_linear import _row_pieces
from mixmoe.schedule.blocks import build_block_schedule

# Segments with empty ones (0), partial blocks (3, 6 with B=4), a full block (4), and a slot
# used by two non-adjacent segments (slot 1) so that one slot has several runs of blocks.
COUNTS = [3, 0, 6, 4, 0, 2]
SLOTS = [1, 0, 2, 1, 3, 0]
NUM_SLOTS = 4


def random_schedule(seed: int, block_size: int = 4):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (6,), generator=g)
    counts[torch.randint(1, 6, (2,), generator=g)] = 0  # at least one empty segment
    counts[0] = block_size + 1  # at least one full and one partial block
    slots = torch.randint(0, NUM_SLOTS, (6,), generator=g)
    return build_block_schedule(counts, slots, block_size=block_size)


def fixed_schedule(block_size: int = 4):
    return build_block_schedule(torch.tensor(COUNTS), torch.tensor(SLOTS), block_size=block_size)


def dense_grouped_linear(x_PI, w_SIO, b_SO, s):
    """Row by row: y[p] = x[p] @ w[slot(p)] + b[slot(p)] on valid rows, 0 on masked rows."""
    y = torch.zeros(x_PI.shape[0], w_SIO.shape[2], dtype=x_PI.dtype)
    for p in range(x_PI.shape[0]):
        if s.src_P[p] < 0:
            continue
        slot = int(s.block_slot_Nb[p // s.block_size])
        y[p] = x_PI[p] @ w_SIO[slot] + (b_SO[slot] if b_SO is not None else 0)
    return y


def gl(x, w, b, s):
    return grouped_linear(x, w, b, s.block_slot_Nb, s.block_rows_Nb, s.block_size)


# ---------------------------------------------------------------- grouped_linear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_grouped_linear_matches_dense_loop(bias, block_size):
    torch.manual_seed(seed_for("gl-dense", bias, block_size))
    s = fixed_schedule(block_size)
    x = torch.randn(s.num_padded_rows, 5, dtype=torch.float64)
    w = torch.randn(NUM_SLOTS, 5, 7, dtype=torch.float64)
    b = torch.randn(NUM_SLOTS, 7, dtype=torch.float64) if bias else None
    assert_close(gl(x, w, b, s), dense_grouped_linear(x, w, b, s))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_linear_gradcheck(bias, seed):
    torch.manual_seed(seed_for("gl-gradcheck", bias, seed))
    s = random_schedule(seed)
    x = torch.randn(s.num_padded_rows, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(NUM_SLOTS, 3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(NUM_SLOTS, 4, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (x, w, b) if bias else (x, w)
    fn = (lambda x, w, b: gl(x, w, b, s)) if bias else (lambda x, w: gl(x, w, None, s))
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


def test_grouped_linear_gradcheck_fixed_schedule():
    """Empty segments, partial blocks and a slot with two runs, all at once."""
    torch.manual_seed(seed_for("gl-gradcheck-fixed"))
    s = fixed_schedule(4)
    assert (s.block_rows_Nb < 4).any() and 0 in COUNTS
    x = torch.randn(s.num_padded_rows, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(NUM_SLOTS, 3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(NUM_SLOTS, 4, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda x, w, b: gl(x, w, b, s), (x, w, b), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "needs",
    [(True, False, False), (False, True, False), (False, False, True), (False, True, True)],
    ids=["x-only", "w-only", "b-only", "frozen-input"],
)
def test_grouped_linear_grads_of_some_inputs(needs):
    """Backward with only some inputs requiring grad (frozen experts, a fixed input): those
    gradients equal the full backward's, the others stay None."""
    torch.manual_seed(seed_for("gl-some-grads", *needs))
    s = fixed_schedule(4)
    x = torch.randn(s.num_padded_rows, 3, dtype=torch.float64)
    w = torch.randn(NUM_SLOTS, 3, 4, dtype=torch.float64)
    b = torch.randn(NUM_SLOTS, 4, dtype=torch.float64)
    dy = torch.randn(s.num_padded_rows, 4, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (x, w, b)]
    gl(*full, s).backward(dy)
    some = [t.clone().requires_grad_(n) for t, n in zip((x, w, b), needs, strict=True)]
    gl(*some, s).backward(dy)
    for t, ref, n in zip(some, full, needs, strict=True):
        if n:
            assert_close(t.grad, ref.grad)
        else:
            assert t.grad is None


def test_grouped_linear_grads_of_unused_slot_and_masked_rows_are_zero():
    torch.manual_seed(seed_for("gl-zero-grads"))
    s = fixed_schedule(4)  # slot 3 only has an empty segment
    x = torch.randn(s.num_padded_rows, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(NUM_SLOTS, 5, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(NUM_SLOTS, 6, dtype=torch.float64, requires_grad=True)
    gl(x, w, b, s).backward(torch.randn(s.num_padded_rows, 6, dtype=torch.float64))
    assert torch.equal(w.grad[3], torch.zeros_like(w.grad[3]))
    assert torch.equal(b.grad[3], torch.zeros_like(b.grad[3]))
    masked = s.src_P < 0
    assert masked.any()
    assert torch.equal(x.grad[masked], torch.zeros_like(x.grad[masked]))


def test_grouped_linear_masked_rows_ignore_finite_garbage():
    """Padded input rows hold garbage: outputs there are exactly 0, and nothing else changes."""
    torch.manual_seed(seed_for("gl-garbage"))
    s = fixed_schedule(4)
    masked = s.src_P < 0
    x = torch.randn(s.num_padded_rows, 5, dtype=torch.float64)
    x_garbage = x.clone()
    x_garbage[masked] = torch.randn(int(masked.sum()), 5, dtype=torch.float64) * 1e6
    w = torch.randn(NUM_SLOTS, 5, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(NUM_SLOTS, 6, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(s.num_padded_rows, 6, dtype=torch.float64)

    grads = []
    for inp in (x, x_garbage):
        inp = inp.clone().requires_grad_()
        w.grad = b.grad = None
        y = gl(inp, w, b, s)
        assert torch.equal(y[masked], torch.zeros_like(y[masked]))
        y.backward(dy)
        assert torch.equal(inp.grad[masked], torch.zeros_like(inp.grad[masked]))
        grads.append((y.detach(), w.grad.clone(), b.grad.clone()))
    for clean, dirty in zip(grads[0], grads[1], strict=True):
        assert_close(dirty, clean)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_grouped_linear_masked_rows_ignore_nonfinite_garbage(garbage):
    torch.manual_seed(seed_for("gl-nan-garbage", garbage))
    s = fixed_schedule(4)
    masked = s.src_P < 0
    x = torch.randn(s.num_padded_rows, 5, dtype=torch.float64)
    x[masked] = garbage  # e.g. an uninitialised (torch.empty) padded buffer
    x.requires_grad_()
    w = torch.randn(NUM_SLOTS, 5, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(NUM_SLOTS, 6, dtype=torch.float64, requires_grad=True)
    y = gl(x, w, b, s)
    assert torch.equal(y[masked], torch.zeros_like(y[masked]))
    y.backward(torch.randn_like(y))
    assert torch.isfinite(w.grad).all() and torch.isfinite(b.grad).all()
    assert torch.equal(x.grad[masked], torch.zeros_like(x.grad[masked]))


def _valid_row_runs(s) -> list[tuple[int, int, int]]:
    """Row by row: (slot, first row, length) of each maximal run of consecutive valid rows of one
    slot (padding rows end a run)."""
    runs: list[tuple[int, int, int]] = []
    for p in range(s.src_P.shape[0]):
        if s.src_P[p] < 0:
            continue
        slot = int(s.block_slot_Nb[p // s.block_size])
        if runs and runs[-1][0] == slot and runs[-1][1] + runs[-1][2] == p:
            runs[-1] = (slot, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slot, p, 1))
    return runs


def test_cpu_gemms_run_once_per_maximal_run_of_valid_rows():
    """The CPU ops do one GEMM per maximal run of valid rows (consecutive full blocks of a slot up
    to a partial block), not one per block: the pieces are exactly those runs."""
    s = fixed_schedule()  # blocks of 4: slot 1 (3 rows), 2 (4), 2 (2), 1 (4), 0 (2)
    assert _row_pieces(s.block_slot_Nb, s.block_rows_Nb, 4) == [
        (1, 0, 3),
        (2, 4, 6),
        (1, 12, 4),
        (0, 16, 2),
    ]
    s = build_block_schedule(torch.tensor([4, 5]), torch.tensor([1, 1]), block_size=4)
    assert _row_pieces(s.block_slot_Nb, s.block_rows_Nb, 4) == [(1, 0, 9)]  # 2 segments, 3 blocks
    for seed in range(4):
        for block_size in (2, 4):
            s = random_schedule(seed, block_size)
            assert _row_pieces(s.block_slot_Nb, s.block_rows_Nb, block_size) == _valid_row_runs(s)


def _rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_mixed_dtype_weight_grads_keep_the_weights_precision(bias):
    """bfloat16 ``x`` through float32 weights runs in float32, so the weight and bias gradients
    are float32 sums of products of the same values: against float64 on those values, relative
    error below 1e-5 (float32: ~1e-7; a weight gradient rounded to bfloat16: ~2e-3). ``dx``
    comes back in ``x``'s dtype, ``dw`` / ``db`` in the weights'."""
    torch.manual_seed(seed_for("gl-mixed-wgrad", bias))
    s = build_block_schedule(torch.tensor([40, 70, 9]), torch.tensor([0, 1, 0]), block_size=16)
    P, I, O = s.num_padded_rows, 64, 48
    x = torch.randn(P, I).bfloat16().requires_grad_()
    w = (torch.randn(2, I, O) * I**-0.5).requires_grad_()
    b = torch.randn(2, O).requires_grad_() if bias else None
    dy = torch.randn(P, O)
    gl(x, w, b, s).backward(dy)
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    gl(*ref, s).backward(dy.double())
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel_err(x.grad, ref[0].grad) < 1e-2  # bf16
    assert _rel_err(w.grad, ref[1].grad) < 1e-5
    if bias:
        assert b.grad.dtype == torch.float32 and _rel_err(b.grad, ref[2].grad) < 1e-5


def dense_weight_grad(x_PI, dy_PO, s, num_slots):
    """float64, row by row: dw[s] = sum of x[p]^T dy[p], db[s] = sum of dy[p] over the valid
    rows p of slot s."""
    dw = torch.zeros(num_slots, x_PI.shape[1], dy_PO.shape[1], dtype=torch.float64)
    db = torch.zeros(num_slots, dy_PO.shape[1], dtype=torch.float64)
    for p in range(x_PI.shape[0]):
        if s.src_P[p] >= 0:
            slot = int(s.block_slot_Nb[p // s.block_size])
            dw[slot] += torch.outer(x_PI[p].double(), dy_PO[p].double())
            db[slot] += dy_PO[p].double()
    return dw, db


@pytest.mark.parametrize(
    ("x_dtype", "dy_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16-x", "bf16-dy"],
)
def test_grouped_weight_grad_of_mixed_dtypes(x_dtype, dy_dtype):
    """``mixmoe::grouped_weight_grad`` of mixed inputs, as documented (and as the Triton
    launcher and the op's fake define it): multiplied in the promoted dtype, ``dw`` returned in
    ``x``'s dtype, ``db`` in ``dy``'s. Against float64 on the same values: the float32 output is
    float32-accurate (relative error < 1e-5; an operand rounded to bfloat16 first: ~2e-3), the
    bfloat16 one within bfloat16 rounding."""
    torch.manual_seed(seed_for("gwg-mixed", x_dtype, dy_dtype))
    s = build_block_schedule(torch.tensor([40, 70, 9]), torch.tensor([0, 1, 0]), block_size=16)
    P, S = s.num_padded_rows, 3  # slot 2 has no rows
    x = torch.randn(P, 64).to(x_dtype)
    dy = torch.randn(P, 48).to(dy_dtype)
    args = (x, dy, s.block_slot_Nb, s.block_rows_Nb, S, s.block_size, True)
    dw, db = grouped_weight_grad(*args)
    assert dw.dtype == x_dtype and db.dtype == dy_dtype
    for out, ref in zip((dw, db), dense_weight_grad(x, dy, s, S), strict=True):
        tol = 1e-5 if out.dtype == torch.float32 else 1e-2
        assert _rel_err(out, ref) < tol, (out.dtype, _rel_err(out, ref))
    torch.library.opcheck(grouped_weight_grad, args)


def test_grouped_linear_empty_layout():
    s = build_block_schedule(torch.tensor([0, 0]), torch.tensor([0, 1]), block_size=4)
    x = torch.randn(0, 3, requires_grad=True)
    w = torch.randn(2, 3, 4, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    y = gl(x, w, b, s)
    assert y.shape == (0, 4)
    (y.sum() + 0 * w.sum() + 0 * b.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


# ---------------------------------------------------------------- expert_mlp


def dense_expert_mlp(x_PD, weights: ExpertWeights, s, activation):
    import math

    act = {
        "relu": lambda h: torch.clamp(h, min=0),
        "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2.0))),
        "silu": lambda h: h * torch.sigmoid(h),
        "swiglu": lambda h: h * torch.sigmoid(h),
    }[activation]
    out = torch.zeros_like(x_PD)
    for p in range(x_PD.shape[0]):
        if s.src_P[p] < 0:
            continue
        g = int(s.block_slot_Nb[p // s.block_size])
        h = act(x_PD[p] @ weights.w1_SDF[g] + weights.b1_SF[g])
        if activation == "swiglu":
            h = h * (x_PD[p] @ weights.w3_SDF[g] + weights.b3_SF[g])
        out[p] = h @ weights.w2_SFD[g] + weights.b2_SD[g]
    return out


def random_expert_weights(S, D, F, activation, bias=True, requires_grad=False):
    def r(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)

    swiglu = activation == "swiglu"
    return ExpertWeights(
        w1_SDF=r(S, D, F),
        w2_SFD=r(S, F, D),
        b1_SF=r(S, F) if bias else None,
        b2_SD=r(S, D) if bias else None,
        w3_SDF=r(S, D, F) if swiglu else None,
        b3_SF=r(S, F) if swiglu and bias else None,
    )


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", "swiglu"])
def test_expert_mlp_matches_dense_loop(activation):
    torch.manual_seed(seed_for("mlp-dense", activation))
    s = fixed_schedule(4)
    x = torch.randn(s.num_padded_rows, 5, dtype=torch.float64)
    wts = random_expert_weights(NUM_SLOTS, 5, 7, activation)
    out = expert_mlp(x, wts, s, activation)
    assert_close(out, dense_expert_mlp(x, wts, s, activation))
    masked = s.src_P < 0
    assert torch.equal(out[masked], torch.zeros_like(out[masked]))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", "swiglu"])
def test_expert_mlp_gradcheck(activation, bias):
    seed = seed_for("mlp-gradcheck", activation, bias)
    torch.manual_seed(seed)
    s = random_schedule(seed % 1000)
    x = torch.randn(s.num_padded_rows, 3, dtype=torch.float64, requires_grad=True)
    wts = random_expert_weights(NUM_SLOTS, 3, 4, activation, bias=bias, requires_grad=True)
    names = [
        n
        for n in ("w1_SDF", "w2_SFD", "b1_SF", "b2_SD", "w3_SDF", "b3_SF")
        if getattr(wts, n) is not None
    ]
    tensors = tuple(getattr(wts, n) for n in names)

    def fn(x, *ts):
        return expert_mlp(x, ExpertWeights(**dict(zip(names, ts, strict=True))), s, activation)

    assert gradcheck(fn, (x, *tensors), eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------- rows


def test_gather_rows_and_combine_rows():
    torch.manual_seed(seed_for("rows"))
    T, D = 4, 3
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    token_P = torch.tensor([2, 0, T, 3, 1, T])
    x_P = gather_rows(x, token_P)
    assert torch.equal(x_P[2], torch.zeros(D, dtype=torch.float64))
    assert torch.equal(x_P[[0, 1, 3, 4]], x.detach()[[2, 0, 3, 1]])

    out_P = torch.randn(6, D, dtype=torch.float64, requires_grad=True)
    pos_TK = torch.tensor([[1, 4], [0, 6], [3, 5], [2, 6]])  # 6 == P: dropped -> zero row
    w_TK = torch.randn(T, 2, dtype=torch.float64, requires_grad=True)
    y = combine_rows(out_P, pos_TK, w_TK)
    expected = torch.stack(
        [
            w_TK[t, 0] * out_P[pos_TK[t, 0]]
            + (w_TK[t, 1] * out_P[pos_TK[t, 1]] if pos_TK[t, 1] < 6 else 0)
            for t in range(T)
        ]
    )
    assert_close(y, expected)
    assert gradcheck(lambda o, w: combine_rows(o, pos_TK, w), (out_P, w_TK))
    assert gradcheck(lambda x: gather_rows(x, token_P), (x,))


def test_combine_rows_without_weights_sums_the_chosen_rows():
    """``weights_TK=None``: unit weights (K = 2: the sum of the two chosen rows, a dropped choice
    adds nothing; K = 1: the rows in the order ``pos_TK`` names)."""
    torch.manual_seed(seed_for("rows-unit"))
    out_P = torch.randn(6, 3, dtype=torch.float64)
    pos_TK = torch.tensor([[1, 4], [0, 6], [3, 5], [2, 6]])  # 6 == P: dropped
    y = combine_rows(out_P, pos_TK, None)
    expected = torch.stack([out_P[1] + out_P[4], out_P[0], out_P[3] + out_P[5], out_P[2]])
    assert y.shape == (4, 3)
    assert_close(y, expected)
    order_T1 = torch.tensor([[5], [0], [2]])
    assert torch.equal(combine_rows(out_P, order_T1, None), out_P[[5, 0, 2]])


def test_expert_weights_are_frozen_with_optional_parts_none():
    """A layer's weights record is handed to every work item of a step: never rewritten. Only
    w1 and w2 are required; biases and w3 default to None (no bias, not SwiGLU-split)."""
    import dataclasses

    w = ExpertWeights(torch.randn(2, 4, 6), torch.randn(2, 6, 4))
    assert (w.b1_SF, w.b2_SD, w.w3_SDF, w.b3_SF) == (None, None, None, None)
    assert w.num_slots == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.b1_SF = torch.zeros(2, 6)
