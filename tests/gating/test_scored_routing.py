"""DeepSeek-style routing in mixmoe's own layer against the per-token twin
``mixmoe.reference.scored_moe``: softmax | sigmoid scores, group-limited top-k (sum of top-2 and
max group scores), normalised or not, route_scale, the selection-only expert bias, shared
experts (with and without their sigmoid gate), padding, the sequence and global-batch losses;
forward, aux losses, counts and every gradient. Plus the config errors, hand-computed cases,
tie-breaking and the float32 router under bfloat16.

Legend: T tokens, D model dim, N experts, K top-k, G groups.
"""

from __future__ import annotations

import pytest
import torch
from _unit_helpers import seed_for
from torch.testing import assert_close

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.gating.routing import scored_route
from mixmoe.layers.experts import EXPERT_PARAM_NAMES
from mixmoe.reference.scored_moe import reference_scored_moe, reference_scored_route

TOL = {"rtol": 1e-9, "atol": 1e-10}
SHARED_NAMES = ("w1", "b1", "w2", "b2", "w3", "b3", "gate_w")


def _layer(gate: GateConfig, *, N=8, K=3, activation="gelu", **moe) -> MoE:
    cfg = MoEConfig(
        model_dim=6,
        hidden_dim=5,
        num_experts=N,
        top_k=K,
        activation=activation,
        gate=gate,
        aux_loss_coef=0.3,
        z_loss_coef=0.01,
        **moe,
    )
    return MoE(cfg, dtype=torch.float64)


def _params(layer: MoE) -> dict:
    """Layer params under the twin's names (the layer's own tensors)."""
    p = {"gate_w": layer.gate.wg.weight, "gate_b": layer.gate.wg.bias}
    p.update({n: getattr(layer.experts, n) for n in EXPERT_PARAM_NAMES})
    if layer.shared is not None:
        p.update({f"shared_{n}": getattr(layer.shared, n) for n in SHARED_NAMES})
    return p


CASES = {
    "sigmoid-renorm": ({"score": "sigmoid", "normalize": "renorm"}, {}),
    "sigmoid-none-scale": ({"score": "sigmoid", "normalize": "none", "route_scale": 2.5}, {}),
    "softmax-renorm-scale": ({"normalize": "softmax_renorm", "route_scale": 1.7}, {}),
    "softmax-none-max-groups": (
        {"normalize": "softmax", "n_groups": 4, "topk_groups": 2, "group_score": "max"},
        {},
    ),
    "softmax-topk_softmax-bias": ({"expert_bias": True}, {}),
    "dsv3-sum_top2-bias-shared": (
        {
            "score": "sigmoid",
            "normalize": "renorm",
            "n_groups": 4,
            "topk_groups": 2,
            "route_scale": 2.0,
            "expert_bias": True,
        },
        {"shared_experts": 2, "shared_hidden_dim": 3, "activation": "swiglu"},
    ),
    "qwen-shared-gate-sequence": (
        {"normalize": "softmax"},
        {"shared_experts": 1, "shared_gate": True, "balance_loss": "sequence"},
    ),
    "sigmoid-groups-global": (
        {"score": "sigmoid", "normalize": "renorm", "n_groups": 2, "topk_groups": 1},
        {"balance_loss": "global_batch", "activation": "relu"},
    ),
}


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_per_token_twin(case, padded):
    gate_kw, moe_kw = CASES[case]
    torch.manual_seed(seed_for("scored", case, padded))
    activation = moe_kw.pop("activation", "gelu") if "activation" in moe_kw else "gelu"
    layer = _layer(GateConfig(**gate_kw), activation=activation, **moe_kw)
    K = layer.config.top_k
    bias = None
    if layer.gate.expert_bias is not None:  # a non-trivial selection bias (float32 buffer)
        layer.gate.expert_bias.copy_(torch.randn(8) * 0.2)
        bias = layer.gate.expert_bias.double().tolist()
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    pad = (torch.rand(3, 7) < 0.3) if padded else None
    if padded:
        pad[1] = True  # a sequence with no valid token: left out of the sequence loss
    x_l = x.clone().requires_grad_()
    x_r = x.clone().requires_grad_()
    ref = {
        k: None if v is None else v.detach().clone().requires_grad_()
        for k, v in _params(layer).items()
    }
    y, aux = layer(x_l, padding_mask=pad)
    y_r, bal_r, z_r, counts_r = reference_scored_moe(
        x_r,
        ref,
        top_k=K,
        activation=layer.config.activation,
        **{k: v for k, v in gate_kw.items() if k != "expert_bias"},
        expert_bias=bias,
        padding=None if pad is None else pad.reshape(-1).tolist(),
        balance_loss=layer.config.balance_loss,
        seq_len=7,
        global_counts=None,  # one device: the global batch is this batch
    )
    assert aux.counts_N.tolist() == counts_r
    assert_close(y, y_r, **TOL)
    assert_close(aux.balance_loss, bal_r, **TOL)
    assert_close(aux.z_loss, z_r, **TOL)
    dy = torch.randn_like(y)
    ((y * dy).sum() + aux.loss).backward()
    ((y_r * dy).sum() + 0.3 * bal_r + 0.01 * z_r).backward()
    assert_close(x_l.grad, x_r.grad, **TOL)
    for name, p in _params(layer).items():
        if p is None:
            assert ref[name] is None
            continue
        assert p.grad is not None, name
        assert_close(p.grad, ref[name].grad, **TOL, msg=lambda m, n=name: f"grad of {n}: {m}")
    if bias is not None:
        assert layer.gate.expert_bias.grad is None  # a buffer: selection only


