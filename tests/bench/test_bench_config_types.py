"""The benchmark configurations refuse values of the wrong type or out of range with a
ValueError / TypeError naming the field (found by a sweep of 0, -1, NaN, inf, None, strings,
tuples and True over every field: these were taken without a word, or failed later with an
AttributeError)."""

from __future__ import annotations

import pytest

from mixmoe.bench.calibrate import CalibrateConfig
from mixmoe.bench.hf import HFBenchConfig
from mixmoe.bench.layer import LayerBenchConfig
from mixmoe.bench.model import ModelBenchConfig
from mixmoe.bench.planner import PlannerBenchConfig

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "cls, field, value, error, match",
    [
        (LayerBenchConfig, "routing", 0, TypeError, "routing must be a string"),
        (LayerBenchConfig, "lr", NAN, ValueError, "lr must be >= 0"),
        (LayerBenchConfig, "lr", INF, ValueError, "lr must be finite"),
        (LayerBenchConfig, "seed", -1, ValueError, "seed must be >= 0"),
        (LayerBenchConfig, "balanced", None, TypeError, "balanced must be True or False"),
        (LayerBenchConfig, "trace", 0, TypeError, "trace must be a string"),
        (HFBenchConfig, "shape", "x", TypeError, "shape must be an HFModelShape"),
        (HFBenchConfig, "lr", INF, ValueError, "lr must be finite"),
        (HFBenchConfig, "hot_expert", 2.5, TypeError, "hot_expert must be an int"),
        (HFBenchConfig, "hot_bias", True, TypeError, "hot_bias must be a float"),
        (HFBenchConfig, "profile", None, TypeError, "profile must be a string"),
        (CalibrateConfig, "device", "nope", ValueError, "device 'nope' is not understood"),
        (CalibrateConfig, "name", 0, TypeError, "name must be a string"),
        (PlannerBenchConfig, "shuffle_experts", None, TypeError, "shuffle_experts must be True"),
        (PlannerBenchConfig, "jsonl", NAN, TypeError, "jsonl must be a string or None"),
        (ModelBenchConfig, "jsonl", INF, TypeError, "jsonl must be a string or None"),
    ],
)
def test_a_bad_field_names_itself(cls, field, value, error, match) -> None:
    with pytest.raises(error, match=match):
        cls(**{field: value})
