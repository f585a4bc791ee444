"""The CPU body of ``token_expert_mlp`` (``mixmoe.ops.cpu_expert_mlp``) against a dense
per-(token, choice) loop that shares no code with it: forward and every gradient (dx, d weights_TK,
dW1/db1, dW3/db3, dW2/db2), every activation, with and without bias and gate weights, float64,
float32 and bfloat16, on layouts with repeated / out-of-order slots, slots without rows, partial
blocks, K = 1 and dropped choices. Calls the path does not take (zero tokens, a weight in another
dtype) still run the fused ops and match the same loop.

Legend: T tokens, K top-k, D model dim, F hidden dim, P padded rows, S weight slots.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixmoe.ops.cpu_expert_mlp import cpu_path_applies
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.token_expert_mlp import token_expert_mlp

ACTIVATIONS = ["gelu", "relu", "silu", "swiglu"]
TOL = {
    torch.float64: {"rtol": 1e-7, "atol": 1e-7},
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    # bf16 rounds every intermediate (h, dh, da): the fused ops show the same error
    torch.bfloat16: {"rtol": 5e-2, "atol": 2.5e-1},
}


def _dense_mlp(x_D, w, s, activation):
    a = x_D @ w["w1"][s] + (w["b1"][s] if "b1" in w else 0)
    if activation == "swiglu":
        h = F.silu(a) * (x_D @ w["w3"][s] + (w["b3"][s] if "b3" in w else 0))
    else:
        h = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation](a)
    return h @ w["w2"][s] + (w["b2"][s] if "b2" in w else 0)


def dense_loop(x_TD, pos_TK, weights_TK, w, block_slot, block_size, num_padded, activation):
    """y[t] = sum_k weights[t, k] * mlp_{slot of row pos[t, k]}(x[t]), one row at a time."""
    T, K = pos_TK.shape
    rows = []
    for t in range(T):
        y = torch.zeros(w["w2"].shape[2], dtype=x_TD.dtype)
        for k in range(K):
            p = int(pos_TK[t, k])
            if p == num_padded:  # dropped choice
                continue
            out = _dense_mlp(x_TD[t], w, int(block_slot[p // block_size]), activation)
            y = y + (out if weights_TK is None else weights_TK[t, k] * out)
        rows.append(y)
    if not rows:
        return x_TD.new_zeros(0, w["w2"].shape[2]).requires_grad_()
    return torch.stack(rows)


def _case(make_layout, case, gen, activation, bias, dtype, D=12, Fh=20):
    counts, slots, T, K, B = case
    schedule, token_P, pos_TK, _ = make_layout(counts, slots, T, K, B, gen)
    S = max(slots) + 2  # the last slot never has rows

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    w = {"w1": rand(S, D, Fh, scale=D**-0.5), "w2": rand(S, Fh, D, scale=Fh**-0.5)}
    if activation == "swiglu":
        w["w3"] = rand(S, D, Fh, scale=D**-0.5)
    if bias:
        w.update({"b1": rand(S, Fh), "b2": rand(S, D)})
        if activation == "swiglu":
            w["b3"] = rand(S, Fh)
    for p in w.values():
        p.requires_grad_()
    x = rand(T, D).requires_grad_()
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gate = torch.rand(T, K, generator=gen, dtype=gate_dtype).requires_grad_()
    return schedule, token_P, pos_TK, x, gate, w


def _weights(w) -> ExpertWeights:
    return ExpertWeights(w["w1"], w["w2"], w.get("b1"), w.get("b2"), w.get("w3"), w.get("b3"))


def _check(schedule, token_P, pos_TK, x, gate, w, activation, dtype, expect_cpu_path, fused=True):
    """``dtype`` picks the tolerance; the output must be in ``promote(x, w)``."""
    weights = _weights(w)
    assert cpu_path_applies(x, pos_TK, weights, activation) is expect_cpu_path
    y = token_expert_mlp(x, token_P, pos_TK, gate, weights, schedule, activation, fused=fused)
    on_path = type(y.grad_fn).__name__ == "_CpuTokenExpertMLPBackward"
    assert on_path is (expect_cpu_path and fused)
    assert y.dtype == torch.promote_types(x.dtype, w["w1"].dtype)
    # reference in float64 from float64 copies of the same inputs
    ref_in = {n: p.detach().double().requires_grad_() for n, p in w.items()}
    ref_x = x.detach().double().requires_grad_()
    ref_gate = None if gate is None else gate.detach().double().requires_grad_()
    ref = dense_loop(
        ref_x,
        pos_TK,
        ref_gate,
        ref_in,
        schedule.block_slot_Nb,
        schedule.block_size,
        schedule.num_padded_rows,
        activation,
    )
    torch.testing.assert_close(y.double(), ref.detach(), **TOL[dtype])
    dy = torch.randn(ref.shape, dtype=torch.float64)
    names = sorted(w)
    ours = torch.autograd.grad(
        y, [x] + ([gate] if gate is not None else []) + [w[n] for n in names], dy.to(y.dtype)
    )
    theirs = torch.autograd.grad(
        ref,
        [ref_x] + ([ref_gate] if ref_gate is not None else []) + [ref_in[n] for n in names],
        dy,
        allow_unused=True,
        materialize_grads=True,  # zero tokens: the loop's graph reaches no input
    )
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.double(), r, **TOL[dtype])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_path_matches_dense_loop(layout_case, make_layout, activation, bias, gen):
    args = _case(make_layout, layout_case, gen, activation, bias, torch.float64)
    _check(*args, activation, torch.float64, expect_cpu_path=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_cpu_path_low_precision(make_layout, dtype, activation, gen):
    case = ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16)
    args = _case(make_layout, case, gen, activation, True, dtype)
    _check(*args, activation, dtype, expect_cpu_path=True)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_cpu_path_with_four_choices(make_layout, gen, activation):
    """K = 4 (the weighted K-sum runs one pass per choice: the layouts above have K <= 2)."""
    args = _case(
        make_layout, ([20, 9, 30], [0, 2, 1], 20, 4, 16), gen, activation, True, torch.float64
    )
    _check(*args, activation, torch.float64, expect_cpu_path=True)


def test_cpu_path_gate_grad_accumulates_in_float32_at_width_4096(make_layout, gen):
    """bf16 at a realistic model width (D = 4096): the gradient of each gate weight is a
    4096-term dot product of the output gradient with the expert's output row and must be
    accumulated in float32 (issue 16's gap 4, for the CPU body). K = 1, so the rows are exactly
    the output of the same call with unit gates; against their float64 dot product: relative
    error below 1e-4 (float32: ~1e-7; a bf16 product or sum: ~1e-3)."""
    schedule, token_P, pos_TK, x, gate, w = _case(
        make_layout,
        ([20, 0, 13, 7], [1, 0, 2, 1], 48, 1, 16),
        gen,
        "gelu",
        False,
        torch.bfloat16,
        D=4096,
        Fh=16,
    )
    args = (token_P, pos_TK)
    y = token_expert_mlp(x, *args, gate, _weights(w), schedule, "gelu")
    assert type(y.grad_fn).__name__ == "_CpuTokenExpertMLPBackward"
    dy = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    (dgate,) = torch.autograd.grad(y, [gate], dy)
    assert dgate.dtype == torch.float32
    with torch.no_grad():  # unit gates: y is the expert rows themselves (dropped: zero)
        rows_TD = token_expert_mlp(x, *args, torch.ones_like(gate), _weights(w), schedule, "gelu")
        truth = (rows_TD.double() * dy.double()).sum(dim=-1, keepdim=True)
    err = ((dgate.double() - truth).norm() / truth.norm()).item()
    assert err < 1e-4, f"gate gradient relative error {err:.3g} (float32 gives ~1e-7)"


def test_cpu_path_unit_gate_weights(make_layout, gen):
    """``weights_TK=None`` (unit weights, e.g. received rows back in return order with K = 1)."""
    schedule, token_P, pos_TK, x, _, w = _case(
        make_layout, ([5, 0, 17, 1], [2, 0, 2, 1], 24, 1, 16), gen, "swiglu", True, torch.float64
    )
    _check(schedule, token_P, pos_TK, x, None, w, "swiglu", torch.float64, True)


def _swiglu_bias_case(make_layout, gen):
    """SwiGLU with every bias, float64, an expert without rows and one with a single row."""
    layout = ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16)
    return _case(make_layout, layout, gen, "swiglu", True, torch.float64)


def test_cpu_path_gradients_of_some_inputs_only(make_layout, gen):
    """Frozen weights and gate: only dx is asked for (and must still be right)."""
    schedule, token_P, pos_TK, x, gate, w = _swiglu_bias_case(make_layout, gen)
    frozen = {n: p.detach() for n, p in w.items()}
    y = token_expert_mlp(x, token_P, pos_TK, gate.detach(), _weights(frozen), schedule, "swiglu")
    (dx,) = torch.autograd.grad(y.sum(), [x])
    ref_x = x.detach().requires_grad_()
    ref = dense_loop(
        ref_x,
        pos_TK,
        gate.detach(),
        frozen,
        schedule.block_slot_Nb,
        schedule.block_size,
        schedule.num_padded_rows,
        "swiglu",
    )
    (ref_dx,) = torch.autograd.grad(ref.sum(), [ref_x])
    torch.testing.assert_close(dx, ref_dx)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_cpu_path_each_input_alone_requires_a_gradient(make_layout, gen, activation):
    """One input alone requires a gradient (x, the gate weights, or one weight or bias; the rest
    frozen or data, e.g. a first layer's input): its gradient equals the one of the backward
    where every input requires one, and the frozen ones get none."""
    schedule, token_P, pos_TK, x, gate, w = _case(
        make_layout,
        ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16),
        gen,
        activation,
        True,
        torch.float64,
    )
    inputs = {"x": x, "gate": gate, **w}

    def run(ins):
        weights = _weights({n: ins[n] for n in w})
        return token_expert_mlp(
            ins["x"], token_P, pos_TK, ins["gate"], weights, schedule, activation
        )

    y = run(inputs)
    assert type(y.grad_fn).__name__ == "_CpuTokenExpertMLPBackward"
    dy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    full = dict(zip(inputs, torch.autograd.grad(y, list(inputs.values()), dy), strict=True))
    for name in inputs:
        some = {n: t if n == name else t.detach() for n, t in inputs.items()}
        (grad,) = torch.autograd.grad(run(some), [some[name]], dy)
        torch.testing.assert_close(grad, full[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("bias", ["b1", "b3", "b2"])
def test_cpu_path_swiglu_with_one_bias(make_layout, gen, bias):
    """SwiGLU with one of its three biases only (each bias's gradient belongs to its own
    weight, whatever the others have)."""
    schedule, token_P, pos_TK, x, gate, w = _swiglu_bias_case(make_layout, gen)
    w = {n: p for n, p in w.items() if n.startswith("w") or n == bias}
    _check(schedule, token_P, pos_TK, x, gate, w, "swiglu", torch.float64, True)


def test_calls_off_the_cpu_path_run_the_fused_ops(make_layout, gen):
    """Zero tokens and mixed dtypes are not taken: the fused ops run them, same results."""
    case = ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16)
    schedule, token_P, pos_TK, x, gate, w = _case(
        make_layout, case, gen, "gelu", True, torch.float64
    )
    w["b2"] = w["b2"].detach().float().requires_grad_()  # another dtype: not this path
    assert not cpu_path_applies(x, pos_TK, _weights(w), "gelu")
    _check(schedule, token_P, pos_TK, x, gate, w, "gelu", torch.float32, expect_cpu_path=False)
    w["b2"] = w["b2"].detach().double().requires_grad_()
    assert cpu_path_applies(x, pos_TK, _weights(w), "gelu")

    empty = build_empty(gen)
    _check(*empty, "gelu", torch.float64, expect_cpu_path=False)


def test_one_token_with_one_choice_takes_the_cpu_path(make_layout, gen):
    """The smallest call the body takes (T = 1, K = 1: e.g. a rank that received one row): on
    the path, equal to the loop."""
    args = _case(make_layout, ([1], [0], 1, 1, 16), gen, "swiglu", True, torch.float64)
    _check(*args, "swiglu", torch.float64, expect_cpu_path=True)


def test_tokens_without_choices_run_off_the_cpu_path(make_layout, gen):
    """K = 0 (tokens but no choice): the body needs one choice; the fused ops return zeros and
    zero gradients."""
    schedule, token_P, pos_TK, x, gate, w = _case(
        make_layout, ([0], [0], 3, 0, 16), gen, "gelu", True, torch.float64
    )
    weights = _weights(w)
    assert not cpu_path_applies(x, pos_TK, weights, "gelu")
    y = token_expert_mlp(x, token_P, pos_TK, gate, weights, schedule, "gelu")
    assert torch.equal(y, torch.zeros(3, x.shape[1], dtype=torch.float64))
    for grad in torch.autograd.grad(y.sum(), [x, gate, *w.values()]):
        assert not grad.any()


MIXED = [
    (torch.float32, torch.float64),
    (torch.float64, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize(("x_dtype", "w_dtype"), MIXED, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference-composition"])
def test_mixed_dtypes_run_in_the_promoted_dtype(
    make_layout, gen, x_dtype, w_dtype, activation, fused
):
    """``x`` in one dtype, the weights in another (e.g. a float32 input through float64
    experts): computed in ``promote(x, w)``, as the Triton launchers document (the CPU ops cast
    the same way; the CPU body takes one dtype only, so the fused ops run it). Forward and every
    gradient equal the float64 loop at the lower precision's tolerance; each gradient comes back
    in its input's dtype. Before, every such call raised inside ``grouped_linear``."""
    case = ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16)
    schedule, token_P, pos_TK, x, gate, w = _case(
        make_layout, case, gen, activation, True, torch.float64
    )
    x = x.detach().to(x_dtype).requires_grad_()
    gate = gate.detach().to(torch.promote_types(x_dtype, torch.float32)).requires_grad_()
    w = {n: p.detach().to(w_dtype).requires_grad_() for n, p in w.items()}
    low = min((x_dtype, w_dtype), key=lambda d: torch.finfo(d).bits)
    _check(schedule, token_P, pos_TK, x, gate, w, activation, low, False, fused=fused)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference-composition"])
def test_mixed_dtypes_weight_grads_keep_the_weights_precision(make_layout, gen, activation, fused):
    """A bfloat16 ``x`` through float32 experts runs in float32, so every weight and bias
    gradient is a float32 sum of products of the same values: against the float64 loop on those
    values, relative error below 1e-5 (float32: ~1e-7). Before, the gradients of the weights
    that multiply ``x`` came back rounded to bfloat16 (``x``'s dtype: ~2e-3)."""
    case = ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16)
    schedule, token_P, pos_TK, x, gate, w = _case(
        make_layout, case, gen, activation, True, torch.float32
    )
    x = x.detach().bfloat16()
    y = token_expert_mlp(x, token_P, pos_TK, gate, _weights(w), schedule, activation, fused=fused)
    ref_w = {n: p.detach().double().requires_grad_() for n, p in w.items()}
    meta = (schedule.block_slot_Nb, schedule.block_size, schedule.num_padded_rows)
    ref = dense_loop(x.double(), pos_TK, gate.detach().double(), ref_w, *meta, activation)
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    names = sorted(w)
    ours = torch.autograd.grad(y, [w[n] for n in names], dy.float())
    theirs = torch.autograd.grad(ref, [ref_w[n] for n in names], dy)
    for name, a, r in zip(names, ours, theirs, strict=True):
        err = ((a.double() - r).norm() / r.norm()).item()
        assert a.dtype == torch.float32 and err < 1e-5, f"d{name}: relative error {err:.3g}"


