"""GPU tier: the kernels at real sizes through the autotuned launch path, the fused expert MLP
and the whole MoE layer on CUDA vs the CPU path, determinism and torch.compile.

Skipped (with the reason) without CUDA; run on a GPU machine with ``pytest tests/kernels -m gpu``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _layout(T, K, N, block_size, skew, seed):
    from mixmoe.dispatch.layout import expert_row_layout
    from mixmoe.gating.synthetic import RoutingSpec, synthetic_ids

    gen = torch.Generator().manual_seed(seed)
    ids_TK = synthetic_ids(RoutingSpec.parse(skew), T, K, N, gen)
    return ids_TK, expert_row_layout(ids_TK.cuda(), N, block_size)


def _close(name, out, truth, dtype, ref=None):
    """fp32: tight. fp16/bf16: within a few units of rounding of the output's magnitude, and no
    worse than 2x the CPU low-precision path (``ref``) when given."""
    out, truth = out.detach().float().cpu(), truth.detach().float().cpu()
    scale = truth.abs().max().item() + 1e-6
    err = (out - truth).abs().max().item()
    if dtype == torch.float32:
        bound = 1e-4 * scale
    else:
        eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
        bound = 4 * eps * scale
        if ref is not None:
            bound = max(bound, 2 * (ref.detach().float().cpu() - truth).abs().max().item())
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (max |truth| {scale:.3g})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("skew", ["uniform", "hot:0.6"])
def test_kernels_real_sizes(dtype, block_size, skew):
    from mixmoe import kernels
    from mixmoe.ops.fused_linear import choice_of_row_P

    T, K, N, D, F = 4096, 2, 8, 1024, 2048
    ids_TK, layout = _layout(T, K, N, block_size, skew, seed=1)
    s = layout.schedule
    meta = (s.block_slot_Nb, s.block_rows_Nb)
    P = s.num_padded_rows
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, D, F, device="cuda", generator=g) * D**-0.5).to(dtype)
    b = torch.randn(N, F, device="cuda", generator=g).to(dtype)
    valid = (s.src_P >= 0)[:, None]
    slot_P = s.block_slot_Nb.repeat_interleave(block_size)
    x_PD = torch.nn.functional.pad(x, (0, 0, 0, 1))[layout.token_P].float()

    # forward GEMM with fused gather + bias (autotuned)
    y = kernels.grouped_gemm(x, w, b, *meta, block_size=block_size, row_index_P=layout.token_P)
    truth = torch.where(
        valid,
        torch.bmm(x_PD.view(-1, block_size, D), w.float()[s.block_slot_Nb]).view(P, F)
        + b.float()[slot_P],
        0.0,
    )
    _close("gather_gemm", y, truth, dtype)

    # second GEMM scattered to token-choice order + combine
    h = torch.randn(P, F, device="cuda", generator=g).to(dtype)
    w2 = (torch.randn(N, F, D, device="cuda", generator=g) * F**-0.5).to(dtype)
    tk_P = choice_of_row_P(layout.pos_TK, P)
    rows = kernels.grouped_gemm(
        h, w2, None, *meta, block_size=block_size, out_index_P=tk_P, num_out_rows=T * K
    )
    out_P = torch.bmm(h.float().view(-1, block_size, F), w2.float()[s.block_slot_Nb]).view(P, D)
    rows_truth = torch.nn.functional.pad(out_P, (0, 0, 0, 1))[layout.pos_TK].view(T * K, D)
    _close("scatter_gemm", rows, rows_truth, dtype)
    weights = torch.rand(T, K, device="cuda", generator=g)
    y = kernels.combine_choices(rows, layout.pos_TK, weights, num_padded_rows=P)
    _close("combine", y, (rows.float().view(T, K, D) * weights[..., None]).sum(1), dtype)

    # dX: transposed weights, scatter + unit combine
    dy = torch.randn(P, F, device="cuda", generator=g).to(dtype)
    dx_rows = kernels.grouped_gemm(
        dy,
        w.transpose(1, 2),
        None,
        *meta,
        block_size=block_size,
        out_index_P=tk_P,
        num_out_rows=T * K,
    )
    dx = kernels.combine_choices(dx_rows, layout.pos_TK, None, num_padded_rows=P)
    dx_P = torch.where(
        valid,
        torch.bmm(
            dy.float().view(-1, block_size, F), w.float()[s.block_slot_Nb].transpose(1, 2)
        ).view(P, D),
        0.0,
    )
    dx_truth = torch.zeros(T + 1, D, device="cuda").index_add_(0, layout.token_P, dx_P)[:T]
    _close("dx", dx, dx_truth, dtype)

    # dW, db with the gathered input
    dw, db = kernels.grouped_weight_grad(
        x, dy, *meta, num_slots=N, block_size=block_size, with_bias=True, x_index_P=layout.token_P
    )
    dy_valid = torch.where(valid, dy.float(), 0.0)
    dw_truth = torch.zeros(N, D, F, device="cuda")
    for e in range(N):
        rows_e = slot_P == e
        dw_truth[e] = x_PD[rows_e].T @ dy_valid[rows_e]
    db_truth = torch.zeros(N, F, device="cuda").index_add_(0, slot_P, dy_valid)
    _close("dw", dw, dw_truth, dtype)
    _close("db", db, db_truth, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_fused_expert_mlp_vs_cpu(dtype, activation):
    from mixmoe.ops.expert_mlp import ExpertWeights
    from mixmoe.ops.token_expert_mlp import token_expert_mlp

    T, K, N, D, F = 2048, 2, 8, 512, 1024
    ids_TK, layout = _layout(T, K, N, 64, "zipf:1.2", seed=2)
    g = torch.Generator().manual_seed(3)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    cpu = {
        "x": leaf(T, D),
        "g": torch.rand(T, K, generator=g),
        "w1": leaf(N, D, F, scale=D**-0.5),
        "b1": leaf(N, F),
        "w2": leaf(N, F, D, scale=F**-0.5),
        "b2": leaf(N, D),
        "w3": leaf(N, D, F, scale=D**-0.5) if activation == "swiglu" else None,
    }
    dy = torch.randn(T, D, generator=g).to(dtype)

    def run(device, dtype_, fused):
        t = {
            k: v.to(
                device, dtype_ if v.is_floating_point() and k != "g" else v.dtype
            ).requires_grad_()
            for k, v in cpu.items()
            if v is not None
        }
        lay = layout if device == "cuda" else _layout_to(layout, device)
        ew = ExpertWeights(t["w1"], t["w2"], t["b1"], t["b2"], t.get("w3"))
        y = token_expert_mlp(
            t["x"], lay.token_P, lay.pos_TK, t["g"], ew, lay.schedule, activation, fused=fused
        )
        grads = torch.autograd.grad(y, list(t.values()), dy.to(device, y.dtype))
        return y, dict(zip(t, grads, strict=True))

    y, grads = run("cuda", dtype, None)  # fused on CUDA
    y_ref, g_ref = run("cpu", dtype, False)
    y_32, g_32 = run("cpu", torch.float32, False)
    _close("y", y, y_32, dtype, y_ref)
    for name in grads:
        _close(f"d{name}", grads[name], g_32[name], dtype, g_ref[name])
    # deterministic: the same call twice gives the same bits
    y2, grads2 = run("cuda", dtype, None)
    assert torch.equal(y, y2) and all(torch.equal(grads[k], grads2[k]) for k in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_forward_backward_vs_cpu(dtype):
    """The whole MoE layer on CUDA (Triton grouped GEMMs) vs the same layer on CPU."""
    from mixmoe.config import MoEConfig
    from mixmoe.gating.synthetic import RoutingSpec, SyntheticGate, synthetic_ids
    from mixmoe.layers.moe import MoE

    T, N, K, D, F = 1024, 8, 2, 256, 512
    cfg = MoEConfig(model_dim=D, hidden_dim=F, num_experts=N, top_k=K)
    ids_TK = synthetic_ids(RoutingSpec.parse("hot:0.5"), T, K, N, torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    layer = MoE(cfg, gate=SyntheticGate(cfg, ids_TK), dtype=dtype)
    layer.gate.to(dtype)
    x = torch.randn(T, D).to(dtype)
    dy = torch.randn(T, D).to(dtype)
    layers = {
        "cpu": layer,
        "cpu32": copy.deepcopy(layer).float(),
        "cuda": copy.deepcopy(layer).cuda(),
    }

    def run(name):
        module = layers[name]
        p = next(module.parameters())
        y, aux = module(x.to(p.device, p.dtype))
        torch.autograd.backward(
            [y, aux.loss], [dy.to(p.device, p.dtype), torch.ones_like(aux.loss)]
        )
        return y, {n: q.grad for n, q in module.named_parameters()}

    (y, grads), (y_ref, g_ref), (y_32, g_32) = run("cuda"), run("cpu"), run("cpu32")
    _close("y", y, y_32, dtype, y_ref)
    for name in grads:
        _close(f"{name}.grad", grads[name], g_32[name], dtype, g_ref[name])


@pytest.mark.parametrize(
    "activation,concatenated", [("gelu", False), ("swiglu", False), ("swiglu", True)]
)
def test_grouped_mm_path_vs_triton_and_cpu(activation, concatenated, monkeypatch):
    """bf16 on a slot-sorted layout takes torch's grouped GEMM (Hopper): same forward and
    gradients as the Triton kernels (``MIXMOE_GROUPED_MM=0``) and the CPU float32 reference, an
    expert without rows gets exactly zero gradients, and it is deterministic."""
    from mixmoe.ops.expert_mlp import ExpertWeights
    from mixmoe.ops.token_expert_mlp import token_expert_mlp

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the grouped-GEMM path needs compute capability >= 9.0")
    T, K, N, D, F = 4096, 2, 8, 1024, 2048
    from mixmoe.dispatch.layout import expert_row_layout
    from mixmoe.gating.synthetic import RoutingSpec, synthetic_ids

    ids_TK = synthetic_ids(
        RoutingSpec.parse("hot:0.6"), T, K, N - 1, torch.Generator().manual_seed(8)
    )
    ids_TK[5, 1] = -1  # a dropped choice; expert N - 1 gets no row
    layout = expert_row_layout(ids_TK.cuda(), N, 64)
    g = torch.Generator().manual_seed(9)

    def leaf(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    width = 2 * F if concatenated else F
    cpu = {
        "x": leaf(T, D),
        "g": torch.rand(T, K, generator=g),
        "w1": leaf(N, D, width, scale=D**-0.5),
        "b1": leaf(N, width),
        "w2": leaf(N, F, D, scale=F**-0.5),
        "b2": leaf(N, D),
    }
    if activation == "swiglu" and not concatenated:
        cpu["w3"] = leaf(N, D, F, scale=D**-0.5)
    dy = torch.randn(T, D, generator=g)

    def run(device, dtype, fused=True):
        t = {
            k: v.to(device, dtype if k != "g" else v.dtype).requires_grad_() for k, v in cpu.items()
        }
        lay = layout if device == "cuda" else _layout_to(layout, device)
        ew = ExpertWeights(t["w1"], t["w2"], t["b1"], t["b2"], t.get("w3"))
        y = token_expert_mlp(
            t["x"], lay.token_P, lay.pos_TK, t["g"], ew, lay.schedule, activation, fused=fused
        )
        path = type(y.grad_fn).__name__
        grads = torch.autograd.grad(y, list(t.values()), dy.to(device, y.dtype))
        return y, dict(zip(t, grads, strict=True)), path

    y, grads, path = run("cuda", torch.bfloat16)
    assert path == "_GroupedTokenExpertMLPBackward", path
    monkeypatch.setenv("MIXMOE_GROUPED_MM", "0")
    y_tr, g_tr, path_tr = run("cuda", torch.bfloat16)
    assert path_tr != path
    y_32, g_32, _ = run("cpu", torch.float32, fused=False)
    _close("y", y, y_32, torch.bfloat16, y_tr)
    for name in grads:
        _close(f"d{name}", grads[name], g_32[name], torch.bfloat16, g_tr[name])
        if name.startswith(("w", "b")):
            assert torch.count_nonzero(grads[name][N - 1]) == 0, name
    monkeypatch.setenv("MIXMOE_GROUPED_MM", "1")
    y2, grads2, _ = run("cuda", torch.bfloat16)
    assert torch.equal(y, y2) and all(torch.equal(grads[k], grads2[k]) for k in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_compile_cuda(dtype, monkeypatch):
    """Compiled == eager on the same kernels. Inside torch.compile the Triton custom ops run (the
    grouped-GEMM path steps aside there), so eager bf16 is pinned to them too: comparing two
    different bf16 implementations would only measure rounding."""
    monkeypatch.setenv("MIXMOE_GROUPED_MM", "0")
    from mixmoe.ops.expert_mlp import ExpertWeights
    from mixmoe.ops.token_expert_mlp import token_expert_mlp

    T, K, N, D, F = 512, 2, 4, 128, 256
    ids_TK, layout = _layout(T, K, N, 64, "uniform", seed=6)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(T, D, device="cuda", generator=g).to(dtype).requires_grad_()
    w1 = torch.randn(N, D, F, device="cuda", generator=g).mul_(D**-0.5).to(dtype).requires_grad_()
    w2 = torch.randn(N, F, D, device="cuda", generator=g).mul_(F**-0.5).to(dtype).requires_grad_()
    weights = torch.rand(T, K, device="cuda", generator=g, requires_grad=True)

    def mlp(x, w1, w2, weights):
        ew = ExpertWeights(w1, w2)
        return token_expert_mlp(
            x, layout.token_P, layout.pos_TK, weights, ew, layout.schedule, "gelu"
        )

    eager = mlp(x, w1, w2, weights)
    compiled = torch.compile(mlp, fullgraph=True)(x, w1, w2, weights)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(compiled, eager, **tol)
    dy = torch.randn_like(eager)
    for a, r in zip(
        torch.autograd.grad(compiled, [x, w1, w2, weights], dy),
        torch.autograd.grad(eager, [x, w1, w2, weights], dy),
        strict=True,
    ):
        torch.testing.assert_close(a, r, **tol)


def _layout_to(layout, device):
    from dataclasses import fields, replace

    schedule = layout.schedule
    moved = {
        f.name: getattr(schedule, f.name).to(device)
        for f in fields(schedule)
        if isinstance(getattr(schedule, f.name), torch.Tensor)
    }
    return replace(
        layout,
        schedule=replace(schedule, **moved),
        token_P=layout.token_P.to(device),
        pos_TK=layout.pos_TK.to(device),
        counts_N=layout.counts_N.to(device),
    )


def test_combine_weights_grad_fp32_accumulation_real_sizes():
    """The width-4096 bf16 check of ``test_kernels.py`` at a real token count, default launch."""
    from test_kernels import check_combine_weights_grad_wide_bf16

    gen = torch.Generator().manual_seed(16)
    check_combine_weights_grad_wide_bf16(8192, 2, 16384, gen, torch.device("cuda"))


def test_float64_layer_on_cuda_is_a_clear_error():
    """The Triton kernels take fp32/bf16/fp16: a float64 layer on CUDA is refused at the layer
    with the fix, not deep inside a kernel launcher (found on an H200, 2026-11-26)."""
    from mixmoe import MoE, MoEConfig

    layer = MoE(MoEConfig(model_dim=32, hidden_dim=64, num_experts=4), device="cuda")
    layer = layer.double()
    with pytest.raises(TypeError, match="float64 experts run on the CPU only"):
        layer(torch.randn(8, 32, device="cuda", dtype=torch.float64))
