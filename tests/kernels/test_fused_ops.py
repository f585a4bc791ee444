"""The ops that fuse row movement into the grouped GEMMs (``mixmoe.ops.fused_linear``).

CPU (no Triton needed): their forward is the reference composition bit for bit, their autograd
matches the composition's, they pass ``torch.library.opcheck`` and ``torch.compile``, and
``token_expert_mlp`` runs them by default (``fused=False`` is the reference composition).
Triton path (interpreter on CPU, compiled on CUDA): every op's Triton implementation against its
torch implementation, and whole forward/backward passes (fused expert MLP, MoE layer) run through
the Triton implementations against the plain CPU path.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mixmoe.config import MoEConfig
from mixmoe.layers.moe import MoE
from mixmoe.ops.expert_mlp import ExpertWeights, expert_mlp
from mixmoe.ops.fused_linear import (
    _grouped_linear_combine,
    combine_weights_grad,
    gather_grouped_linear,
    gathered_weight_grad,
    grouped_linear_combine,
    scaled_gather_grouped_linear,
)
from mixmoe.ops.grouped_linear import grouped_linear, grouped_weight_grad
from mixmoe.ops.rows import combine_rows, gather_rows
from mixmoe.ops.token_expert_mlp import token_expert_mlp


def _setup(make_layout, case, gen, dtype=torch.float32, device="cpu", bias=True, I=24, O=40):
    counts, slots, T, K, B = case
    schedule, token_P, pos_TK, tk_P = make_layout(counts, slots, T, K, B, gen, device)
    S = max(slots) + 2

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device).requires_grad_()

    return {
        "schedule": schedule,
        "token_P": token_P,
        "pos_TK": pos_TK,
        "T": T,
        "K": K,
        "B": B,
        "x": rand(T, I),
        "h": rand(schedule.num_padded_rows, I),
        "w": rand(S, I, O, scale=I**-0.5),
        "b": rand(S, O) if bias else None,
        "weights": torch.rand(T, K, generator=gen).to(device).requires_grad_(),
    }


def _meta(c):
    s = c["schedule"]
    return s.block_slot_Nb, s.block_rows_Nb, s.block_size


def _grads(out, inputs, gen):
    dy = torch.randn(out.shape, generator=gen).to(out.dtype).to(out.device)
    return torch.autograd.grad(out, [t for t in inputs if t is not None], dy)


# ---------------------------------------------------------------- CPU semantics


def test_forward_is_the_reference_composition(layout_case, make_layout, gen):
    c = _setup(make_layout, layout_case, gen)
    with torch.no_grad():
        y = gather_grouped_linear(c["x"], c["token_P"], c["pos_TK"], c["w"], c["b"], *_meta(c))
        ref = grouped_linear(gather_rows(c["x"], c["token_P"]), c["w"], c["b"], *_meta(c))
        assert torch.equal(y, ref)
        y = grouped_linear_combine(c["h"], c["w"], c["b"], *_meta(c), c["pos_TK"], c["weights"])
        ref = combine_rows(
            grouped_linear(c["h"], c["w"], c["b"], *_meta(c)), c["pos_TK"], c["weights"]
        )
        assert torch.equal(y, ref)


@pytest.mark.parametrize("bias", [True, False])
def test_autograd_matches_the_composition(layout_case, make_layout, bias, gen):
    c = _setup(make_layout, layout_case, gen, dtype=torch.float64, bias=bias)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))

    fused = gather_grouped_linear(c["x"], c["token_P"], c["pos_TK"], c["w"], c["b"], *_meta(c))
    ref = grouped_linear(gather_rows(c["x"], c["token_P"]), c["w"], c["b"], *_meta(c))
    inputs = [c["x"], c["w"], c["b"]]
    for a, r in zip(
        _grads(fused, inputs, torch.Generator().manual_seed(seed)),
        _grads(ref, inputs, torch.Generator().manual_seed(seed)),
        strict=True,
    ):
        torch.testing.assert_close(a, r)

    fused = grouped_linear_combine(c["h"], c["w"], c["b"], *_meta(c), c["pos_TK"], c["weights"])
    ref = combine_rows(grouped_linear(c["h"], c["w"], c["b"], *_meta(c)), c["pos_TK"], c["weights"])
    inputs = [c["h"], c["w"], c["b"], c["weights"]]
    for a, r in zip(
        _grads(fused, inputs, torch.Generator().manual_seed(seed)),
        _grads(ref, inputs, torch.Generator().manual_seed(seed)),
        strict=True,
    ):
        torch.testing.assert_close(a, r)


# one token (T = 1: gathering from a single row), a full last block (the last padded row is a
# real row, not padding: reads clamped to P - 1 must reach it), four choices per token
EDGE_LAYOUTS = {
    "one-token": ([1], [0], 1, 1, 16),
    "full-last-block": ([3, 16], [1, 0], 20, 2, 16),
    "k4": ([20, 9, 30], [0, 2, 1], 20, 4, 16),
}


@pytest.mark.parametrize("case", sorted(EDGE_LAYOUTS))
def test_edge_layouts_match_the_composition(case, make_layout, gen):
    c = _setup(make_layout, EDGE_LAYOUTS[case], gen, dtype=torch.float64)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    pairs = [
        (
            lambda: gather_grouped_linear(
                c["x"], c["token_P"], c["pos_TK"], c["w"], c["b"], *_meta(c)
            ),
            lambda: grouped_linear(gather_rows(c["x"], c["token_P"]), c["w"], c["b"], *_meta(c)),
            [c["x"], c["w"], c["b"]],
        ),
        (
            lambda: grouped_linear_combine(
                c["h"], c["w"], c["b"], *_meta(c), c["pos_TK"], c["weights"]
            ),
            lambda: combine_rows(
                grouped_linear(c["h"], c["w"], c["b"], *_meta(c)), c["pos_TK"], c["weights"]
            ),
            [c["h"], c["w"], c["b"], c["weights"]],
        ),
    ]
    for fused, ref, inputs in pairs:
        y, r = fused(), ref()
        assert torch.equal(y, r)
        for a, b in zip(
            _grads(y, inputs, torch.Generator().manual_seed(seed)),
            _grads(r, inputs, torch.Generator().manual_seed(seed)),
            strict=True,
        ):
            torch.testing.assert_close(a, b)


def test_grads_of_some_inputs_only(make_layout, gen):
    """Each input of the two public ops alone requires a gradient (the others frozen): its
    gradient equals the one of the backward where every input requires one, and the frozen
    inputs get none."""
    c = _setup(make_layout, ([5, 0, 17, 1], [2, 0, 2, 1], 12, 2, 16), gen, dtype=torch.float64)
    ops = {
        "gather": (
            lambda x, w, b: gather_grouped_linear(x, c["token_P"], c["pos_TK"], w, b, *_meta(c)),
            [c["x"], c["w"], c["b"]],
        ),
        "combine": (
            lambda h, w, b, g: grouped_linear_combine(h, w, b, *_meta(c), c["pos_TK"], g),
            [c["h"], c["w"], c["b"], c["weights"]],
        ),
    }
    for op, inputs in ops.values():
        y = op(*inputs)
        dy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
        full = torch.autograd.grad(y, inputs, dy)
        for i in range(len(inputs)):
            some = [t if j == i else t.detach() for j, t in enumerate(inputs)]
            (grad,) = torch.autograd.grad(op(*some), [some[i]], dy)
            torch.testing.assert_close(grad, full[i], rtol=0, atol=0)


def test_combine_weights_grad_is_zero_for_dropped_choices_and_accumulates_in_float32(gen):
    """``combine_weights_grad`` as its docstring states it: 0 for a dropped choice whatever its
    row holds, and the dots returned in float32 (float64 for float64 inputs)."""
    T, K, O, P = 6, 2, 8, 16
    pos_TK = torch.randint(0, P, (T, K), generator=gen)
    pos_TK[0, 1] = pos_TK[3, 0] = P  # dropped
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        dy_TO = torch.randn(T, O, generator=gen).to(dtype)
        rows_RO = torch.randn(T * K, O, generator=gen).to(dtype)  # dropped rows not zero
        d = combine_weights_grad(dy_TO, rows_RO, pos_TK, P)
        assert d.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        dots = (rows_RO.view(T, K, O).double() * dy_TO.double().unsqueeze(1)).sum(-1)
        expect = torch.where(pos_TK < P, dots, 0.0)
        torch.testing.assert_close(d.double(), expect, rtol=1e-6, atol=1e-6)
        assert d[0, 1] == 0 and d[3, 0] == 0


def test_combine_weight_grad_accumulates_in_float32_at_width_4096(make_layout, gen):
    """bf16 expert outputs at a realistic width (O = 4096), float32 routing weights: the gradient
    of each routing weight is a 4096-term dot product and must be accumulated in float32.
    Against the float64 dot product of the same bf16 values: relative error (Frobenius) below
    1e-4 (float32 accumulation: ~1e-7; a bf16 product or sum: ~2e-3)."""
    c = _setup(
        make_layout,
        ([20, 0, 13, 7], [1, 0, 2, 1], 24, 2, 16),
        gen,
        dtype=torch.bfloat16,
        bias=False,
        I=16,
        O=4096,
    )
    weights = c["weights"]
    y = grouped_linear_combine(c["h"], c["w"], None, *_meta(c), c["pos_TK"], weights)
    dy = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    (dweights,) = torch.autograd.grad(y, [weights], dy)
    assert dweights.dtype == torch.float32
    with torch.no_grad():
        out_PO = grouped_linear(c["h"], c["w"], None, *_meta(c))  # the rows the op combined
        rows_TKO = F.pad(out_PO, (0, 0, 0, 1))[c["pos_TK"]]
        truth = (rows_TKO.double() * dy.double().unsqueeze(1)).sum(dim=-1)
    err = ((dweights.double() - truth).norm() / truth.norm()).item()
    assert err < 1e-4, f"routing-weight gradient relative error {err:.3g} (float32 gives ~1e-7)"


def _slot_sums_per_row(x_PI, dy_PO, scale_P, schedule, num_slots):
    """dw[s] = sum of x[p]^T (scale[p] dy[p]), db[s] = sum of scale[p] dy[p] over the valid rows
    p of slot s, one row at a time."""
    B = schedule.block_size
    dw = torch.zeros(num_slots, x_PI.shape[1], dy_PO.shape[1], dtype=torch.float64)
    db = torch.zeros(num_slots, dy_PO.shape[1], dtype=torch.float64)
    for p in range(x_PI.shape[0]):
        if p % B >= int(schedule.block_rows_Nb[p // B]):
            continue  # padding
        s = int(schedule.block_slot_Nb[p // B])
        dy = scale_P[p] * dy_PO[p]
        dw[s] += torch.outer(x_PI[p], dy)
        db[s] += dy
    return dw, db


def test_gathered_weight_grad_scales_an_already_padded_dy(make_layout, gen):
    """``gathered_weight_grad`` with ``dy`` already in the padded layout (no ``dy`` index) and a
    row scale: the branch no mixmoe backward takes today (the combine's backward gathers ``dy``
    through ``token_P``), reachable by a direct call. Against a per-row loop; padding rows of
    both operands hold garbage that must not count, and the caller's ``dy`` is left as it was."""
    c = _setup(make_layout, ([5, 0, 17, 1], [2, 0, 2, 1], 12, 2, 16), gen, dtype=torch.float64)
    s, S = c["schedule"], c["w"].shape[0]
    P, O = s.num_padded_rows, c["w"].shape[2]
    h_PI = c["h"].detach()
    dy_PO = torch.randn(P, O, generator=gen, dtype=torch.float64)
    scale_P = torch.rand(P, generator=gen, dtype=torch.float64) + 0.5
    before = dy_PO.clone()
    dw, db = gathered_weight_grad(h_PI, None, dy_PO, None, scale_P, *_meta(c)[:2], S, 16, True)
    dw_ref, db_ref = _slot_sums_per_row(h_PI, dy_PO, scale_P, s, S)
    torch.testing.assert_close(dw, dw_ref)
    torch.testing.assert_close(db, db_ref)
    assert torch.equal(dy_PO, before)


