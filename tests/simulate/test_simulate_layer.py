"""The what-if simulator at layer and model level (``mixmoe.simulate``), against hand arithmetic."""

from __future__ import annotations

import pytest
import torch

from mixmoe.formats.counts import read_counts, write_counts
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import HardwareProfile, LayerShape, plan_mix, plan_none, plan_shadow
from mixmoe.simulate.layer import predict_layer, speedups
from mixmoe.simulate.model import ModelShape, allreduce_s, predict_model
from mixmoe.simulate.routing import counts_source

# one row = 1 s of compute (384 FLOP), one remote row = 1 s on the link (2 x 16 B at 32 B/s),
# one replica = 304 B = 9.5 s, 0.5 s per collective
SHAPE = LayerShape(model_dim=4, hidden_dim=8, experts_per_rank=1, world_size=2, bytes_per_element=4)
UNIT = HardwareProfile("unit", gemm_flops=384.0, link_bandwidth=32.0, link_latency=0.5)
C = [[10, 3], [6, 2]]


def test_hand_computed_example() -> None:
    p = predict_layer(C, SHAPE, UNIT, top_k=2, max_replicas=4)
    # a2a: rank 0 computes 16 rows, 9 remote rows each, 4 collectives: 16 + 2 + 9 = 27
    a2a = p["a2a"]
    assert a2a.compute_W == (16.0, 5.0) and a2a.token_W == (11.0, 11.0)
    assert a2a.exposed_W == (11.0, 11.0) and a2a.hidden_W == (0.0, 0.0)
    assert a2a.step_s == 27.0 and a2a.hot == () and a2a.bottleneck == 0
    assert a2a.fwd_s == pytest.approx(16 / 3 + 5.5) and a2a.bwd_s == pytest.approx(32 / 3 + 5.5)
    # shadow (FasterMoE's rule): expert 0 broadcast (42.5 < 48), expert 1 not (58 > 42.5)
    sh = p["shadow"]
    assert sh.hot == (0,) and sh.replicas == 1
    assert sh.rows_W == (10, 11) and sh.token_W == (5.0, 5.0) and sh.weight_W == (10.5, 10.5)
    assert sh.step_s == 26.5 and sh.bottleneck == 1
    # mix: a replica would cost 21.5 > 17, so none; overlap hides 10 s on rank 0, 2 s on rank 1
    mix = p["mix"]
    assert mix.hot == () and mix.hidden_W == (10.0, 2.0) and mix.exposed_W == (1.0, 9.0)
    assert mix.step_s == 17.0
    assert mix.fwd_s == pytest.approx(5 / 3 + 4.5) and mix.bwd_s == pytest.approx(32 / 3 + 0.5)
    assert speedups(p) == {"a2a": 1.0, "shadow": 27 / 26.5, "mix": 27 / 17}
    # ranks sharing saturated processors: the mean over ranks, same plans
    shared = predict_layer(C, SHAPE, UNIT, top_k=2, shared=True)
    assert [shared[s].step_s for s in p] == [21.5, 26.0, 15.5]
    assert [shared[s].hot for s in p] == [p[s].hot for s in p]
    assert shared["a2a"].fwd_s == pytest.approx((16 / 3 + 5.5 + 5 / 3 + 5.5) / 2)
    fixed = predict_layer(C, SHAPE, UNIT, top_k=2, fixed_s=3.0)
    assert [fixed[s].step_s - p[s].step_s for s in p] == [3.0, 3.0, 3.0]


def test_plan_of_one_profile_priced_with_another() -> None:
    # plan_profile plans (a cheap link: mix replicates expert 0 on rank 1), profile prices it:
    # rank 0 computes its 10 rows, rank 1 6 + 2 + 3 = 11; 3 remote rows each, hidden under the
    # local rows; the replica 2 x 0.5 + 9.5 = 10.5 s on both ranks: max(20.5, 21.5)
    cheap = HardwareProfile("cheap", gemm_flops=384.0, link_bandwidth=3200.0, link_latency=5e-3)
    p = predict_layer(C, SHAPE, UNIT, top_k=2, plan_profile=cheap)
    assert p["mix"].hot == (0,) and p["mix"].rows_W == (10, 11)
    assert p["mix"].compute_W == (10.0, 11.0) and p["mix"].exposed_W == (10.5, 10.5)
    assert p["mix"].step_s == 21.5 and p["a2a"].step_s == 27.0
    own = predict_layer(C, SHAPE, UNIT, top_k=2)
    assert own["mix"].hot == ()  # UNIT's own plan replicates nothing
    assert predict_layer(C, SHAPE, UNIT, top_k=2, plan_profile=UNIT) == own


