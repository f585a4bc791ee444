"""Bad input fails early with ValueError/TypeError naming the value and the fix; NaN input gives
NaN for the affected token only (never finite wrong values).

Legend: T tokens, D model dim, N experts.
"""

from __future__ import annotations

import pytest
import torch
from _unit_helpers import make_layer, seed_for
from torch.testing import assert_close

from mixmoe import GateConfig, MixMOETransformerMLP, MoE, MoEConfig

# ---------------------------------------------------------------- the layer's input


def test_wrong_last_dim():
    layer = make_layer(model_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"model_dim=8.*\(5, 7\).*reshape it to \[\.\.\., 8\]"):
        layer(torch.randn(5, 7))


def test_scalar_input():
    layer = make_layer(model_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"model_dim=8"):
        layer(torch.tensor(1.5))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_input(dtype):
    layer = make_layer(model_dim=8, dtype=torch.float32)
    with pytest.raises(TypeError, match=rf"floating point, got {dtype}.*x\.float\(\)"):
        layer(torch.ones(3, 8, dtype=dtype))


def test_non_tensor_input():
    layer = make_layer(model_dim=8, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"torch\.Tensor, got list"):
        layer([[1.0] * 8])


@pytest.mark.parametrize(
    "x_dtype,layer_dtype",
    [
        (torch.float64, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float64),
    ],
)
def test_dtype_mismatch(x_dtype, layer_dtype):
    layer = make_layer(model_dim=8, dtype=layer_dtype)
    with pytest.raises(TypeError, match=rf"{x_dtype}.*{layer_dtype}.*layer\.to\("):
        layer(torch.randn(3, 8).to(x_dtype))


def test_config_must_be_moeconfig():
    with pytest.raises(TypeError, match="MoEConfig, got dict"):
        MoE({"model_dim": 8})


# ---------------------------------------------------------------- configuration


def cfg(**kw) -> MoEConfig:
    base = {"model_dim": 8, "hidden_dim": 12, "num_experts": 4}
    base.update(kw)
    return MoEConfig(**base)


@pytest.mark.parametrize("k", [5, 9])
def test_top_k_exceeds_num_experts(k):
    with pytest.raises(ValueError, match=rf"top_k={k} exceeds num_experts=4.*top_k <= num_experts"):
        cfg(top_k=k)


@pytest.mark.parametrize("k", [0, -1])
def test_top_k_below_one(k):
    with pytest.raises(ValueError, match=rf"top_k must be >= 1, got {k}"):
        cfg(top_k=k)


@pytest.mark.parametrize("n", [0, -2])
def test_num_experts_below_one(n):
    with pytest.raises(ValueError, match=rf"num_experts must be >= 1, got {n}"):
        cfg(num_experts=n, top_k=1)


def test_unknown_gate_name():
    with pytest.raises(ValueError, match=r"gate type 'topp' is unknown; use one of"):
        GateConfig(type="topp")


def test_unknown_activation_name():
    with pytest.raises(ValueError, match=r"activation 'tanh' is unknown; use one of .*gelu"):
        cfg(activation="tanh")


def test_switch_with_top2():
    with pytest.raises(ValueError, match=r"switch gate routes top-1; got top_k=2, use top_k=1"):
        cfg(top_k=2, gate=GateConfig(type="switch"))


def test_gshard_with_top1():
    with pytest.raises(ValueError, match=r"gshard gate routes top-2; got top_k=1, use top_k=2"):
        cfg(top_k=1, gate=GateConfig(type="gshard"))


# ---------------------------------------------------------------- MixMOETransformerMLP arguments


def tutel(**experts_over):
    experts = {"num_local_expert": 4, "hidden_size": 32, "activation_fn": "relu"}
    experts.update(experts_over)
    experts = {k: v for k, v in experts.items() if v is not _DROP}
    return experts


_DROP = object()


def test_mlp_missing_hidden_size():
    with pytest.raises(ValueError, match=r"experts needs 'num_local_expert'.*'hidden_size'"):
        MixMOETransformerMLP(experts=tutel(hidden_size=_DROP), model_dim=16)


