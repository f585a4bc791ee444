"""``CountSums``: C's column and row sums handed to the planners where they are known (the layer
reduces C on the device, or one compiled pass on the planning thread serves the plan and the
step's bookkeeping). Given, they replace the planners' pass over C: the same plans as from C
alone (one link and nodes, the three strategies), the Python paths ignoring them; sums that
cannot be C's (a negative sum, unequal totals) raise ValueError; the wrong types or shapes a
TypeError / ValueError naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mixmoe.placement.native_lib as lib
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import GPU_PROFILE, LayerShape
from mixmoe.placement.counts import CountSums
from mixmoe.placement.native_pricing import count_sums
from mixmoe.placement.planner import plan_mix, plan_none
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.shadow import plan_shadow

NODES = dataclasses.replace(load_profile("h100-nvlink-ib"), ranks_per_node=4)
PLANNERS = {
    "mix": lambda C, shape, prof, **kw: plan_mix(C, shape, prof, 4, **kw),
    "none": plan_none,
    "shadow": plan_shadow,
}


def _case(routing: str, W: int, E: int, seed: int = 0) -> tuple[torch.Tensor, LayerShape]:
    gen = torch.Generator().manual_seed(seed)
    C = synthetic_counts(RoutingSpec.parse(routing), W, 512, 2, W * E, gen, shuffle_experts=True)
    return C, LayerShape(1024, 4096, E, W, 2)


def _sums(C: torch.Tensor) -> CountSums:
    return CountSums(C.sum(0), C.sum(1))


@pytest.mark.parametrize("W, E", [(2, 2), (8, 4), (24, 3), (64, 4)])
def test_count_sums_are_the_sums(W, E) -> None:
    C, _ = _case("zipf:1.2", W, E)
    sums = count_sums(C, E)
    torch.testing.assert_close(sums.colsum_N, C.sum(0), rtol=0, atol=0)
    torch.testing.assert_close(sums.rowsum_W, C.sum(1), rtol=0, atol=0)
    C[W - 1, 0] = -1  # a negative count: no sums (the planner's Python raises its error)
    assert count_sums(C, E) is None


@pytest.mark.parametrize("name", sorted(PLANNERS))
@pytest.mark.parametrize("profile", [GPU_PROFILE, NODES], ids=["one-link", "nodes"])
@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2", "zipf:2.0", "hot:0.4"])
@pytest.mark.parametrize("W, E", [(2, 2), (8, 4), (12, 2), (64, 4)])
def test_given_sums_give_the_same_plan(name, profile, routing, W, E, monkeypatch) -> None:
    C, shape = _case(routing, W, E, seed=W)
    plan = PLANNERS[name]
    want = repr(plan(C, shape, profile))
    assert repr(plan(C, shape, profile, sums=_sums(C))) == want
    with monkeypatch.context() as m:  # the Python paths sum C themselves
        m.setenv(lib.ENV_OFF, "0")
        assert repr(plan(C, shape, profile, sums=_sums(C))) == want


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_sums_that_cannot_be_cs_raise(name) -> None:
    C, shape = _case("zipf:1.2", 8, 4)
    plan = PLANNERS[name]
    colsum, rowsum = C.sum(0), C.sum(1)

    def negative_at(sums: torch.Tensor, i: int) -> torch.Tensor:  # the same total, one < 0
        out, shift = sums.clone(), int(sums[i]) + 1
        out[i] -= shift
        out[i + 1] += shift
        return out

    unequal = rowsum.clone()
    unequal[0] += 1
    for bad in (
        CountSums(negative_at(colsum, 3), rowsum),
        CountSums(colsum, negative_at(rowsum, 2)),
        CountSums(colsum, unequal),
    ):
        with pytest.raises(ValueError, match="sums are not C's column and row sums"):
            plan(C, shape, GPU_PROFILE, sums=bad)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ((1, 2), TypeError, "sums must be a CountSums"),
        ("float", TypeError, r"sums.colsum_N must be an int64 CPU tensor, got torch.float64"),
        ("short", ValueError, r"sums.rowsum_W must be a contiguous tensor of shape \(8,\)"),
        ("strided", ValueError, r"sums.colsum_N must be a contiguous tensor of shape \(32,\)"),
    ],
)
def test_sums_of_the_wrong_form_name_the_field(bad, error, match) -> None:
    C, shape = _case("zipf:1.2", 8, 4)
    colsum, rowsum = C.sum(0), C.sum(1)
    sums = {
        "float": CountSums(colsum.double(), rowsum),
        "short": CountSums(colsum, rowsum[:7]),
        "strided": CountSums(torch.stack([colsum, colsum], 1)[:, 0], rowsum),
    }.get(bad, bad)
    for plan in PLANNERS.values():
        with pytest.raises(error, match=match):
            plan(C, shape, GPU_PROFILE, sums=sums)


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_sums_with_counts_of_another_integer_type(name) -> None:
    # int32 counts are converted to int64 for the compiled entries; the sums stay C's
    C, shape = _case("zipf:1.2", 8, 4)
    plan = PLANNERS[name]
    want = repr(plan(C, shape, GPU_PROFILE))
    assert repr(plan(C.to(torch.int32), shape, GPU_PROFILE, sums=_sums(C))) == want