@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2", "hot:0.6"])
def test_steps_are_the_planners_predictions(routing: str) -> None:
    shape = LayerShape(512, 1024, 4, 8, 2)
    prof = HardwareProfile("p", 50e12, 20e9, 20e-6)
    counts = synthetic_counts(RoutingSpec.parse(routing), 8, 4096, 2, 32, torch.Generator())
    p = predict_layer(counts, shape, prof, top_k=2, max_replicas=3)
    want = {
        "a2a": plan_none(counts, shape, prof),
        "shadow": plan_shadow(counts, shape, prof),
        "mix": plan_mix(counts, shape, prof, 3),
    }
    for s, plan in want.items():
        assert p[s].step_s == plan.prediction.step_s
        assert p[s].hot == plan.hot
        assert p[s].rows_W == plan.prediction.rows
        total = [c + e for c, e in zip(p[s].compute_W, p[s].exposed_W, strict=True)]
        assert max(total) == p[s].step_s
        assert p[s].fwd_s + p[s].bwd_s >= p[s].step_s * (1 - 1e-12)
    assert p["mix"].step_s <= p["a2a"].step_s


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="no strategy"):
        predict_layer(C, SHAPE, UNIT, top_k=2, strategies=())
    with pytest.raises(ValueError, match="'foo' is not expert-parallel"):
        predict_layer(C, SHAPE, UNIT, top_k=2, strategies=("foo",))
    with pytest.raises(ValueError, match="expected"):
        predict_layer([[1, 2, 3]], SHAPE, UNIT, top_k=2)
    with pytest.raises(ValueError, match="fixed_s"):
        predict_layer(C, SHAPE, UNIT, top_k=2, fixed_s=-1.0)


def test_routing_sources(tmp_path) -> None:
    (c,) = counts_source("hot:0.5", 4, 8, 100, 2, seed=1)
    assert c.shape == (4, 8) and c.sum().item() == 4 * 100 * 2
    path = write_counts(tmp_path / "c.json", [C, [[1, 2], [3, 4]]], source="test")
    got = counts_source(f"counts:{path}", 2, 2, 1, 1)
    assert [g.tolist() for g in got] == [C, [[1, 2], [3, 4]]]
    assert read_counts(path)["source"] == "test"
    with pytest.raises(ValueError, match="W=2, N=2 but the simulated layer has W=4"):
        counts_source(f"counts:{path}", 4, 8, 1, 1)
    with pytest.raises(ValueError, match="routing 'zipf' is not understood"):
        counts_source("zipf", 2, 2, 1, 1)
    with pytest.raises(ValueError, match="needs a trained gate"):
        counts_source("gate", 2, 2, 1, 1)
    with pytest.raises(FileNotFoundError, match="--save-counts"):
        counts_source(f"counts:{tmp_path / 'missing.json'}", 2, 2, 1, 1)
    with pytest.raises(ValueError, match="not a \\[2\\]\\[2\\] matrix"):
        write_counts(tmp_path / "bad.json", [C, [[1]]], source="x")


def test_scales_to_1024_ranks_and_4096_experts() -> None:
    shape = LayerShape(1024, 4096, 4, 1024, 2)
    prof = HardwareProfile("p", 300e12, 50e9, 20e-6)
    counts = synthetic_counts(RoutingSpec.parse("zipf:1.2"), 1024, 512, 2, 4096, torch.Generator())
    p = predict_layer(counts, shape, prof, top_k=2, strategies=("a2a", "mix"))
    assert len(p["mix"].rows_W) == 1024 and p["mix"].step_s <= p["a2a"].step_s


def test_model_level_formula() -> None:
    layer = LayerShape(4, 8, 2, 2, 2)
    model = ModelShape(layers=4, dense_params=1000, tokens=10, pipeline_stages=2, microbatches=6,
                       dp=4, edp=2)  # fmt: skip
    m = predict_model(0.25, layer, model, UNIT)
    dense = 6 * 1000 * 10 / 384.0
    assert m.microbatch_s == pytest.approx(4 * 0.25 + dense)
    assert m.pipeline_s == pytest.approx((6 + 2 - 1) * m.microbatch_s / 2)
    assert m.bubble_fraction == pytest.approx(1 / 7)
    assert m.dense_allreduce_s == pytest.approx(2 * 3 / 4 * 500 * 2 / 32.0 + 6 * 0.5)
    expert_bytes = 2 * 2 * layer.params_bytes_per_expert  # 2 layers per stage x E=2
    assert m.expert_allreduce_s == pytest.approx(2 * 1 / 2 * expert_bytes / 32.0 + 2 * 0.5)
    assert m.step_s == pytest.approx(m.pipeline_s + m.dense_allreduce_s + m.expert_allreduce_s)
    assert allreduce_s(1e9, 1, UNIT) == 0.0
    with pytest.raises(ValueError, match="split evenly"):
        ModelShape(layers=3, pipeline_stages=2)
