"""The grouped-GEMM body of ``token_expert_mlp`` (``mixmoe.ops.grouped_mm_expert_mlp``) against a
per-(token, choice) loop over expert ids that shares no code with it (no layout, no grouped op):
forward and every gradient, every activation (SwiGLU with separate and concatenated gate/up),
with and without bias and gate weights, dropped choices and experts without rows. On CPU,
``torch._grouped_mm`` runs float32 and bfloat16, so CI checks the path; ``test_gpu.py`` checks it
where it is the default (CUDA, 16-bit, Hopper).

Legend: T tokens, K top-k, N experts, D model dim, F hidden dim.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.ops.expert_mlp import ExpertWeights
from mixmoe.ops.grouped_mm_expert_mlp import (
    grouped_mm_path_applies,
    grouped_mm_token_expert_mlp,
    layout_fits,
)
from mixmoe.ops.token_expert_mlp import token_expert_mlp

TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 5e-2, "atol": 2.5e-1},
}


def _mlp(x_D, w, e, activation):
    a = x_D @ w["w1"][e] + (w["b1"][e] if "b1" in w else 0)
    if activation == "swiglu":
        h = F.silu(a) * (x_D @ w["w3"][e] + (w["b3"][e] if "b3" in w else 0))
    else:
        h = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation](a)
    return h @ w["w2"][e] + (w["b2"][e] if "b2" in w else 0)


def loop_reference(x_TD, ids_TK, gate_TK, w, activation):
    rows = []
    for t in range(x_TD.shape[0]):
        y = x_TD.new_zeros(w["w2"].shape[2])
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            out = _mlp(x_TD[t], w, e, activation)
            y = y + (out if gate_TK is None else gate_TK[t, k] * out)
        rows.append(y)
    return torch.stack(rows)


def _case(activation, bias, dtype, gen, T=40, K=2, N=5, D=16, Fh=24, B=16):
    """ids_TK, x, gate, the weights by name, the one-device layout."""
    ids_TK = torch.randint(0, N - 1, (T, K), generator=gen)  # expert N - 1 never gets a row
    if T > 7:
        ids_TK[3, 1] = ids_TK[7, 0] = -1  # dropped choices

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    w = {"w1": rand(N, D, Fh, scale=D**-0.5), "w2": rand(N, Fh, D, scale=Fh**-0.5)}
    if activation == "swiglu":
        w["w3"] = rand(N, D, Fh, scale=D**-0.5)
    if bias:
        w.update({"b1": rand(N, Fh), "b2": rand(N, D)})
        if activation == "swiglu":
            w["b3"] = rand(N, Fh)
    for p in w.values():
        p.requires_grad_()
    x = rand(T, D).requires_grad_()
    gate = torch.rand(T, K, generator=gen).requires_grad_()
    return ids_TK, x, gate, w, expert_row_layout(ids_TK, N, B)


def _grads(y, inputs, dy):
    return torch.autograd.grad(y, inputs, dy.to(y.dtype), allow_unused=True, materialize_grads=True)


def _check(activation, bias, dtype, gen, use_gate=True, concatenated=False, **shape):
    ids_TK, x, gate, w, layout = _case(activation, bias, dtype, gen, **shape)
    gate = gate if use_gate else None
    if concatenated:  # transformers' [gate | up] in one weight
        w1 = torch.cat([w["w1"], w["w3"]], dim=2).detach().requires_grad_()
        b1 = torch.cat([w["b1"], w["b3"]], dim=1).detach().requires_grad_() if bias else None
        weights = ExpertWeights(w1, w["w2"], b1, w.get("b2"))
        ours_params = [w1] + ([b1] if bias else []) + [w["w2"]] + ([w["b2"]] if bias else [])
    else:
        weights = ExpertWeights(
            w["w1"], w["w2"], w.get("b1"), w.get("b2"), w.get("w3"), w.get("b3")
        )
        ours_params = [w[n] for n in sorted(w)]
    assert layout.schedule.slot_ends is not None
    assert layout_fits(x, layout.pos_TK, weights, layout.schedule, activation)
    y = grouped_mm_token_expert_mlp(
        x, layout.token_P, layout.pos_TK, gate, weights, layout.schedule, activation
    )
    ref_w = {n: p.detach().double().requires_grad_() for n, p in w.items()}
    ref_x = x.detach().double().requires_grad_()
    ref_gate = None if gate is None else gate.detach().double().requires_grad_()
    ref = loop_reference(ref_x, ids_TK, ref_gate, ref_w, activation)
    torch.testing.assert_close(y.double(), ref.detach(), **TOL[dtype])

    dy = torch.randn(ref.shape, dtype=torch.float64, generator=gen)
    lead = [x] + ([gate] if gate is not None else [])
    ours = _grads(y, lead + ours_params, dy)
    ref_lead = [ref_x] + ([ref_gate] if ref_gate is not None else [])
    theirs = list(_grads(ref, ref_lead + [ref_w[n] for n in sorted(ref_w)], dy))
    if concatenated:  # the reference's w1|w3 (b1|b3) gradients, concatenated like the weight
        g = dict(zip(sorted(ref_w), theirs[len(ref_lead) :], strict=True))
        cat = [torch.cat([g["w1"], g["w3"]], dim=2)]
        if bias:
            cat.append(torch.cat([g["b1"], g["b3"]], dim=1))
        theirs = theirs[: len(ref_lead)] + cat + [g["w2"]] + ([g["b2"]] if bias else [])
    assert len(ours) == len(theirs)
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.double(), r, **TOL[dtype])
    # the expert without rows gets exactly zero weight gradients
    for a in ours[len(lead) :]:
        assert torch.count_nonzero(a[-1]) == 0


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_path_matches_loop_float32(activation, bias, gen):
    _check(activation, bias, torch.float32, gen)


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_path_swiglu_concatenated_gate_up(bias, gen):
    _check("swiglu", bias, torch.float32, gen, concatenated=True)


def test_grouped_path_top3_and_one_token(gen):
    """K = 3 (every choice's weight in the combine and its gradient) and a single token."""
    _check("gelu", True, torch.float32, gen, K=3)
    _check("swiglu", False, torch.float32, gen, T=1, K=2)


def test_grouped_path_unit_gate_weights_and_bf16(gen):
    _check("gelu", True, torch.float32, gen, use_gate=False)
    _check("swiglu", True, torch.bfloat16, gen)


def test_grouped_path_is_not_the_default_on_cpu(gen):
    """On CPU ``token_expert_mlp`` keeps its own CPU body; the grouped GEMM is the CUDA choice."""
    ids_TK, x, gate, w, layout = _case("gelu", True, torch.float32, gen)
    weights = ExpertWeights(w["w1"], w["w2"], w["b1"], w["b2"])
    assert not grouped_mm_path_applies(x, layout.pos_TK, weights, layout.schedule, "gelu")
    y = token_expert_mlp(x, layout.token_P, layout.pos_TK, gate, weights, layout.schedule, "gelu")
    assert type(y.grad_fn).__name__ == "_CpuTokenExpertMLPBackward"


def test_grouped_path_refuses_what_it_cannot_run(gen):
    ids_TK, x, gate, w, layout = _case("gelu", False, torch.float32, gen)
    weights = ExpertWeights(w["w1"], w["w2"])
    import dataclasses

    unsorted = dataclasses.replace(layout.schedule, slot_ends=None)  # e.g. an EP receive layout
    with pytest.raises(ValueError, match="slot-sorted layout"):
        grouped_mm_token_expert_mlp(
            x, layout.token_P, layout.pos_TK, gate, weights, unsorted, "gelu"
        )
    odd = ExpertWeights(w["w1"][:, :, :20], w["w2"][:, :20])  # F = 20: not a multiple of 8
    with pytest.raises(ValueError, match="multiples of 8"):
        grouped_mm_token_expert_mlp(
            x, layout.token_P, layout.pos_TK, gate, odd, layout.schedule, "gelu"
        )


def test_slot_ends_of_the_one_device_layout(gen):
    """``slot_ends``: each expert's padded blocks end there, in expert order (empty: no blocks)."""
    ids_TK = torch.tensor([[0, 2], [2, 2], [0, -1]])
    layout = expert_row_layout(ids_TK, 4, 16)
    assert layout.schedule.slot_ends == (16, 16, 32, 32)
    assert layout.schedule.block_slot_Nb.tolist() == [0, 2]


def test_grouped_path_transformers_weight_layout(gen):
    """transformers' experts keep ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F] and
    mixmoe reads them as transposed views (column-major GEMM operands): the gradients reach the
    stored parameters, equal to the loop's."""
    T, K, N, D, Fh = 40, 2, 5, 16, 24
    ids_TK = torch.randint(0, N - 1, (T, K), generator=gen)
    layout = expert_row_layout(ids_TK, N, 16)
    gate_up = (torch.randn(N, 2 * Fh, D, generator=gen) * D**-0.5).requires_grad_()
    down = (torch.randn(N, D, Fh, generator=gen) * Fh**-0.5).requires_grad_()
    x = torch.randn(T, D, generator=gen).requires_grad_()
    gate = torch.rand(T, K, generator=gen).requires_grad_()
    weights = ExpertWeights(gate_up.transpose(1, 2), down.transpose(1, 2))
    y = grouped_mm_token_expert_mlp(
        x, layout.token_P, layout.pos_TK, gate, weights, layout.schedule, "swiglu"
    )
    ref_w = {
        "w1": gate_up.detach().double()[:, :Fh].transpose(1, 2).requires_grad_(),
        "w3": gate_up.detach().double()[:, Fh:].transpose(1, 2).requires_grad_(),
        "w2": down.detach().double().transpose(1, 2).requires_grad_(),
    }
    ref_x, ref_gate = x.detach().double().requires_grad_(), gate.detach().double().requires_grad_()
    ref = loop_reference(ref_x, ids_TK, ref_gate, ref_w, "swiglu")
    torch.testing.assert_close(y.double(), ref.detach(), **TOL[torch.float32])
    dy = torch.randn(T, D, generator=gen, dtype=torch.float64)
    dx, dg, dgu, ddown = torch.autograd.grad(y, [x, gate, gate_up, down], dy.float())
    rx, rg, r1, r3, r2 = torch.autograd.grad(
        ref, [ref_x, ref_gate, ref_w["w1"], ref_w["w3"], ref_w["w2"]], dy
    )
    torch.testing.assert_close(dx.double(), rx, **TOL[torch.float32])
    torch.testing.assert_close(dg.double(), rg, **TOL[torch.float32])
    gate_up_ref = torch.cat([r1.transpose(1, 2), r3.transpose(1, 2)], dim=1)
    torch.testing.assert_close(dgu.double(), gate_up_ref, **TOL[torch.float32])
    torch.testing.assert_close(ddown.double(), r2.transpose(1, 2), **TOL[torch.float32])


def test_grouped_mm_switch(monkeypatch):
    from mixmoe.ops.grouped_mm_expert_mlp import grouped_mm_enabled

    monkeypatch.delenv("MIXMOE_GROUPED_MM", raising=False)
    assert grouped_mm_enabled()
    spellings = {"1": True, "true": True, "yes": True, "on": True, "": True, " ON ": True}
    spellings.update({"0": False, "false": False, "no": False, "off": False, "No": False})
    for value, expected in spellings.items():
        monkeypatch.setenv("MIXMOE_GROUPED_MM", value)
        assert grouped_mm_enabled() is expected
    monkeypatch.setenv("MIXMOE_GROUPED_MM", "2")
    with pytest.raises(ValueError, match="MIXMOE_GROUPED_MM='2'"):
        grouped_mm_enabled()


def test_layout_fits_each_condition(gen):
    """``layout_fits`` says no to every call the grouped body cannot run, one condition at a time."""
    import dataclasses

    ids_TK, x, gate, w, layout = _case("swiglu", True, torch.float32, gen)
    sched, pos = layout.schedule, layout.pos_TK
    full = ExpertWeights(w["w1"], w["w2"], w["b1"], w["b2"], w["w3"], w["b3"])
    assert layout_fits(x, pos, full, sched, "swiglu")
    cat = ExpertWeights(torch.cat([w["w1"], w["w3"]], 2), w["w2"])
    assert layout_fits(x, pos, cat, sched, "swiglu")
    no_up = ExpertWeights(w["w1"], w["w2"])
    assert not layout_fits(x, pos, no_up, sched, "swiglu")  # SwiGLU without its up half
    assert not layout_fits(x, pos, full, sched, "gelu")  # w3 given to a one-GEMM activation
    assert layout_fits(x, pos, no_up, sched, "gelu")
    assert not layout_fits(x, pos, no_up, sched, "tanh")
    assert not layout_fits(x, pos, no_up, dataclasses.replace(sched, slot_ends=None), "gelu")
    short = dataclasses.replace(sched, slot_ends=sched.slot_ends[:-1])
    assert not layout_fits(x, pos, no_up, short, "gelu")  # one end per weight slot
    assert not layout_fits(x[:0], pos, no_up, sched, "gelu")
    other = ExpertWeights(w["w1"].double(), w["w2"])
    assert not layout_fits(x, pos, other, sched, "gelu")  # one dtype for x and every weight
    assert not layout_fits(x.double(), pos, no_up, sched, "gelu")
    wide = ExpertWeights(torch.zeros(5, 20, 24), torch.zeros(5, 24, 20))  # D = 20: not 8 | D
    assert not layout_fits(torch.zeros(40, 20), pos, wide, sched, "gelu")
    dropped = expert_row_layout(torch.full_like(ids_TK, -1), 5, 16)  # no row: P = 0
    assert not layout_fits(x, dropped.pos_TK, no_up, dropped.schedule, "gelu")
    # bf16 on CPU is still not the default path (it is CUDA's, Hopper's)
    bf = ExpertWeights(w["w1"].bfloat16(), w["w2"].bfloat16())
    assert layout_fits(x.bfloat16(), pos, bf, sched, "gelu")
    assert not grouped_mm_path_applies(x.bfloat16(), pos, bf, sched, "gelu")


def test_grouped_path_when_the_last_padded_row_is_a_real_row(gen):
    """Every expert's rows fill whole blocks: the last padded row holds a routed row (no padding
    at the end of the layout to hide an off-by-one in the reads of the output rows)."""
    T, K, N, D, Fh, B = 32, 2, 4, 8, 16, 16
    ids_TK = (torch.arange(T * K) % N).view(T, K)  # 16 rows per expert: whole blocks
    layout = expert_row_layout(ids_TK, N, B)
    assert layout.schedule.num_padded_rows == T * K
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    gate = torch.rand(T, K, generator=gen, requires_grad=True)
    w1 = torch.randn(N, D, Fh, generator=gen, requires_grad=True)
    w2 = torch.randn(N, Fh, D, generator=gen, requires_grad=True)
    args = (layout.token_P, layout.pos_TK, gate, ExpertWeights(w1, w2), layout.schedule, "gelu")
    y = grouped_mm_token_expert_mlp(x, *args)
    ref = token_expert_mlp(x, *args, fused=False)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    dy = torch.randn(y.shape, generator=gen)
    for a, r in zip(
        torch.autograd.grad(y, [x, gate, w1, w2], dy),
        torch.autograd.grad(ref, [x, gate, w1, w2], dy),
        strict=True,
    ):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)


def test_grouped_path_with_some_inputs_frozen(gen):
    """Only some inputs need gradients (the input is data, the first expert weight is frozen, the
    router and the second weight train): those gradients equal the reference's, the others are
    not returned."""
    ids_TK, x, gate, w, layout = _case("gelu", False, torch.float32, gen)
    x, w1 = x.detach(), w["w1"].detach()
    args = (layout.token_P, layout.pos_TK, gate, ExpertWeights(w1, w["w2"]), layout.schedule)
    y = grouped_mm_token_expert_mlp(x, *args, "gelu")
    ref = token_expert_mlp(x, *args, "gelu", fused=False)
    dy = torch.randn(y.shape, generator=gen)
    ours = torch.autograd.grad(y, [gate, w["w2"]], dy)
    theirs = torch.autograd.grad(ref, [gate, w["w2"]], dy)
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