def test_route_equals_twin_on_many_tokens_and_ties():
    # coarse logits (multiples of 0.5) make equal scores and equal group scores frequent
    torch.manual_seed(seed_for("ties"))
    gate = GateConfig(score="sigmoid", normalize="renorm", n_groups=4, topk_groups=2)
    logits = (torch.randint(-2, 3, (200, 8)) * 0.5).double()
    r = scored_route(logits, 3, gate)
    for t in range(200):
        ids, w = reference_scored_route(
            logits[t], 3, score="sigmoid", normalize="renorm", n_groups=4, topk_groups=2
        )
        assert r.ids_TK[t].tolist() == ids
        assert_close(r.weights_TK[t], w, **TOL)


def test_group_limit_by_hand():
    # 8 experts, 4 groups of 2. Sigmoid-free check with softmax 'none' on probabilities:
    # logits give group sums (top-2) g0: 5+0, g1: 4+4, g2: 3+3, g3: 6+(-9) -> keep g1, g2
    logits = torch.tensor([[5.0, 0.0, 4.0, 4.0, 3.0, 3.0, 6.0, -9.0]], dtype=torch.float64)
    gate = GateConfig(score="sigmoid", normalize="none", n_groups=4, topk_groups=2)
    r = scored_route(logits, 3, gate)
    # in groups 1, 2: experts 2, 3 (sigmoid 4, tie -> lower id first), then 4 (tie with 5)
    assert r.ids_TK.tolist() == [[2, 3, 4]]
    assert_close(r.weights_TK, torch.sigmoid(logits[:, [2, 3, 4]]))
    # the max group score (DeepSeek-V2) keeps g3 (6) and g0 (5): experts 6, 0, 1
    r = scored_route(
        logits,
        3,
        GateConfig(score="sigmoid", normalize="none", n_groups=4, topk_groups=2, group_score="max"),
    )
    assert r.ids_TK.tolist() == [[6, 0, 1]]


def test_bias_selects_but_never_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    gate = GateConfig(score="sigmoid", normalize="renorm", expert_bias=True, route_scale=3.0)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    r = scored_route(logits, 2, gate, bias)
    assert r.ids_TK.tolist() == [[3, 0]]
    s = torch.sigmoid(logits[0, [3, 0]])
    assert_close(r.weights_TK[0], 3.0 * s / s.sum())