def test_mixed_dtype_weight_grads_keep_the_weights_precision(make_layout, gen):
    """bfloat16 inputs through float32 weights run in float32, so the weight and bias gradients
    of both ops are float32 sums of products of the same values: against float64 on those
    values, relative error below 1e-5 (float32: ~1e-7; rounded to bfloat16 on the way: ~2e-3)."""
    c = _setup(make_layout, ([20, 0, 33, 7], [1, 0, 2, 1], 40, 2, 16), gen, I=64, O=48)
    x, h = (c[k].detach().bfloat16().requires_grad_() for k in ("x", "h"))
    w, b = c["w"], c["b"]
    cases = {
        "gather": (
            lambda x, w, b: gather_grouped_linear(x, c["token_P"], c["pos_TK"], w, b, *_meta(c)),
            x,
        ),
        "combine": (
            lambda h, w, b: grouped_linear_combine(
                h, w, b, *_meta(c), c["pos_TK"], c["weights"].detach()
            ),
            h,
        ),
    }
    for name, (op, inp) in cases.items():
        y = op(inp, w, b)
        assert y.dtype == torch.float32, name
        dy = torch.randn(y.shape, generator=gen)
        dw, db = torch.autograd.grad(y, [w, b], dy)
        ref = [t.detach().double().requires_grad_() for t in (inp, w, b)]
        dw_ref, db_ref = torch.autograd.grad(op(*ref), ref[1:], dy.double())
        for g, r in ((dw, dw_ref), (db, db_ref)):
            assert g.dtype == torch.float32, name
            err = ((g.double() - r).norm() / r.norm()).item()
            assert err < 1e-5, f"{name}: weight gradient relative error {err:.3g}"


