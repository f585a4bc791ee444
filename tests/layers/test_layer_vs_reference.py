"""The MoE layer against the per-token oracle ``mixmoe.reference.moe.reference_moe``.

Forward, aux losses, counts, and the gradients of x, the gate (weight, bias) and every expert
parameter, for every gate, activation, dtype, top-k, token count and block size.

Legend: T tokens, D model dim, F hidden dim, N experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch
from _unit_helpers import F32_TOL, layer_params, make_layer, reference_params, seed_for
from torch.testing import assert_close

from mixmoe.reference.moe import reference_moe

GATES = [
    ("topk", "topk_softmax"),
    ("topk", "softmax_renorm"),
    ("topk", "softmax"),
    ("switch", "topk_softmax"),
    ("gshard", "topk_softmax"),
]
GATE_IDS = ["topk-topk_softmax", "topk-softmax_renorm", "topk-softmax", "switch", "gshard"]
ACTIVATIONS = ["gelu", "relu", "silu", "swiglu"]
DTYPES = [torch.float64, torch.float32]

# float64: fast path and oracle differ only in summation order.
F64_TOL = {"rtol": 1e-9, "atol": 1e-10}


def tol_for(dtype: torch.dtype) -> dict:
    return F64_TOL if dtype == torch.float64 else F32_TOL


def kill_expert(layer, expert: int) -> None:
    """Bias the gate so ``expert`` is never among the top choices (for K < N)."""
    with torch.no_grad():
        layer.gate.wg.bias[expert] = -50.0


def compare_with_oracle(
    layer,
    x: torch.Tensor,
    *,
    gate: str,
    normalize: str,
    activation: str,
    tol: dict,
    dropped: set[tuple[int, int]] | None = None,
    dead: int | None = None,
) -> None:
    cfg = layer.config
    ref = reference_params(layer)
    x_layer = x.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()

    y, aux = layer(x_layer)
    y_ref, balance_ref, z_ref, counts_ref = reference_moe(
        x_ref,
        ref,
        top_k=cfg.top_k,
        gate_type=gate,
        normalize=normalize,
        activation=activation,
        dropped=dropped,
    )

    # forward and aux
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, y_ref, **tol)
    assert aux.counts_N.dtype == torch.int64
    assert aux.counts_N.tolist() == counts_ref
    assert_close(aux.balance_loss.to(x.dtype), balance_ref, **tol)
    assert_close(aux.z_loss.to(x.dtype), z_ref, **tol)
    assert_close(aux.loss, cfg.aux_loss_coef * aux.balance_loss + cfg.z_loss_coef * aux.z_loss)
    loss_ref = cfg.aux_loss_coef * balance_ref + cfg.z_loss_coef * z_ref
    assert_close(aux.loss.to(x.dtype), loss_ref, **tol)

    # backward through the output AND the aux loss (both reach the gate)
    dy = torch.randn_like(y)
    ((y * dy).sum() + aux.loss).backward()
    ((y_ref * dy).sum() + loss_ref).backward()
    assert_close(x_layer.grad, x_ref.grad, **tol)
    for name, p in layer_params(layer).items():
        if p is None:
            assert ref[name] is None
            continue
        assert p.grad is not None, f"{name} got no gradient"
        assert_close(p.grad, ref[name].grad, **tol, msg=lambda m, n=name: f"grad of {n}: {m}")

    if dead is not None:
        assert aux.counts_N[dead].item() == 0
        for name in ("w1", "b1", "w2", "b2", "w3", "b3"):
            p = getattr(layer.experts, name)
            if p is not None:
                assert torch.equal(p.grad[dead], torch.zeros_like(p.grad[dead])), name


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gate,normalize", GATES, ids=GATE_IDS)
def test_every_gate_activation_dtype(gate, normalize, activation, dtype):
    """T=65 (one full 16-row block run plus a partial one per expert), one expert never chosen."""
    seed = seed_for("matrix", gate, normalize, activation, dtype)
    torch.manual_seed(seed)
    layer = make_layer(
        gate=gate,
        normalize=normalize,
        activation=activation,
        num_experts=4,
        block_size=16,
        dtype=dtype,
    )
    dead = seed % 4
    kill_expert(layer, dead)
    x = torch.randn(65, 8, dtype=dtype)
    compare_with_oracle(
        layer,
        x,
        gate=gate,
        normalize=normalize,
        activation=activation,
        tol=tol_for(dtype),
        dead=dead,
    )


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_top_k_and_token_counts(top_k, T, block_size):
    """top_k in {1, 2, N=5}; T around the 64-row block boundary; block sizes 16 and 64."""
    N = 5
    normalize = ("topk_softmax", "softmax_renorm")[T % 2]
    activation = ACTIVATIONS[(T + top_k) % 4]
    seed = seed_for("topk", top_k, T, block_size)
    torch.manual_seed(seed)
    layer = make_layer(
        normalize=normalize,
        activation=activation,
        num_experts=N,
        top_k=top_k,
        block_size=block_size,
        dtype=torch.float64,
    )
    dead = None
    if top_k < N:
        dead = seed % N
        kill_expert(layer, dead)
    x = torch.randn(T, 8, dtype=torch.float64)
    compare_with_oracle(
        layer, x, gate="topk", normalize=normalize, activation=activation, tol=F64_TOL, dead=dead
    )


@pytest.mark.parametrize(
    "gate,normalize,activation,dtype,block_size",
    [
        ("topk", "softmax_renorm", "swiglu", torch.float32, 64),
        ("gshard", "topk_softmax", "gelu", torch.float64, 16),
    ],
    ids=["topk-swiglu-f32-b64", "gshard-gelu-f64-b16"],
)
def test_many_tokens(gate, normalize, activation, dtype, block_size):
    """T=1000: many full blocks per expert plus partial tails."""
    torch.manual_seed(seed_for("many", gate, activation, dtype))
    layer = make_layer(
        gate=gate,
        normalize=normalize,
        activation=activation,
        num_experts=6,
        block_size=block_size,
        dtype=dtype,
    )
    x = torch.randn(1000, 8, dtype=dtype)
    compare_with_oracle(
        layer, x, gate=gate, normalize=normalize, activation=activation, tol=tol_for(dtype)
    )


@pytest.mark.parametrize("shape", [(3, 21, 8), (1, 1, 8), (2, 32, 8)], ids=str)
@pytest.mark.parametrize("gate,normalize", GATES, ids=GATE_IDS)
def test_batch_sequence_input(gate, normalize, shape):
    """[B, S, D] input: output keeps the shape and equals the oracle on the flattened tokens."""
    torch.manual_seed(seed_for("bsd", gate, normalize, shape))
    layer = make_layer(
        gate=gate,
        normalize=normalize,
        activation="silu",
        num_experts=4,
        block_size=16,
        dtype=torch.float32,
    )
    x = torch.randn(*shape)
    compare_with_oracle(layer, x, gate=gate, normalize=normalize, activation="silu", tol=F32_TOL)


@pytest.mark.parametrize("gate,normalize", GATES, ids=GATE_IDS)
def test_without_biases(gate, normalize):
    """bias=False (experts) and gate bias=False: the oracle is given None for them."""
    torch.manual_seed(seed_for("nobias", gate, normalize))
    layer = make_layer(
        gate=gate,
        normalize=normalize,
        activation="swiglu",
        num_experts=4,
        block_size=16,
        bias=False,
        gate_bias=False,
    )
    assert layer.experts.b1 is None and layer.gate.wg.bias is None
    x = torch.randn(40, 8, dtype=torch.float64)
    compare_with_oracle(layer, x, gate=gate, normalize=normalize, activation="swiglu", tol=F64_TOL)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gshard_random_routing_matches_oracle_with_dropped(seed):
    torch.manual_seed(seed_for("gshard-random", seed))
    layer = make_layer(
        gate="gshard", random_routing=True, num_experts=4, block_size=16, activation="gelu"
    )
    layer.train()
    T = 120
    x = torch.randn(T, 8, dtype=torch.float64)

    layer.gate.generator = torch.Generator().manual_seed(seed)
    routing, _, _ = layer.gate(x)
    ids, weights = routing.ids_TK, routing.weights_TK
    assert (ids[:, 0] >= 0).all(), "the first choice is never dropped"
    dropped_T = ids[:, 1] == -1
    assert 0 < int(dropped_T.sum()) < T, "expected some but not all 2nd choices dropped"
    assert torch.equal(weights[dropped_T, 1], torch.zeros_like(weights[dropped_T, 1]))
    assert ((ids == -1) == (ids < 0)).all() and (ids >= -1).all()
    dropped = {(t, 1) for t in torch.nonzero(dropped_T).flatten().tolist()}

    # same generator state -> the layer forward draws the same drops
    layer.gate.generator = torch.Generator().manual_seed(seed)
    compare_with_oracle(
        layer,
        x,
        gate="gshard",
        normalize="topk_softmax",
        activation="gelu",
        tol=F64_TOL,
        dropped=dropped,
    )


def test_gshard_random_routing_off_in_eval():
    torch.manual_seed(seed_for("gshard-eval"))
    layer = make_layer(gate="gshard", random_routing=True, num_experts=4, block_size=16)
    layer.eval()
    layer.gate.generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 8, dtype=torch.float64)
    routing, _, _ = layer.gate(x)
    assert (routing.ids_TK >= 0).all()
    compare_with_oracle(
        layer, x, gate="gshard", normalize="topk_softmax", activation="gelu", tol=F64_TOL
    )


@pytest.mark.parametrize("gate,normalize", GATES, ids=GATE_IDS)
def test_float64_layer_matches_oracle_to_float64_precision(gate, normalize):
    """Fast path and oracle differ only in summation order: float64 should agree to ~1e-12."""
    torch.manual_seed(seed_for("f64-strict", gate, normalize))
    layer = make_layer(gate=gate, normalize=normalize, num_experts=4, block_size=16)
    x = torch.randn(65, 8, dtype=torch.float64)
    _, aux = layer(x)
    assert aux.balance_loss.dtype == torch.float64
    assert aux.z_loss.dtype == torch.float64
    compare_with_oracle(
        layer,
        x,
        gate=gate,
        normalize=normalize,
        activation="gelu",
        tol={"rtol": 1e-9, "atol": 1e-10},
    )


@pytest.mark.parametrize("gate,normalize", GATES, ids=GATE_IDS)
def test_bfloat16_forward_close_to_float64(gate, normalize):
    """The bf16 layer's forward against the same weights in float64.

    Tolerance: bf16 keeps 8 significant bits (unit roundoff 2**-9 ~ 2e-3). The input, the weights
    and each of the two GEMM outputs, the activation and the combine are rounded once each, so the
    output error is a few roundoffs of the output scale: ~1e-2 * max|y|. We allow 3e-2 * max|y|.
    Tokens whose top-k choice flips under bf16 rounding of near-tied logits are a legitimate
    discontinuity, not an error: they are excluded (and must be rare).
    """
    torch.manual_seed(seed_for("bf16", gate, normalize))
    layer64 = make_layer(
        gate=gate,
        normalize=normalize,
        activation="gelu",
        num_experts=4,
        model_dim=16,
        hidden_dim=32,
        block_size=16,
    )
    layer16 = make_layer(
        gate=gate,
        normalize=normalize,
        activation="gelu",
        num_experts=4,
        model_dim=16,
        hidden_dim=32,
        block_size=16,
        dtype=torch.bfloat16,
    )
    layer16.load_state_dict(layer64.state_dict())
    layer64.load_state_dict(layer16.state_dict())  # both hold the bf16-representable weights
    x = torch.randn(200, 16, dtype=torch.float64).bfloat16()

    y16, aux16 = layer16(x)
    y64, aux64 = layer64(x.double())
    assert y16.dtype == torch.bfloat16 and y16.shape == x.shape
    with torch.no_grad():
        same_T = (layer16.gate(x)[0].ids_TK == layer64.gate(x.double())[0].ids_TK).all(dim=1)
    assert same_T.float().mean() > 0.9
    scale = y64.abs().max().item()
    assert_close(y16.double()[same_T], y64[same_T], rtol=0.0, atol=3e-2 * scale)
    assert_close(aux16.balance_loss.double(), aux64.balance_loss.double(), rtol=3e-2, atol=0.0)


def test_bfloat16_backward_close_to_float64():
    """bf16 backward: dx of tokens whose routing agrees with float64 is within 5e-2 of the scale
    of the float64 dx (one more GEMM of rounding than the forward); weight grads are bf16 and finite.
    The aux loss is left out: it couples all tokens, so a single flipped token would leak into all.
    """
    torch.manual_seed(seed_for("bf16-backward"))
    kw = {
        "activation": "swiglu",
        "num_experts": 4,
        "model_dim": 16,
        "hidden_dim": 32,
        "block_size": 16,
    }
    layer64 = make_layer(**kw)
    layer16 = make_layer(**kw, dtype=torch.bfloat16)
    layer16.load_state_dict(layer64.state_dict())
    layer64.load_state_dict(layer16.state_dict())
    x = torch.randn(150, 16, dtype=torch.float64).bfloat16()
    x16, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    dy = torch.randn(150, 16, dtype=torch.float64).bfloat16()
    layer16(x16)[0].backward(dy)
    layer64(x64)[0].backward(dy.double())
    with torch.no_grad():
        same_T = (layer16.gate(x)[0].ids_TK == layer64.gate(x.double())[0].ids_TK).all(dim=1)
    assert same_T.float().mean() > 0.9
    assert x16.grad.dtype == torch.bfloat16
    scale = x64.grad.abs().max().item()
    assert_close(x16.grad.double()[same_T], x64.grad[same_T], rtol=0.0, atol=5e-2 * scale)
    for name, p in layer_params(layer16).items():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(p.grad).all(), name