@pytest.mark.parametrize(
    ("kw", "moe", "match"),
    [
        ({"score": "tanh"}, {}, "score 'tanh' is unknown"),
        ({"score": "sigmoid"}, {}, "score='sigmoid' takes normalize='renorm'"),
        ({"normalize": "renorm"}, {}, "spelled for score='sigmoid'"),
        ({"n_groups": 0}, {}, "n_groups must be >= 1"),
        ({"n_groups": 2, "topk_groups": 3}, {}, "topk_groups=3 exceeds n_groups=2"),
        ({"group_score": "mean"}, {}, "group_score 'mean' is unknown"),
        ({"route_scale": 0.0}, {}, "route_scale must be finite and > 0"),
        ({"route_scale": float("inf")}, {}, "route_scale must be finite"),
        ({"router_dtype": "bfloat16"}, {}, "router_dtype 'bfloat16' is unknown"),
        ({"bias_update_rate": -1e-3}, {}, "bias_update_rate must be >= 0"),
        ({"type": "switch", "expert_bias": True}, {}, "topk-gate options"),
        ({"type": "gshard", "route_scale": 2.0}, {}, "topk-gate options"),
        ({"n_groups": 3, "topk_groups": 1}, {}, "n_groups=3 does not divide num_experts=8"),
        ({"n_groups": 8, "topk_groups": 2}, {}, "needs at least 2 experts per group"),
        ({"n_groups": 4, "topk_groups": 1}, {}, "top_k=3 exceeds the 2 experts"),
        ({}, {"balance_loss": "batch"}, "balance_loss 'batch' is unknown"),
        ({}, {"shared_gate": True}, "need shared experts"),
        ({}, {"shared_experts": -1}, "shared_experts must be >= 0"),
    ],
)
def test_every_option_is_validated(kw, moe, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(model_dim=4, hidden_dim=4, num_experts=8, top_k=3, gate=GateConfig(**kw), **moe)


def test_type_errors():
    with pytest.raises(TypeError, match="expert_bias must be True or False"):
        GateConfig(expert_bias=1)
    with pytest.raises(TypeError, match="bias must be True or False, got nan"):  # read as True
        GateConfig(bias=float("nan"))
    with pytest.raises(TypeError, match="bias must be True or False, got 1"):
        MoEConfig(model_dim=4, hidden_dim=4, num_experts=2, top_k=1, bias=1)
    with pytest.raises(TypeError, match="n_groups must be an int"):
        GateConfig(n_groups=2.0)
    layer = _layer(GateConfig())
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor"):
        layer(torch.randn(2, 6, dtype=torch.float64), padding_mask=torch.zeros(2))
    with pytest.raises(ValueError, match=r"one flag per token"):
        layer(torch.randn(2, 6, dtype=torch.float64), padding_mask=torch.zeros(3, dtype=torch.bool))


def test_float32_router_under_bfloat16():
    torch.manual_seed(seed_for("router-fp32"))
    gate = GateConfig(score="sigmoid", normalize="renorm", router_dtype="float32", expert_bias=True)
    layer = _layer(gate, shared_experts=1)
    with torch.no_grad():
        layer.gate.expert_bias.copy_(torch.randn(8) * 0.1)
    w_before = layer.gate.wg.weight.detach().clone()
    bias_before = layer.gate.expert_bias.clone()
    layer = layer.to(torch.bfloat16)
    # kept, not rounded to bfloat16 and back
    assert torch.equal(layer.gate.wg.weight, w_before)
    assert torch.equal(layer.gate.expert_bias, bias_before)
    assert layer.experts.w1.dtype == torch.bfloat16
    x = torch.randn(16, 6).to(torch.bfloat16)
    routing, _, _ = layer.gate(x)
    assert routing.logits_TN.dtype == torch.float32
    assert routing.weights_TK.dtype == torch.bfloat16
    # the same numbers as the router run on the (exactly representable) float32 input
    want = scored_route(layer.gate.wg(x.float()), 3, gate, layer.gate.expert_bias)
    assert torch.equal(routing.ids_TK, want.ids_TK)
    assert torch.equal(routing.weights_TK, want.weights_TK.to(torch.bfloat16))
    y, aux = layer(x)
    y.float().sum().backward()
    assert layer.gate.wg.weight.grad.dtype == torch.float32
    layer.double()  # float64 router asked for nowhere: still float32
    assert layer.gate.wg.weight.dtype == torch.float32


def test_padded_tokens_are_not_routed():
    torch.manual_seed(seed_for("pad"))
    layer = _layer(GateConfig(score="sigmoid", normalize="renorm"))
    x = torch.randn(10, 6, dtype=torch.float64)
    pad = torch.zeros(10, dtype=torch.bool)
    pad[[2, 5, 9]] = True
    y, aux = layer(x, padding_mask=pad)
    assert int(aux.counts_N.sum()) == 7 * 3
    assert torch.equal(y[pad], torch.zeros_like(y[pad]))
    # the unpadded tokens' outputs and loss are those of the layer run on them alone
    y_alone, aux_alone = layer(x[~pad])
    assert_close(y[~pad], y_alone)
    assert_close(aux.balance_loss, aux_alone.balance_loss)
    assert_close(aux.z_loss, aux_alone.z_loss)