def test_ops_are_registered_under_their_public_names():
    """Each op is ``torch.ops.mixmoe.NAME`` (the name users, ``torch.compile`` graphs and the
    Triton swap of ``_triton_swap.TRITON_IMPLS`` look it up by), and the swap lists every
    ``mixmoe::`` op: an op under any other name keeps its CPU kernel inside the swap, and the
    Triton-path tests below would compare the CPU implementation with itself."""
    from _triton_swap import TRITON_IMPLS

    ops = {
        "grouped_linear": grouped_linear,
        "grouped_weight_grad": grouped_weight_grad,
        "gather_grouped_linear": gather_grouped_linear,
        "grouped_linear_combine": _grouped_linear_combine,
        "scaled_gather_grouped_linear": scaled_gather_grouped_linear,
        "gathered_weight_grad": gathered_weight_grad,
        "combine_weights_grad": combine_weights_grad,
    }
    for name, op in ops.items():
        overload = getattr(torch.ops.mixmoe, name).default
        assert overload is op._opoverload, name
        assert overload._schema.name == f"mixmoe::{name}"
    registered = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mixmoe::")}
    assert registered == {f"mixmoe::{name}" for name in ops}
    assert set(TRITON_IMPLS) == set(ops)


def test_gradcheck(make_layout, gen):
    c = _setup(
        make_layout, ([3, 0, 17, 1], [1, 0, 1, 2], 12, 2, 16), gen, dtype=torch.float64, I=3, O=4
    )
    assert torch.autograd.gradcheck(
        lambda x, w, b: gather_grouped_linear(x, c["token_P"], c["pos_TK"], w, b, *_meta(c)),
        (c["x"], c["w"], c["b"]),
    )
    assert torch.autograd.gradcheck(
        lambda h, w, b, g: grouped_linear_combine(h, w, b, *_meta(c), c["pos_TK"], g),
        (c["h"], c["w"], c["b"], c["weights"].double().detach().requires_grad_()),
    )


