"""Every Triton kernel vs a torch reference, small shapes (interpreter on CPU, compiled on CUDA).

Outputs are poisoned (NaN) before each launch: an element the kernel should write but does not
stays NaN and fails the comparison; an element it must not touch is checked to still be NaN.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernel tier needs triton: pip install 'mixmoe[triton]'")

from mixmoe.kernels import (  # noqa: E402
    TileConfig,
    combine_choices,
    combine_weights_grad,
    grouped_gemm,
    grouped_weight_grad,
)

TINY = TileConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def _rand(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def _poison(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _valid_P(schedule) -> torch.Tensor:
    return schedule.src_P >= 0


def _ref_gemm_P(a_PI, w_SIO, b_SO, schedule, scale_P=None):
    """fp32 reference: row p uses the weights of its block's slot; masked rows are zero."""
    slot_P = schedule.block_slot_Nb.repeat_interleave(schedule.block_size)
    valid_P1 = _valid_P(schedule)[:, None]
    a_PI = torch.where(valid_P1, a_PI.float(), 0.0)
    y_PO = torch.einsum("pi,pio->po", a_PI, w_SIO.float()[slot_P])
    if scale_P is not None:
        y_PO = y_PO * scale_P.float()[:, None]
    if b_SO is not None:
        y_PO = y_PO + b_SO.float()[slot_P]
    return torch.where(valid_P1, y_PO, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["padded", "gather", "gather-scale", "scatter", "transposed"])
