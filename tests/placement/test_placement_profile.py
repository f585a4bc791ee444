"""Hardware profiles and layer shapes: validation and derived sizes."""

from __future__ import annotations

import math
import re

import pytest

import mixmoe.placement.profile as profile_module
from mixmoe.placement import CPU_PROFILE, GPU_PROFILE, HardwareProfile, LayerShape, default_profile


def test_default_profiles() -> None:
    assert default_profile("cpu") is CPU_PROFILE
    assert default_profile("cuda") is GPU_PROFILE
    with pytest.raises(ValueError, match="'tpu'"):
        default_profile("tpu")


def test_built_in_profiles_hold_the_figures_their_docstring_states() -> None:
    """profile.py's docstring says where each built-in figure comes from; the profiles hold
    exactly those figures (name, rates, latency and fixed costs, unstated ones 0.0)."""
    doc = profile_module.__doc__
    for profile, section in ((CPU_PROFILE, "``CPU_PROFILE``"), (GPU_PROFILE, "``GPU_PROFILE``")):
        text = doc[doc.index(section) :]
        other = "``GPU_PROFILE``" if profile is CPU_PROFILE else None
        text = text[: text.index(other)] if other else text
        assert re.search(rf"name ``{re.escape(profile.name)}``", text), profile.name
        stated = {k: float(v) for k, v in re.findall(r"``(\w+) = ([0-9.e+-]+)``", text)}
        fields = ("gemm_flops", "link_bandwidth", "link_latency", *profile_module.FIXED_COSTS)
        assert set(stated) <= set(fields) and {
            "gemm_flops",
            "link_bandwidth",
            "link_latency",
        } <= set(stated)
        for field in fields:
            assert getattr(profile, field) == stated.get(field, 0.0), (profile.name, field)


@pytest.mark.parametrize("field", ["gemm_flops", "link_bandwidth", "link_latency"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_profile_rejects_bad_numbers(field: str, bad: float) -> None:
    kwargs = {"name": "x", "gemm_flops": 1e9, "link_bandwidth": 1e9, "link_latency": 1e-5}
    with pytest.raises(ValueError, match=field):
        HardwareProfile(**{**kwargs, field: bad})
    with pytest.raises(TypeError, match=field):
        HardwareProfile(**{**kwargs, field: "fast"})


@pytest.mark.parametrize("field", ["step_fixed_s", "row_overhead_s", "replica_fixed_s"])
def test_profile_fixed_costs_default_to_zero_and_reject_bad_values(field: str) -> None:
    kwargs = {"name": "x", "gemm_flops": 1e9, "link_bandwidth": 1e9, "link_latency": 1e-5}
    assert getattr(HardwareProfile(**kwargs), field) == 0.0
    assert getattr(HardwareProfile(**kwargs, **{field: 2e-3}), field) == 2e-3
    for bad in (-1e-6, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"{field} must be finite and >= 0"):
            HardwareProfile(**kwargs, **{field: bad})
    with pytest.raises(TypeError, match=field):
        HardwareProfile(**kwargs, **{field: True})


def test_shared_core_efficiency_defaults_to_fair_sharing_and_stays_in_zero_one() -> None:
    kwargs = {"name": "x", "gemm_flops": 1e9, "link_bandwidth": 1e9, "link_latency": 1e-5}
    assert HardwareProfile(**kwargs).shared_core_efficiency == 1.0
    for good in (1.0, 0.5, 1e-3):
        assert HardwareProfile(**kwargs, shared_core_efficiency=good).shared_core_efficiency == good
    for bad in (0.0, -0.5, 1.0 + 1e-9, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"shared_core_efficiency must be in \(0, 1\]"):
            HardwareProfile(**kwargs, shared_core_efficiency=bad)
    with pytest.raises(TypeError, match="shared_core_efficiency must be a real number"):
        HardwareProfile(**kwargs, shared_core_efficiency=True)


def test_profile_rejects_empty_name() -> None:
    with pytest.raises(ValueError, match="name"):
        HardwareProfile("", 1e9, 1e9, 1e-5)


def test_layer_shape_derived_sizes() -> None:
    s = LayerShape(
        model_dim=8, hidden_dim=32, experts_per_rank=3, world_size=4, bytes_per_element=2
    )
    assert s.num_experts == 12
    assert s.flops_per_row == 3 * 2 * 2 * 8 * 32  # fwd+bwd, 2 FLOP/MAC, 2 GEMMs of D x F
    assert s.params_bytes_per_expert == (2 * 8 * 32 + 32 + 8) * 2  # W1, W2, b1 (F), b2 (D)
    assert s.row_bytes == 16
    swiglu = LayerShape(8, 32, 3, 4, 4, gemms_per_expert=3)
    assert swiglu.flops_per_row == 3 * 2 * 3 * 8 * 32
    assert swiglu.params_bytes_per_expert == (3 * 8 * 32 + 2 * 32 + 8) * 4


@pytest.mark.parametrize(
    "field", ["model_dim", "hidden_dim", "experts_per_rank", "world_size", "bytes_per_element"]
)
def test_layer_shape_rejects_bad_sizes(field: str) -> None:
    kwargs = dict(model_dim=8, hidden_dim=32, experts_per_rank=2, world_size=2, bytes_per_element=4)
    with pytest.raises(ValueError, match=field):
        LayerShape(**{**kwargs, field: 0})
    with pytest.raises(TypeError, match=field):
        LayerShape(**{**kwargs, field: 2.0})