def build_empty(gen):
    """A step where this rank has no tokens: T = 0, no rows, every slot idle."""
    from mixmoe.schedule.blocks import build_block_schedule

    schedule = build_block_schedule(
        torch.zeros(3, dtype=torch.int64), torch.arange(3), block_size=16
    )
    S, D, Fh = 3, 8, 10
    w = {
        "w1": torch.randn(S, D, Fh, generator=gen, dtype=torch.float64).requires_grad_(),
        "w2": torch.randn(S, Fh, D, generator=gen, dtype=torch.float64).requires_grad_(),
        "b1": torch.randn(S, Fh, generator=gen, dtype=torch.float64).requires_grad_(),
        "b2": torch.randn(S, D, generator=gen, dtype=torch.float64).requires_grad_(),
    }
    x = torch.randn(0, D, dtype=torch.float64).requires_grad_()
    token_P = torch.zeros(schedule.num_padded_rows, dtype=torch.int64)
    pos_TK = torch.zeros(0, 2, dtype=torch.int64)
    gate = torch.rand(0, 2, dtype=torch.float64).requires_grad_()
    return schedule, token_P, pos_TK, x, gate, w


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fused", [True, False], ids=["cpu-path", "reference-composition"])
def test_swiglu_with_gate_and_up_in_one_weight(make_layout, gen, bias, fused):
    """SwiGLU with w3 None and w1 = [gate | up] ([S, D, 2F], transformers' concatenated
    gate_up_proj): the CPU path runs it as one GEMM and returns the whole tensor's gradient;
    the reference composition splits it into views. Both equal the dense loop on the halves."""
    case = ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16)
    schedule, token_P, pos_TK, x, gate, w = _case(
        make_layout, case, gen, "swiglu", bias, torch.float64
    )
    cat = {
        "w13": torch.cat([w["w1"], w["w3"]], dim=2).detach().requires_grad_(),
        "w2": w["w2"],
    }
    if bias:
        cat["b13"] = torch.cat([w["b1"], w["b3"]], dim=1).detach().requires_grad_()
        cat["b2"] = w["b2"]
    weights = ExpertWeights(cat["w13"], cat["w2"], cat.get("b13"), cat.get("b2"))
    assert cpu_path_applies(x, pos_TK, weights, "swiglu")
    y = token_expert_mlp(x, token_P, pos_TK, gate, weights, schedule, "swiglu", fused=fused)
    on_path = type(y.grad_fn).__name__ == "_CpuTokenExpertMLPBackward"
    assert on_path is fused
    F_ = w["w1"].shape[2]
    ref_cat = {n: p.detach().clone().requires_grad_() for n, p in cat.items()}
    ref_w = {"w1": ref_cat["w13"][..., :F_], "w3": ref_cat["w13"][..., F_:], "w2": ref_cat["w2"]}
    if bias:
        ref_w.update(b1=ref_cat["b13"][..., :F_], b3=ref_cat["b13"][..., F_:], b2=ref_cat["b2"])
    ref_x, ref_gate = x.detach().requires_grad_(), gate.detach().requires_grad_()
    ref = dense_loop(
        ref_x,
        pos_TK,
        ref_gate,
        ref_w,
        schedule.block_slot_Nb,
        schedule.block_size,
        schedule.num_padded_rows,
        "swiglu",
    )
    torch.testing.assert_close(y, ref)
    dy = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    names = sorted(cat)
    ours = torch.autograd.grad(y, [x, gate] + [cat[n] for n in names], dy)
    theirs = torch.autograd.grad(ref, [ref_x, ref_gate] + [ref_cat[n] for n in names], dy)
    for name, a, r in zip(["x", "gate"] + names, ours, theirs, strict=True):
        torch.testing.assert_close(a, r, msg=lambda m, name=name: f"d{name}: {m}")


