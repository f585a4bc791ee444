"""The mixmoe EP implementations' registration and their clear errors (no process group needed:
each error is raised before any communication). Training equivalence: tests/distributed/test_hf_ep.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip(
    "transformers.distributed.expert_parallel",
    reason="this transformers has no expert-parallel registry (added in 5.23; CI installs it)",
)
from transformers import MixtralConfig  # noqa: E402
from transformers.distributed.expert_parallel import EPImplementationInterface  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402

import mixmoe.hf  # noqa: E402
from mixmoe import cli  # noqa: E402
from mixmoe.bench.hf import HFBenchConfig, HFModelShape, add_balance_bound  # noqa: E402
from mixmoe.commands import bench_hf as bench_hf_command  # noqa: E402
from mixmoe.hf.ep import (  # noqa: E402
    EP_CLASSES,
    ep_implementation_class,
    register_ep_implementation,
)


class _Mesh:
    """What the implementations read of a DeviceMesh before communicating: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def get_group(self):
        raise AssertionError("no process group may be touched before the checks")


def _experts() -> MixtralExperts:
    cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4)
    return MixtralExperts(cfg)


def test_import_registers_every_strategy_and_is_idempotent():
    registry = EPImplementationInterface()
    assert mixmoe.hf.EP_IMPLEMENTATIONS == ("mixmoe_a2a", "mixmoe_shadow", "mixmoe_mix")
    before = {name: registry[name] for name in mixmoe.hf.EP_IMPLEMENTATIONS}
    assert {n: c.strategy for n, c in before.items()} == {
        "mixmoe_a2a": "a2a",
        "mixmoe_shadow": "shadow",
        "mixmoe_mix": "mix",
    }
    mixmoe.hf.register()
    assert {name: registry[name] for name in mixmoe.hf.EP_IMPLEMENTATIONS} == before
    assert before == EP_CLASSES
    assert "all_to_all" in registry  # transformers' own entries are untouched


def test_tp_size_above_one_is_refused():
    with pytest.raises(ValueError, match=r"mixmoe_mix.*tp_size=1.*size 2"):
        EP_CLASSES["mixmoe_mix"](_experts(), _Mesh(2), _Mesh(2))


def test_post_expert_norm_is_refused_naming_the_flag():
    experts = _experts()
    experts.has_post_expert_norm = True
    with pytest.raises(ValueError, match="has_post_expert_norm=True"):
        EP_CLASSES["mixmoe_a2a"](experts, _Mesh(2), _Mesh(1))


def test_a_module_without_layout_flags_is_refused():
    with pytest.raises(TypeError, match="use_experts_implementation"):
        EP_CLASSES["mixmoe_a2a"](torch.nn.Linear(2, 2), _Mesh(2), _Mesh(1))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ep_implementation_class("local"), "not expert-parallel"),
        (lambda: ep_implementation_class("mix", max_replicas=-1), "max_replicas"),
        (lambda: register_ep_implementation("", "mix"), "non-empty string"),
        (lambda: ep_implementation_class("a2a", plan_ahead=True), "'a2a' has no plan"),
    ],
)
def test_bad_registrations(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_plan_ahead_must_be_a_bool():
    with pytest.raises(TypeError, match="plan_ahead must be True or False, got 1"):
        ep_implementation_class("mix", plan_ahead=1)


def test_register_a_tuned_mix():
    register_ep_implementation("mixmoe_mix_test_unit", "mix", max_replicas=1)
    try:
        cls = EPImplementationInterface()["mixmoe_mix_test_unit"]
        assert (cls.strategy, cls.max_replicas, cls.profile, cls.plan_ahead) == (
            "mix",
            1,
            None,
            False,
        )
    finally:
        EPImplementationInterface._global_mapping.pop("mixmoe_mix_test_unit")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"implementations": ("mixmoe_mix",)}, "baseline 'all_to_all'"),
        ({"implementations": ("all_to_all", "nope")}, "nope"),
        ({"routings": ("zipf",)}, "routings"),
        ({"world_size": 3}, "not divisible by world_size=3"),
        ({"hot_expert": 8}, "hot_expert=8"),
        ({"world_size": 1}, "on one device: use some of"),
        ({"world_size": 1, "implementations": ("mixmoe",)}, "baseline 'eager'"),
        ({"dtype": "bf16"}, "one-device run"),
        ({"world_size": 1, "implementations": ("eager",), "dtype": "fp16"}, "dtype"),
    ],
)
def test_bench_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HFBenchConfig(**kwargs)