def test_opcheck(make_layout, gen):
    c = _setup(make_layout, ([3, 0, 17, 1], [1, 0, 1, 2], 12, 2, 16), gen)
    meta = _meta(c)
    x, h, w, b, g = c["x"], c["h"], c["w"], c["b"], c["weights"]
    token_P, pos_TK = c["token_P"], c["pos_TK"]
    P = c["schedule"].num_padded_rows
    dy_TO = torch.randn(c["T"], w.shape[2], generator=gen)
    rows = torch.randn(c["T"] * c["K"], w.shape[2], generator=gen)
    scale_P = torch.rand(P, generator=gen)
    cases = [
        (gather_grouped_linear, (x, token_P, pos_TK, w, b, *meta)),
        (gather_grouped_linear, (x, token_P, pos_TK, w, None, *meta)),
        (_grouped_linear_combine, (h, w, b, *meta, pos_TK, g)),
        (_grouped_linear_combine, (h, w, None, *meta, pos_TK, None)),
        (
            scaled_gather_grouped_linear,
            (dy_TO, token_P, scale_P, w.detach().transpose(1, 2), *meta),
        ),
        (
            gathered_weight_grad,
            (h.detach(), None, dy_TO, token_P, scale_P, *meta[:2], w.shape[0], meta[2], True),
        ),
        (combine_weights_grad, (dy_TO, rows, pos_TK, P)),
        (  # dy already padded and scaled: the op must not scale the caller's dy in place
            gathered_weight_grad,
            (h.detach(), None, h.detach(), None, scale_P, *meta[:2], w.shape[0], meta[2], True),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_torch_compile(make_layout, gen):
    c = _setup(make_layout, ([3, 0, 17, 1], [1, 0, 1, 2], 12, 2, 16), gen)

    def mlp(x, w1, b1, w2, b2, weights):
        h = F.gelu(gather_grouped_linear(x, c["token_P"], c["pos_TK"], w1, b1, *_meta(c)))
        return grouped_linear_combine(h, w2, b2, *_meta(c), c["pos_TK"], weights)

    w2 = torch.randn(c["w"].shape[0], 40, 24, generator=gen).requires_grad_()
    b2 = torch.randn(c["w"].shape[0], 24, generator=gen).requires_grad_()
    args = (c["x"], c["w"], c["b"], w2, b2, c["weights"])
    eager = mlp(*args)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(compiled, eager)
    dy = torch.randn(eager.shape, generator=gen)
    for a, r in zip(
        torch.autograd.grad(compiled, args, dy), torch.autograd.grad(eager, args, dy), strict=True
    ):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_token_expert_mlp_fused_by_default_reference_on_request(activation, make_layout, gen):
    """One compute path: by default ``token_expert_mlp`` runs the fused ops on every device
    (CPU too); ``fused=False`` is exactly the reference composition, forward and gradients."""
    c = _setup(make_layout, ([5, 0, 17, 1], [2, 0, 2, 1], 12, 2, 16), gen)
    S, D, F_ = c["w"].shape
    weights = ExpertWeights(
        c["w"],
        torch.randn(S, F_, D, generator=gen).requires_grad_(),
        c["b"],
        torch.randn(S, D, generator=gen).requires_grad_(),
        torch.randn(S, D, F_, generator=gen).requires_grad_() if activation == "swiglu" else None,
    )
    args = (c["x"], c["token_P"], c["pos_TK"], c["weights"], weights, c["schedule"], activation)
    ref = combine_rows(
        expert_mlp(gather_rows(c["x"], c["token_P"]), weights, c["schedule"], activation),
        c["pos_TK"],
        c["weights"],
    )
    params = [c["x"], c["weights"], weights.w1_SDF, weights.w2_SFD, weights.b1_SF, weights.b2_SD]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    ref_grads = _grads(ref, params, torch.Generator().manual_seed(seed))
    slow = token_expert_mlp(*args, fused=False)
    assert torch.equal(slow, ref)
    for a, r in zip(
        _grads(slow, params, torch.Generator().manual_seed(seed)), ref_grads, strict=True
    ):
        assert torch.equal(a, r)
    y = token_expert_mlp(*args)
    assert torch.equal(y, token_expert_mlp(*args, fused=True))
    torch.testing.assert_close(y, ref.detach())
    for a, r in zip(_grads(y, params, torch.Generator().manual_seed(seed)), ref_grads, strict=True):
        torch.testing.assert_close(a, r)


# ---------------------------------------------------------------- the Triton path

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 5e-2}}