def test_relu_gradient_at_exactly_zero_is_zero():
    """``activate_backward`` follows torch's convention for relu at 0 (gradient 0), which the
    hand-written backward passes rely on to equal the reference's autograd."""
    from mixmoe.ops.expert_mlp import activate_backward

    a = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
    (ref,) = torch.autograd.grad(torch.relu(a).sum(), a)
    got = activate_backward(torch.ones(3), a.detach(), "relu")
    assert torch.equal(got, ref) and got[1] == 0


def test_concatenated_gate_up_off_the_cpu_body(gen):
    """SwiGLU with [gate | up] in one w1 on a call the CPU body does not take (zero tokens): the
    fused ops get the split weights (an unsplit w1 would reach them with w3 None)."""
    from mixmoe.dispatch.layout import expert_row_layout

    D, Fh, N = 8, 12, 3
    layout = expert_row_layout(torch.zeros(0, 2, dtype=torch.int64), N, 16)
    w1 = torch.randn(N, D, 2 * Fh, generator=gen, requires_grad=True)
    w2 = torch.randn(N, Fh, D, generator=gen, requires_grad=True)
    x = torch.zeros(0, D, requires_grad=True)
    weights = ExpertWeights(w1, w2)
    assert not cpu_path_applies(x, layout.pos_TK, weights, "swiglu")
    y = token_expert_mlp(x, layout.token_P, layout.pos_TK, None, weights, layout.schedule, "swiglu")
    assert y.shape == (0, D)
    dw1, dw2 = torch.autograd.grad(y.sum(), [w1, w2], allow_unused=True, materialize_grads=True)
    assert torch.count_nonzero(dw1) == 0 and torch.count_nonzero(dw2) == 0
