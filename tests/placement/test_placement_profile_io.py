"""Profiles on disk and by name (``mixmoe.placement.profile_io``) and the vectorised plan loads."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from mixmoe.placement import CPU_PROFILE, HardwareProfile, LayerShape, plan_mix, plan_shadow
from mixmoe.placement.cost_model import plan_loads, rank_loads
from mixmoe.placement.profile_io import (
    FORMAT,
    PRESETS,
    VERSION,
    Preset,
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
    prof = HardwareProfile("mine", 1.5e10, 2.5e9, 3.5e-4, 2e-3, 4e-7, 1.5e-3, 0.8)
    path = save_profile(tmp_path / "p.json", profile_record(prof, source="s", measured=True))
    assert load_profile(path) == prof
    rec = read_profile_record(path)
    assert (rec["step_fixed_s"], rec["row_overhead_s"], rec["replica_fixed_s"]) == (
        2e-3,
        4e-7,
        1.5e-3,
    )
    assert rec["shared_core_efficiency"] == 0.8
    # a file written before the fixed costs and the shared-core efficiency existed: they load as
    # 0.0 and 1.0 (fair sharing)
    old = {
        k: v
        for k, v in rec.items()
        if not k.endswith(("_fixed_s", "_overhead_s")) and k != "shared_core_efficiency"
    }
    path.write_text(json.dumps(old))
    assert load_profile(path) == HardwareProfile("mine", 1.5e10, 2.5e9, 3.5e-4)
    assert load_profile(path).shared_core_efficiency == 1.0
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


_ESTIMATE = re.compile(
    r"^ESTIMATE, not measured: .+; gemm = (\S+) TFLOP/s peak x (\S+), link = (\S+) GB/s per "
    r"direction x (\S+), latency (\S+) us per all-to-all \(typical NCCL launch \+ sync\)$"
)


def test_estimated_presets_hold_the_figures_their_source_states() -> None:
    """Each estimate's profile is peak x efficiency as its source text states it; only the CPU
    preset is a measurement; presets are frozen records."""
    estimates = nodes = 0
    for name, preset in PRESETS.items():
        source, measured = describe(name)
        assert (source, measured) == (preset.source, preset.measured)
        assert measured is (name == "cpu"), name
        if preset.profile.ranks_per_node is not None:
            nodes += 1  # two links: test_placement_topology checks their figures
            continue
        figures = _ESTIMATE.match(source)
        if figures is None:
            assert name in ("cpu", "gpu"), name  # the built-in defaults, described in words
            continue
        estimates += 1
        peak, flops_eff, link, link_eff, lat_us = map(float, figures.groups())
        assert preset.profile.name == name
        assert math.isclose(preset.profile.gemm_flops, peak * 1e12 * flops_eff, rel_tol=1e-12)
        assert math.isclose(preset.profile.link_bandwidth, link * 1e9 * link_eff, rel_tol=1e-12)
        assert math.isclose(preset.profile.link_latency, lat_us * 1e-6, rel_tol=1e-12)
    assert estimates == len(PRESETS) - 2 - nodes
    assert PRESETS["a100-ib"].profile.link_bandwidth == pytest.approx(25e9 * 0.8)
    with pytest.raises(AttributeError):
        PRESETS["gpu"].measured = True  # type: ignore[misc]
    assert Preset(CPU_PROFILE, "s").measured is False


# the vendors' datasheet peaks (dense, no sparsity) in TFLOP/s, of the precision each preset's
# text names (bf16 on A100 / H100, fp16 tensor cores on V100): an independent table
_PEAK_TFLOPS = {"H100 SXM": 989, "H100 PCIe": 756, "A100": 312, "V100": 125}


def test_estimates_take_the_published_peaks_and_the_links_their_text_names() -> None:
    """Each estimate's peak is the vendor's figure for the GPU its text names; its link is the
    figure the text names (half a bidirectional NVLink figure, a PCIe figure per direction, a
    NIC's Gb/s over 8); efficiencies lie in (0, 1] and latencies at 1-100 us."""
    for name, preset in PRESETS.items():
        if name in ("cpu", "gpu") or preset.profile.ranks_per_node is not None:
            continue  # node presets: test_placement_topology
        what = preset.source.split(": ", 1)[1].split("; gemm = ")[0]
        peak, flops_eff, link, link_eff, lat_us = map(
            float, _ESTIMATE.match(preset.source).groups()
        )
        gpu = max((g for g in _PEAK_TFLOPS if g in what), key=len)
        assert peak == _PEAK_TFLOPS[gpu], name
        if found := re.search(r"\((\d+) GB/s bidirectional\)", what):
            named = float(found.group(1)) / 2
        elif found := re.search(r"\((\d+) GB/s per direction\)", what):
            named = float(found.group(1))
        else:
            named = float(re.search(r"(\d+) Gb/s InfiniBand", what).group(1)) / 8
        assert link == named, name
        assert 0 < flops_eff <= 1 and 0 < link_eff <= 1 and 1 <= lat_us <= 100, name


def test_profile_record_layout(tmp_path) -> None:
    """The file holds the documented object, indented, one newline at the end; parents of any
    depth are created; measurements are left out unless given."""
    prof = HardwareProfile("mine", 1.5e10, 2.5e9, 3.5e-4, 2e-3, 4e-7, 1.5e-3, 0.75)
    rec = profile_record(prof, source="by hand", measured=1)  # type: ignore[arg-type]
    assert rec == {
        "format": FORMAT,
        "version": VERSION,
        "name": "mine",
        "gemm_flops": 1.5e10,
        "link_bandwidth": 2.5e9,
        "link_latency": 3.5e-4,
        "step_fixed_s": 2e-3,
        "row_overhead_s": 4e-7,
        "replica_fixed_s": 1.5e-3,
        "shared_core_efficiency": 0.75,
        "measured": True,
        "source": "by hand",
    }
    assert (FORMAT, VERSION) == ("mixmoe-hardware-profile", 1)
    assert rec["measured"] is True
    path = save_profile(str(tmp_path / "a" / "b" / "p.json"), rec)
    assert path == tmp_path / "a" / "b" / "p.json"
    assert path.read_text() == json.dumps(rec, indent=2) + "\n"
    assert read_profile_record(path) == rec
    save_profile(path, {**rec, "source": "again"})  # over an existing file
    assert describe(path) == ("again", True)


def test_describe_a_bare_profile_and_a_file_without_provenance(tmp_path) -> None:
    prof = HardwareProfile("mine", 1.5e10, 2.5e9, 3.5e-4)
    assert describe(prof) == ("given in code", False)
    rec = profile_record(prof, source="s", measured=True)
    path = tmp_path / "p.json"
    path.write_text(json.dumps({k: v for k, v in rec.items() if k not in ("source", "measured")}))
    assert describe(path) == ("", False)
    assert load_profile(path) == prof


def test_profile_files_are_checked_field_by_field(tmp_path) -> None:
    """Booleans, NaN and infinities are no figures; a record without a required key, or of
    another format version, is refused naming the file; a file without a version loads."""
    rec = profile_record(CPU_PROFILE, source="s", measured=True)
    bad = tmp_path / "bad.json"
    for key in ("gemm_flops", "link_latency", "replica_fixed_s"):
        for value in (True, math.nan, -math.inf):
            bad.write_text(json.dumps({**rec, key: value}))
            with pytest.raises(ValueError, match=r"bad\.json' holds non-numeric figures \["):
                load_profile(bad)
    for key in ("name", "gemm_flops", "link_bandwidth", "link_latency"):
        bad.write_text(json.dumps({k: v for k, v in rec.items() if k != key}))
        with pytest.raises(ValueError, match=rf"bad\.json' lacks \['{key}'\]"):
            read_profile_record(bad)
    for version in (2, "1", None):
        bad.write_text(json.dumps({**rec, "version": version}))
        with pytest.raises(ValueError, match=rf"format version {version!r}; .* reads version 1"):
            load_profile(bad)
    bad.write_text(json.dumps([rec]))
    with pytest.raises(ValueError, match="not a mixmoe hardware profile"):
        read_profile_record(bad)
    bad.write_text(json.dumps({k: v for k, v in rec.items() if k != "version"}))
    assert load_profile(bad) == CPU_PROFILE
    existing = tmp_path / "profile.txt"  # an existing file is read whatever its suffix
    existing.write_text(json.dumps(rec))
    assert load_profile(existing) == load_profile(str(existing)) == CPU_PROFILE
    with pytest.raises(TypeError, match="profile must be a preset name, a JSON path or a"):
        load_profile(3)  # type: ignore[arg-type]