CALLS = {
    "grouped_linear": lambda t, m: grouped_linear(t["h"], t["w"], t["b"], *m),
    "grouped_linear_wT": lambda t, m: grouped_linear(t["dy_PO"], t["w"].transpose(1, 2), None, *m),
    "gather": lambda t, m: gather_grouped_linear(
        t["x"], t["token_P"], t["pos_TK"], t["w"], t["b"], *m
    ),
    "combine": lambda t, m: _grouped_linear_combine(
        t["h"], t["w"], t["b"], *m, t["pos_TK"], t["g"]
    ),
    "combine-unit": lambda t, m: _grouped_linear_combine(
        t["h"], t["w"], None, *m, t["pos_TK"], None
    ),
    "scaled_gather": lambda t, m: scaled_gather_grouped_linear(
        t["dy_TO"], t["token_P"], t["scale_P"], t["w"].transpose(1, 2), *m
    ),
    "weight_grad": lambda t, m: torch.ops.mixmoe.grouped_weight_grad(
        t["h"], t["dy_PO"], m[0], m[1], t["w"].shape[0], m[2], True
    ),
    "gathered_weight_grad_x": lambda t, m: gathered_weight_grad(
        t["x"], t["token_P"], t["dy_PO"], None, None, m[0], m[1], t["w"].shape[0], m[2], True
    ),
    "gathered_weight_grad_dy": lambda t, m: gathered_weight_grad(
        t["h"],
        None,
        t["dy_TO"],
        t["token_P"],
        t["scale_P"],
        m[0],
        m[1],
        t["w"].shape[0],
        m[2],
        False,
    ),
    "combine_weights_grad": lambda t, m: combine_weights_grad(
        t["dy_TO"], t["rows"], t["pos_TK"], t["h"].shape[0]
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_impls_match_torch_impls(
    layout_case, make_layout, dtype, device, triton_backend, gen
):
    """Each op: its Triton implementation on ``device`` vs its torch implementation on CPU."""
    pytest.importorskip("triton", reason="the kernel tier needs triton")
    c = _setup(make_layout, layout_case, gen, dtype=dtype)
    P, T, O = c["schedule"].num_padded_rows, c["T"], c["w"].shape[2]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    cpu = {k: c[k].detach() for k in ("x", "h", "w", "b", "token_P", "pos_TK")}
    cpu.update(
        g=c["weights"].detach(),
        dy_TO=rand(T, O),
        dy_PO=rand(P, O),
        scale_P=torch.rand(P, generator=gen),
        rows=rand(T * c["K"], O),
    )
    cpu["rows"][(c["pos_TK"] >= P).reshape(-1)] = 0  # as the combine op leaves dropped rows
    dev = {k: v.to(device) for k, v in cpu.items()}
    meta_cpu, meta_dev = _meta(c), _meta({"schedule": _schedule_to(c["schedule"], device)})
    for name, call in CALLS.items():
        with torch.no_grad():
            ref = call(cpu, meta_cpu)
            with triton_backend():
                out = call(dev, meta_dev)
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        loose = "weight_grad" in name and dtype == torch.bfloat16  # sums over many rows
        tol = {"rtol": 2e-2, "atol": 2e-1} if loose else TOL[dtype]
        for o, r in zip(outs, refs, strict=True):
            assert o.dtype == r.dtype and o.shape == r.shape, name
            torch.testing.assert_close(
                o.cpu().float(), r.float(), **tol, msg=lambda m, n=name: f"{n}: {m}"
            )


def _check(name, out, ref, truth, dtype):
    """fp32: ``out`` (Triton path) equals ``ref`` (CPU path) to rounding. bf16: ``out`` is no
    further from the fp32 ``truth`` (same bf16 inputs, computed in fp32) than the CPU bf16 path
    is, up to a factor 2 (the CPU path rounds its intermediates to bf16; the kernels keep fp32).
    The Triton interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), a
    bias that adds up over long reductions, so interpreted runs get a factor 4."""
    interpreted = out.device.type == "cpu"
    out, ref = out.detach().cpu().float(), ref.detach().cpu().float()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, **TOL[dtype], msg=lambda m: f"{name}: {m}")
        return
    truth = truth.detach().cpu().float()
    err, ref_err = (out - truth).abs().max().item(), (ref - truth).abs().max().item()
    scale = truth.abs().max().item()
    factor = 4 if interpreted else 2
    assert err <= factor * ref_err + 1e-2 * scale + 1e-3, (
        f"{name}: Triton-path bf16 error {err:.3g} vs CPU bf16 error {ref_err:.3g} "
        f"(fp32 truth, max magnitude {scale:.3g})"
    )


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_mlp_on_triton_path(activation, dtype, make_layout, device, triton_backend, gen):
    """Forward and every gradient of the fused expert MLP (the path a CUDA layer takes) vs the
    reference composition on CPU, K = 2 with dropped choices and partial blocks."""
    pytest.importorskip("triton", reason="the kernel tier needs triton")
    counts, slots, T, K, B = [9, 0, 21, 1], [2, 0, 2, 1], 20, 2, 16
    schedule, token_P, pos_TK, _ = make_layout(counts, slots, T, K, B, gen, "cpu")
    S, D, F_ = 3, 24, 40

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

    cpu = {
        "x": leaf(T, D),
        "g": torch.rand(T, K, generator=gen).requires_grad_(),
        "w1": leaf(S, D, F_, scale=D**-0.5),
        "b1": leaf(S, F_),
        "w2": leaf(S, F_, D, scale=F_**-0.5),
        "b2": leaf(S, D),
        "w3": leaf(S, D, F_, scale=D**-0.5) if activation == "swiglu" else None,
    }

    def copy_to(device, dtype=None):
        return {
            k: v.detach().to(device, dtype or v.dtype).requires_grad_() if v is not None else None
            for k, v in cpu.items()
        }

    dy = torch.randn(T, D, generator=gen).to(dtype)

    def run(t, sched, tok, pos, fused):
        ew = ExpertWeights(t["w1"], t["w2"], t["b1"], t["b2"], t["w3"])
        y = token_expert_mlp(t["x"], tok, pos, t["g"], ew, sched, activation, fused=fused)
        names = [k for k, v in t.items() if v is not None]
        grads = torch.autograd.grad(y, [t[k] for k in names], dy.to(y.device, y.dtype))
        return y, dict(zip(names, grads, strict=True))

    y_ref, g_ref = run(cpu, schedule, token_P, pos_TK, fused=False)
    y_32, g_32 = run(copy_to("cpu", torch.float32), schedule, token_P, pos_TK, fused=False)
    with triton_backend():
        sched_dev = _schedule_to(schedule, device)
        y, grads = run(
            copy_to(device), sched_dev, token_P.to(device), pos_TK.to(device), fused=True
        )
    _check("y", y, y_ref, y_32, dtype)
    for name in g_ref:
        _check(f"d{name}", grads[name], g_ref[name], g_32[name], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_on_triton_path(dtype, device, triton_backend, gen):
    """The MoE layer (ops' Triton implementations) vs the same layer on the CPU path: output and
    every parameter gradient. Routing is imposed (weights still from the gate) so that no near-tie
    in the router can flip between devices."""
    pytest.importorskip("triton", reason="the kernel tier needs triton")
    from mixmoe.gating.synthetic import RoutingSpec, SyntheticGate, synthetic_ids

    T, N, K = 27, 4, 2
    cfg = MoEConfig(model_dim=32, hidden_dim=48, num_experts=N, top_k=K, block_size=16)
    ids_TK = synthetic_ids(RoutingSpec.parse("zipf:1.5"), T, K, N, gen)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = MoE(cfg, gate=SyntheticGate(cfg, ids_TK), dtype=dtype)
    layer.gate.to(dtype)
    x = torch.randn(3, 9, 32, generator=gen).to(dtype)
    dy = torch.randn(3, 9, 32, generator=gen).to(dtype)

    def run(module, device, dtype):
        y, aux = module(x.to(device, dtype))
        torch.autograd.backward([y, aux.loss], [dy.to(device, dtype), torch.ones_like(aux.loss)])
        return y, {n: p.grad for n, p in module.named_parameters()}

    layer_32, layer_dev = copy.deepcopy(layer).float(), copy.deepcopy(layer).to(device)
    y_ref, g_ref = run(layer, "cpu", dtype)
    y_32, g_32 = run(layer_32, "cpu", torch.float32)
    with triton_backend():
        y, grads = run(layer_dev, device, dtype)
    _check("y", y, y_ref, y_32, dtype)
    for name in g_ref:
        _check(f"{name}.grad", grads[name], g_ref[name], g_32[name], dtype)


def test_triton_path_is_deterministic(make_layout, device, triton_backend, gen):
    pytest.importorskip("triton", reason="the kernel tier needs triton")
    c = _setup(make_layout, ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16), gen, device=device)
    results = []
    with triton_backend():
        for _ in range(2):
            y = grouped_linear_combine(c["h"], c["w"], c["b"], *_meta(c), c["pos_TK"], c["weights"])
            grads = torch.autograd.grad(
                y, [c["h"], c["w"], c["b"], c["weights"]], torch.ones_like(y)
            )
            results.append((y, *grads))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _schedule_to(schedule, device):
    fields = {f: getattr(schedule, f) for f in schedule.__dataclass_fields__}
    return type(schedule)(
        **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    )