def test_grouped_gemm(layout_case, make_layout, mode, dtype, device, gen):
    counts, slots, T, K, B = layout_case
    schedule, token_P, pos_TK, tk_P = make_layout(counts, slots, T, K, B, gen, device)
    S, I, O = max(slots) + 2, 24, 40  # one slot has no block
    P = schedule.num_padded_rows
    meta = (schedule.block_slot_Nb, schedule.block_rows_Nb)
    w = _rand(gen, S, I, O, dtype=dtype, device=device, scale=I**-0.5)
    b = _rand(gen, S, O, dtype=dtype, device=device)
    kwargs = {}
    if mode == "transposed":  # the dX GEMM: w^T through strides, no bias
        w = _rand(gen, S, O, I, dtype=dtype, device=device, scale=I**-0.5).transpose(1, 2)
        b = None
    if mode in ("padded", "scatter", "transposed"):
        x = _rand(gen, P, I, dtype=dtype, device=device)
        x[~_valid_P(schedule)] = float("nan")  # masked rows must not be read
        x_PI = x
    else:
        x = _rand(gen, T, I, dtype=dtype, device=device)
        x_PI = torch.nn.functional.pad(x, (0, 0, 0, 1))[token_P]
        kwargs["row_index_P"] = token_P
    scale_P = None
    if mode == "gather-scale":
        scale_P = torch.rand(P, generator=gen).to(device)
        kwargs["row_scale_P"] = scale_P
    ref = _ref_gemm_P(x_PI, w, b, schedule, scale_P)

    if mode == "scatter":
        out = _poison((T * K, O), dtype, device)
        y = grouped_gemm(
            x, w, b, *meta, block_size=B, out_index_P=tk_P, num_out_rows=T * K, out=out, config=TINY
        )
        assert y is out
        valid = _valid_P(schedule)
        written = torch.zeros(T * K, dtype=torch.bool, device=device)
        written[tk_P[valid]] = True
        torch.testing.assert_close(y[tk_P[valid]].float(), ref[valid], **TOL[dtype])
        assert torch.isnan(y[~written]).all(), "rows without a source row must not be written"
    else:
        out = _poison((P, O), dtype, device)
        y = grouped_gemm(x, w, b, *meta, block_size=B, out=out, config=TINY, **kwargs)
        assert y is out and y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, **TOL[dtype])
        assert (y[~_valid_P(schedule)] == 0).all(), "masked rows must be written as zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["padded", "gather-x", "gather-scale-dy"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_weight_grad(layout_case, make_layout, mode, with_bias, dtype, device, gen):
    counts, slots, T, K, B = layout_case
    schedule, token_P, pos_TK, tk_P = make_layout(counts, slots, T, K, B, gen, device)
    S, I, O = max(slots) + 2, 24, 40
    P = schedule.num_padded_rows
    valid = _valid_P(schedule)[:, None]
    kwargs = {}
    x, dy = (
        _rand(gen, P, I, dtype=dtype, device=device),
        _rand(gen, P, O, dtype=dtype, device=device),
    )
    x_PI, dy_PO = x, dy
    if mode == "gather-x":
        x = _rand(gen, T, I, dtype=dtype, device=device)
        x_PI = torch.nn.functional.pad(x, (0, 0, 0, 1))[token_P]
        kwargs["x_index_P"] = token_P
    if mode == "gather-scale-dy":
        dy = _rand(gen, T, O, dtype=dtype, device=device)
        scale_P = torch.rand(P, generator=gen).to(device)
        dy_PO = (torch.nn.functional.pad(dy, (0, 0, 0, 1))[token_P] * scale_P[:, None]).to(dtype)
        kwargs.update(dy_index_P=token_P, dy_scale_P=scale_P)
    # masked rows must not be read (NaN would poison the sums)
    if "x_index_P" not in kwargs:
        x = torch.where(valid, x, float("nan"))
    if "dy_index_P" not in kwargs:
        dy = torch.where(valid, dy, float("nan"))
    x_PI = torch.where(valid, x_PI.float(), 0.0)
    dy_PO = torch.where(valid, dy_PO.float(), 0.0)
    slot_P = schedule.block_slot_Nb.repeat_interleave(B)
    ref_dw = torch.zeros(S, I, O, device=device).index_add_(
        0, slot_P, x_PI[:, :, None] * dy_PO[:, None, :]
    )
    ref_db = torch.zeros(S, O, device=device).index_add_(0, slot_P, dy_PO)

    out = (_poison((S, I, O), dtype, device), _poison((S, O if with_bias else 0), dtype, device))
    dw, db = grouped_weight_grad(
        x,
        dy,
        schedule.block_slot_Nb,
        schedule.block_rows_Nb,
        num_slots=S,
        block_size=B,
        with_bias=with_bias,
        out=out,
        config=TINY,
        **kwargs,
    )
    assert dw is out[0] and db is out[1]
    tol = TOL[dtype] if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-1}
    torch.testing.assert_close(dw.float(), ref_dw, **tol)
    assert (dw[S - 1] == 0).all(), "a slot without blocks gets zero gradient"
    if with_bias:
        torch.testing.assert_close(db.float(), ref_db, **tol)
    else:
        assert db.shape == (S, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_choices(layout_case, make_layout, weighted, dtype, device, gen):
    counts, slots, T, K, B = layout_case
    schedule, token_P, pos_TK, tk_P = make_layout(counts, slots, T, K, B, gen, device)
    P, O = schedule.num_padded_rows, 40
    rows = _rand(gen, T * K, O, dtype=dtype, device=device)
    dropped = (pos_TK >= P).reshape(-1)
    rows[dropped] = float("nan")  # never written by the GEMM: must not be read
    weights = torch.rand(T, K, generator=gen).to(device) if weighted else None
    ref = torch.where(dropped[:, None], 0.0, rows.float()).view(T, K, O)
    ref = (ref * (weights[:, :, None] if weighted else 1.0)).sum(dim=1)
    out = _poison((T, O), dtype, device)
    y = combine_choices(
        rows,
        pos_TK,
        weights,
        num_padded_rows=P,
        clear_dropped=True,
        out=out,
        block_t=16,
        block_o=16,
    )
    assert y is out
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    assert (rows[dropped] == 0).all(), "clear_dropped zeroes the rows of dropped choices"


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_weights_grad(layout_case, make_layout, dtype, device, gen):
    counts, slots, T, K, B = layout_case
    schedule, token_P, pos_TK, tk_P = make_layout(counts, slots, T, K, B, gen, device)
    P, O = schedule.num_padded_rows, 40
    rows = _rand(gen, T * K, O, dtype=dtype, device=device)
    dropped = (pos_TK >= P).reshape(-1)
    rows[dropped] = float("nan")
    dy = _rand(gen, T, O, dtype=dtype, device=device)
    ref = (
        torch.where(dropped[:, None], 0.0, rows.float()).view(T, K, O) * dy.float()[:, None]
    ).sum(-1)
    out = _poison((T, K), torch.float32, device)
    dw = combine_weights_grad(dy, rows, pos_TK, num_padded_rows=P, out=out, block_t=16, block_o=16)
    assert dw is out
    torch.testing.assert_close(dw, ref, **TOL[dtype])


def check_combine_weights_grad_wide_bf16(T, K, P, gen, device, **launch) -> None:
    """bf16 ``dy``/``rows`` at width O = 4096: the fp32 accumulation of the dot products is within
    1e-4 (relative, Frobenius) of the float64 dot products of the same bf16 values; a bf16 product
    or partial sum is off by ~1e-3 or more. ``pos`` drops about one choice in eight."""
    O = 4096
    pos_TK = torch.randint(0, P, (T, K), generator=gen)
    pos_TK[torch.rand(T, K, generator=gen) < 0.125] = P
    rows = _rand(gen, T * K, O, dtype=torch.bfloat16, device=device)
    dy = _rand(gen, T, O, dtype=torch.bfloat16, device=device)
    pos_TK = pos_TK.to(device)
    dropped = (pos_TK >= P).reshape(-1, 1)
    truth = (torch.where(dropped, 0.0, rows.double()).view(T, K, O) * dy.double().unsqueeze(1)).sum(
        -1
    )
    dw = combine_weights_grad(dy, rows, pos_TK, num_padded_rows=P, **launch)
    assert dw.dtype == torch.float32
    err = ((dw.double() - truth).norm() / truth.norm()).item()
    assert err < 1e-4, f"combine weight gradient relative error {err:.3g} (fp32 gives ~1e-7)"


def test_combine_weights_grad_accumulates_in_fp32_at_width_4096(device, gen):
    # few rows: the interpreter walks the 4096 columns in block_o steps
    check_combine_weights_grad_wide_bf16(16, 2, 40, gen, device, block_t=16, block_o=256)


def test_combine_is_deterministic(make_layout, device, gen):
    schedule, _, pos_TK, _ = make_layout([30, 7], [0, 1], 20, 2, 16, gen, device)
    rows = _rand(gen, 40, 48, dtype=torch.float32, device=device)
    w = torch.rand(20, 2, generator=gen).to(device)
    P = schedule.num_padded_rows
    a = combine_choices(rows, pos_TK, w, num_padded_rows=P)
    b = combine_choices(rows, pos_TK, w, num_padded_rows=P)
    assert torch.equal(a, b)
    # the fixed order is k = 0, 1: the same fp32 arithmetic written out
    valid = (pos_TK < P).float()
    r = rows.view(20, 2, 48)
    expect = (0.0 + (w[:, 0] * valid[:, 0])[:, None] * r[:, 0]) + (w[:, 1] * valid[:, 1])[
        :, None
    ] * r[:, 1]
    torch.testing.assert_close(a, expect, rtol=0, atol=1e-6)


def test_fp16_and_mixed_dtypes(make_layout, device, gen):
    schedule, token_P, _, _ = make_layout([20, 5], [0, 1], 25, 1, 16, gen, device)
    meta = (schedule.block_slot_Nb, schedule.block_rows_Nb)
    x = _rand(gen, 25, 32, dtype=torch.float16, device=device)
    w = _rand(gen, 2, 32, 16, dtype=torch.float16, device=device, scale=32**-0.5)
    x_PI = torch.nn.functional.pad(x, (0, 0, 0, 1))[token_P]
    y = grouped_gemm(x, w, None, *meta, block_size=16, row_index_P=token_P, config=TINY)
    torch.testing.assert_close(
        y.float(), _ref_gemm_P(x_PI, w, None, schedule), rtol=2e-3, atol=2e-3
    )
    # bf16 rows with fp32 weights (autocast-style): computed in the promoted dtype, fp32
    y = grouped_gemm(
        x.bfloat16(), w.float(), None, *meta, block_size=16, row_index_P=token_P, config=TINY
    )
    assert y.dtype == torch.float32


def test_empty_schedule(device):
    e = torch.empty(0, dtype=torch.int64, device=device)
    w = torch.randn(3, 8, 16, device=device)
    y = grouped_gemm(torch.randn(0, 8, device=device), w, None, e, e, block_size=64)
    assert y.shape == (0, 16)
    dw, db = grouped_weight_grad(
        torch.randn(0, 8, device=device),
        torch.randn(0, 16, device=device),
        e,
        e,
        num_slots=3,
        block_size=64,
        with_bias=True,
        config=TINY,
    )
    assert (dw == 0).all() and (db == 0).all()


def test_launchers_reject_bad_calls(device):
    idx = torch.zeros(1, dtype=torch.int64, device=device)
    w = torch.randn(2, 8, 16, device=device)
    with pytest.raises(ValueError, match="block_size"):
        grouped_gemm(torch.randn(48, 8, device=device), w, None, idx, idx + 1, block_size=48)
    with pytest.raises(ValueError, match="padded layout"):
        grouped_gemm(torch.randn(10, 8, device=device), w, None, idx, idx + 1, block_size=64)
    with pytest.raises(ValueError, match="features"):
        grouped_gemm(torch.randn(64, 9, device=device), w, None, idx, idx + 1, block_size=64)
    with pytest.raises(ValueError, match="out must be"):
        grouped_gemm(
            torch.randn(64, 8, device=device),
            w,
            None,
            idx,
            idx + 1,
            block_size=64,
            out=torch.empty(64, 15, device=device),
        )
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        grouped_gemm(
            torch.ones(64, 8, dtype=torch.int32, device=device),
            w,
            None,
            idx,
            idx + 1,
            block_size=64,
        )
    with pytest.raises(ValueError, match="go together"):
        grouped_gemm(
            torch.randn(64, 8, device=device),
            w,
            None,
            idx,
            idx + 1,
            block_size=64,
            out_index_P=torch.zeros(64, dtype=torch.int64, device=device),
        )
    with pytest.raises(ValueError, match="T\\*K"):
        combine_choices(
            torch.randn(5, 4, device=device),
            torch.zeros(3, 2, dtype=torch.int64, device=device),
            None,
            num_padded_rows=64,
        )


@pytest.mark.parametrize("autotune", ["0", "1"])
def test_launch_without_config(make_layout, device, gen, monkeypatch, autotune):
    """Without ``config`` the launchers take ``default_tiles`` (``MIXMOE_AUTOTUNE=0``, the
    default) or autotune (``=1``; configs pruned to the block size): same numbers either way."""
    monkeypatch.setenv("MIXMOE_AUTOTUNE", autotune)
    schedule, token_P, _, _ = make_layout([5, 20], [0, 1], 25, 1, 16, gen, device)
    meta = (schedule.block_slot_Nb, schedule.block_rows_Nb)
    x = _rand(gen, 25, 8, dtype=torch.float32, device=device)
    w = _rand(gen, 2, 8, 16, dtype=torch.float32, device=device)
    y = grouped_gemm(x, w, None, *meta, block_size=16, row_index_P=token_P)
    x_PI = torch.nn.functional.pad(x, (0, 0, 0, 1))[token_P]
    torch.testing.assert_close(y, _ref_gemm_P(x_PI, w, None, schedule), **TOL[torch.float32])
    dy = _rand(gen, schedule.num_padded_rows, 16, dtype=torch.float32, device=device)
    dw, db = grouped_weight_grad(
        x, dy, *meta, num_slots=2, block_size=16, with_bias=True, x_index_P=token_P
    )
    valid = _valid_P(schedule)[:, None]
    slot_P = schedule.block_slot_Nb.repeat_interleave(16)
    dyv = torch.where(valid, dy, 0.0)
    ref = torch.zeros(2, 8, 16, device=device).index_add_(
        0, slot_P, x_PI[:, :, None] * dyv[:, None, :]
    )
    torch.testing.assert_close(dw, ref, **TOL[torch.float32])


def test_default_tiles_and_autotune_switch(monkeypatch):
    from mixmoe.kernels.launch import autotune_enabled, default_tiles

    monkeypatch.delenv("MIXMOE_AUTOTUNE", raising=False)
    assert not autotune_enabled()
    for value, expected in (("1", True), ("on", True), ("0", False), ("no", False)):
        monkeypatch.setenv("MIXMOE_AUTOTUNE", value)
        assert autotune_enabled() is expected
    monkeypatch.setenv("MIXMOE_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="MIXMOE_AUTOTUNE='maybe'"):
        autotune_enabled()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for block_size in (16, 32, 64, 128, 256):
            gemm = default_tiles("gemm", dtype, block_size)
            assert gemm.block_m <= block_size  # a tile never straddles two blocks
            dw = default_tiles("weight_grad", dtype, block_size)
            assert dw.block_k <= block_size  # the reduction step stays inside one block
    with pytest.raises(ValueError, match="'dx'"):
        default_tiles("dx", torch.float32, 64)
