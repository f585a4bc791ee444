"""Profiles on disk and by name (``mixmoe.placement.profile_io``) and the vectorised plan loads."""

from __future__ import annotations

import json

import pytest
import torch

from mixmoe.placement import CPU_PROFILE, HardwareProfile, LayerShape, plan_mix, plan_shadow
from mixmoe.placement.cost_model import plan_loads, rank_loads
from mixmoe.placement.profile_io import (
    PRESETS,
    describe,
    load_profile,
    profile_record,
    read_profile_record,
    save_profile,
)


def test_presets_load_and_say_they_are_estimates() -> None:
    for name, preset in PRESETS.items():
        assert load_profile(name) is preset.profile
        source, measured = describe(name)
        if not measured:
            assert source.startswith("ESTIMATE, not measured"), name
    h100 = PRESETS["h100-nvlink"].profile
    assert h100.gemm_flops == pytest.approx(989e12 * 0.6)
    assert h100.link_bandwidth == pytest.approx(450e9 * 0.7)
    assert "peak x 0.6" in PRESETS["h100-nvlink"].source


def test_json_round_trip(tmp_path) -> None:
    prof = HardwareProfile("mine", 1.5e10, 2.5e9, 3.5e-4)
    path = save_profile(
        tmp_path / "sub" / "p.json",
        profile_record(prof, source="measured here", measured=True, measurements={"a": [1]}),
    )
    assert load_profile(path) == prof
    assert load_profile(str(path)) == prof
    assert describe(str(path)) == ("measured here", True)
    assert read_profile_record(path)["measurements"] == {"a": [1]}
    assert load_profile(prof) is prof


def test_fixed_costs_round_trip_and_old_files_load(tmp_path) -> None:
    prof = HardwareProfile("mine", 1.5e10, 2.5e9, 3.5e-4, 2e-3, 4e-7, 1.5e-3)
    path = save_profile(tmp_path / "p.json", profile_record(prof, source="s", measured=True))
    assert load_profile(path) == prof
    rec = read_profile_record(path)
    assert (rec["step_fixed_s"], rec["row_overhead_s"], rec["replica_fixed_s"]) == (
        2e-3,
        4e-7,
        1.5e-3,
    )
    # a file written before the fixed costs existed: they load as 0.0
    old = {k: v for k, v in rec.items() if not k.endswith(("_fixed_s", "_overhead_s"))}
    path.write_text(json.dumps(old))
    assert load_profile(path) == HardwareProfile("mine", 1.5e10, 2.5e9, 3.5e-4)
    path.write_text(json.dumps({**rec, "replica_fixed_s": -1.0}))
    with pytest.raises(ValueError, match="replica_fixed_s must be finite and >= 0"):
        load_profile(path)


def test_bad_profiles_name_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a preset .* nor an existing file"):
        load_profile("h200-magic")
    with pytest.raises(FileNotFoundError, match="mixmoe calibrate"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a mixmoe hardware profile"):
        load_profile(bad)
    rec = profile_record(CPU_PROFILE, source="s", measured=True)
    bad.write_text(json.dumps({**rec, "gemm_flops": "fast"}))
    with pytest.raises(ValueError, match="non-numeric"):
        load_profile(bad)
    bad.write_text(json.dumps({**rec, "link_latency": -1.0}))
    with pytest.raises(ValueError, match="link_latency"):
        load_profile(bad)
    with pytest.raises(TypeError):
        load_profile(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("W,E", [(2, 1), (4, 3), (8, 2)])
def test_plan_loads_equals_rank_loads(W: int, E: int) -> None:
    gen = torch.Generator().manual_seed(W * 10 + E)
    shape = LayerShape(64, 128, E, W, 2)
    profile = HardwareProfile("compute-bound", 1e6, 1e12, 1e-9)
    replicated = 0
    for trial in range(4):
        C = torch.randint(0, 50, (W, W * E), generator=gen)
        C[:, trial % (W * E)] += 400  # a hot expert
        C[trial % W, 0] = 0  # a zero segment of a hot expert
        for plan in (plan_mix(C, shape, profile, 3), plan_shadow(C, shape, profile)):
            replicated += len(plan.replicas)
            want = rank_loads(C.tolist(), dict(plan.replicas), E)
            got = plan_loads(C, plan.replicas, E)
            assert got.dtype == torch.float64
            assert got.to(torch.int64).tolist() == [list(v) for v in want]
    assert replicated >= 4, "the test needs replicas"
    C = torch.randint(0, 5, (W, W * E), generator=gen)
    assert plan_loads(C, (), E).tolist() == [
        list(map(float, v)) for v in rank_loads(C.tolist(), {}, E)
    ]