def test_mlp_missing_num_local_expert():
    with pytest.raises(ValueError, match=r"experts needs 'num_local_expert'"):
        MixMOETransformerMLP(experts=tutel(num_local_expert=_DROP), model_dim=16)


def test_mlp_unknown_expert_key():
    with pytest.raises(ValueError, match=r"experts has unknown keys \['hiden_size'\]; known:"):
        MixMOETransformerMLP(experts=tutel(hiden_size=32), model_dim=16)


def test_mlp_unknown_gate_key():
    with pytest.raises(ValueError, match=r"gate_type has unknown keys \['topk'\]"):
        MixMOETransformerMLP(gate_type={"type": "top", "topk": 2}, experts=tutel(), model_dim=16)


@pytest.mark.parametrize("cap", [1.0, 1.25, 2])
def test_mlp_capacity_factor(cap):
    with pytest.raises(ValueError, match=rf"capacity_factor={cap}: mixmoe is dropless.*remove"):
        MixMOETransformerMLP(
            gate_type={"type": "top", "k": 2, "capacity_factor": cap}, experts=tutel(), model_dim=16
        )


def test_mlp_capacity_factor_zero_accepted():
    MixMOETransformerMLP(
        gate_type={"type": "top", "k": 2, "capacity_factor": 0}, experts=tutel(), model_dim=16
    )


@pytest.mark.parametrize(
    "fn",
    [torch.tanh, torch.sigmoid, lambda x: torch.nn.functional.gelu(x, approximate="tanh")],
    ids=["tanh", "sigmoid", "gelu-tanh-approx"],
)
def test_mlp_unknown_activation_callable(fn):
    with pytest.raises(ValueError, match=r"is not one of relu, gelu \(exact\), silu"):
        MixMOETransformerMLP(experts=tutel(activation_fn=fn), model_dim=16)


def test_mlp_unknown_activation_name():
    with pytest.raises(ValueError, match=r"activation_fn 'tanh' is unknown; use one of"):
        MixMOETransformerMLP(experts=tutel(activation_fn="tanh"), model_dim=16)


def test_mlp_unknown_gate_type():
    with pytest.raises(ValueError, match=r"gate_type type 'expert_choice' is unknown"):
        MixMOETransformerMLP(gate_type={"type": "expert_choice"}, experts=tutel(), model_dim=16)


def test_mlp_switch_with_k2():
    with pytest.raises(ValueError, match=r"switch gate routes top-1; got top_k=2, use top_k=1"):
        MixMOETransformerMLP(gate_type={"type": "switch", "k": 2}, experts=tutel(), model_dim=16)


def test_mlp_gshard_with_k1():
    with pytest.raises(ValueError, match=r"gshard gate routes top-2; got top_k=1, use top_k=2"):
        MixMOETransformerMLP(gate_type={"type": "gshard", "k": 1}, experts=tutel(), model_dim=16)


def test_mlp_missing_model_dim():
    with pytest.raises(ValueError, match=r"model_dim is required"):
        MixMOETransformerMLP(experts=tutel())


# ---------------------------------------------------------------- NaN / inf propagation


@pytest.mark.parametrize(
    "gate,normalize",
    [
        ("topk", "topk_softmax"),
        ("topk", "softmax_renorm"),
        ("switch", "topk_softmax"),
        ("gshard", "topk_softmax"),
    ],
)
@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"]
)
def test_nonfinite_token_poisons_only_itself(gate, normalize, bad):
    torch.manual_seed(seed_for("nan", gate, normalize, bad))
    layer = make_layer(
        gate=gate, normalize=normalize, num_experts=4, block_size=16, dtype=torch.float32
    )
    T, bad_t = 40, 17
    x = torch.randn(T, 8)
    x[bad_t, 3] = bad
    y, _ = layer(x)
    assert not torch.isfinite(y[bad_t]).any(), f"token {bad_t} got finite values {y[bad_t]}"
    others = torch.arange(T) != bad_t
    assert torch.isfinite(y[others]).all()
    # the other tokens are exactly what they are without the bad token
    y_clean, _ = layer(x[others])
    assert_close(y[others], y_clean)