def test_bench_shape_errors():
    with pytest.raises(ValueError, match="family 'gpt2'"):
        HFModelShape(family="gpt2")
    with pytest.raises(ValueError, match="top_k=9"):
        HFModelShape(top_k=9)


def test_cli_bad_implementation_is_one_line(capsys):
    assert cli.main(["bench", "hf", "--implementations", "mixmoe_mix"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixmoe: error: ") and "all_to_all" in err[0]


def test_single_device_bench_compares_experts_implementations(capsys):
    """``--world-size 1``: the same model under eager, grouped_mm and mixmoe; the first step's
    losses must agree (the engine checks it before timing) and every record carries both ratios."""
    argv = ["bench", "hf", "--world-size", "1", "--hidden-size", "64", "--intermediate-size"]
    argv += ["128", "--num-experts", "4", "--layers", "1", "--vocab-size", "128", "--batch", "2"]
    argv += ["--seq-len", "16", "--steps", "1", "--warmup", "0", "--routing", "uniform,skewed"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "one device (cpu, float32; experts implementations)" in out and "vs fastest hf" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("uniform", "skewed"))]
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (routing, impl)
        for routing in ("uniform", "skewed")
        for impl in ("eager", "grouped_mm", "mixmoe")
    ), out


def test_single_device_bench_bf16_and_device_errors(capsys):
    """``--dtype bf16`` runs the model in bf16 (first-step losses agree within bf16's tolerance);
    ``--device cuda`` without a GPU is a one-line error."""
    argv = ["bench", "hf", "--world-size", "1", "--hidden-size", "64", "--intermediate-size"]
    argv += ["128", "--num-experts", "4", "--layers", "1", "--vocab-size", "128", "--batch", "2"]
    argv += ["--seq-len", "16", "--steps", "1", "--warmup", "0", "--routing", "uniform"]
    assert cli.main(argv + ["--dtype", "bf16"]) == 0
    assert "one device (cpu, bf16; experts implementations)" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert cli.main(argv + ["--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "CUDA is not available" in err[0], err


def _record(routing: str, impl: str, ms: float) -> dict:
    return {
        "routing": routing,
        "implementation": impl,
        "device": "cpu",
        "median_ms": ms,
        "min_ms": ms,
        "ratio": 1.0,
        "hot_share": 0.5,
        "replicas_per_step": 0.0,
        "step_ms": [ms],
    }


def test_balance_bound_is_uniform_over_skewed_all_to_all():
    records = [
        _record("uniform", "all_to_all", 200.0),
        _record("uniform", "mixmoe_mix", 210.0),
        _record("skewed", "all_to_all", 250.0),
        _record("skewed", "mixmoe_mix", 230.0),
    ]
    add_balance_bound(records)
    assert [r.get("balance_bound") for r in records] == [None, None, 0.8, 0.8]
    assert [r["pct_balanced"] for r in records] == [1.0, 200 / 210, 0.8, 200 / 230]
    only_skewed = [_record("skewed", "all_to_all", 250.0)]
    add_balance_bound(only_skewed)
    assert only_skewed[0]["balance_bound"] is None


def test_cli_table_shows_the_balance_bound(capsys, monkeypatch):
    """The skewed rows are followed by the bound, explained under the table (engine stubbed:
    the table's rendering is what is tested here; tests/distributed runs the engine)."""
    records = [
        _record("uniform", "all_to_all", 200.0),
        _record("skewed", "all_to_all", 250.0),
        _record("skewed", "mixmoe_mix", 230.0),
    ]
    add_balance_bound(records)
    monkeypatch.setattr(bench_hf_command, "run_hf_bench", lambda cfg: records)
    assert cli.main(["bench", "hf", "--implementations", "all_to_all,mixmoe_mix"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines if line.startswith(("uniform", "skewed"))]
    assert [r[1] for r in table] == ["all_to_all", "all_to_all", "mixmoe_mix", "balanced"]
    assert table[-1][-1] == "0.800x"
    assert [r[5] for r in table[:3]] == ["100.0%", "80.0%", "87.0%"]  # % of balanced, by hand
    assert any(line.startswith("* balanced bound = all_to_all uniform") for line in lines)
