"""``GateConfig`` / ``MoEConfig``: defaults, immutability and field validation (every bad value
fails at construction with its name and the fix)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mixmoe.config import ACTIVATIONS, GATE_TYPES, STRATEGIES, GateConfig, MoEConfig


def cfg(**kw) -> MoEConfig:
    base = {"model_dim": 8, "hidden_dim": 12, "num_experts": 4}
    base.update(kw)
    return MoEConfig(**base)


def test_defaults():
    c = cfg()
    assert (c.top_k, c.activation, c.bias, c.block_size, c.strategy) == (
        2,
        "gelu",
        True,
        64,
        "local",
    )
    assert c.gate == GateConfig()
    assert c.gate.type == "topk" and c.gate.normalize == "topk_softmax"


def test_frozen():
    c = cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gate.type = "switch"  # type: ignore[misc]


@pytest.mark.parametrize("gate", GATE_TYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_valid_combination(gate, activation):
    k = {"switch": 1, "gshard": 2}.get(gate, 3)
    cfg(top_k=k, activation=activation, gate=GateConfig(type=gate))


@pytest.mark.parametrize("field", ["model_dim", "hidden_dim", "num_experts", "top_k"])
@pytest.mark.parametrize("value", [2.0, "4", True, None])
def test_int_fields_reject_non_ints(field, value):
    with pytest.raises(TypeError, match=rf"{field} must be an int, got"):
        cfg(**{field: value})


@pytest.mark.parametrize("field", ["model_dim", "hidden_dim"])
def test_dims_positive(field):
    with pytest.raises(ValueError, match=rf"{field} must be >= 1, got 0"):
        cfg(**{field: 0})


def test_max_replicas():
    cfg(max_replicas=0)
    with pytest.raises(ValueError, match="max_replicas must be >= 0, got -1"):
        cfg(max_replicas=-1)


@pytest.mark.parametrize("bs", [0, 8, 48, 256])
def test_block_size(bs):
    with pytest.raises(ValueError, match=rf"block_size must be one of 16, 32, 64, 128; got {bs}"):
        cfg(block_size=bs)


@pytest.mark.parametrize("bs", [16, 32, 64, 128])
def test_block_size_ok(bs):
    assert cfg(block_size=bs).block_size == bs


def test_strategy():
    for s in STRATEGIES:
        cfg(strategy=s)
    with pytest.raises(ValueError, match=r"strategy 'tutel' is unknown; use one of"):
        cfg(strategy="tutel")


@pytest.mark.parametrize("field", ["aux_loss_coef", "z_loss_coef"])
@pytest.mark.parametrize("value", [-0.1, math.nan])
def test_loss_coefs(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be >= 0"):
        cfg(**{field: value})


@pytest.mark.parametrize("field", ["aux_loss_coef", "z_loss_coef"])
def test_loss_coefs_type(field):
    with pytest.raises(TypeError, match=rf"{field} must be a float"):
        cfg(**{field: "0.1"})


def test_gate_must_be_gateconfig():
    with pytest.raises(TypeError, match="gate must be a GateConfig, got dict"):
        cfg(gate={"type": "topk"})


def test_unknown_normalize():
    with pytest.raises(ValueError, match=r"gate normalize 'sigmoid' is unknown; use one of"):
        GateConfig(normalize="sigmoid")


@pytest.mark.parametrize("eps", [1.0, 1.5])
def test_jitter_range(eps):
    with pytest.raises(ValueError, match=rf"jitter_eps must be in \[0, 1\), got {eps}"):
        GateConfig(type="switch", jitter_eps=eps)


def test_jitter_only_for_switch():
    with pytest.raises(ValueError, match=r"jitter_eps is a switch-gate option.*type='switch'"):
        GateConfig(type="topk", jitter_eps=0.1)
    assert GateConfig(type="switch", jitter_eps=0.1).jitter_eps == 0.1


def test_random_routing_only_for_gshard():
    with pytest.raises(ValueError, match=r"random_routing is a gshard-gate option"):
        GateConfig(type="switch", random_routing=True)
    assert GateConfig(type="gshard", random_routing=True).random_routing
