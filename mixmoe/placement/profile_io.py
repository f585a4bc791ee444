"""Hardware profiles on disk and by name: presets (estimates) and calibrated JSON files.

A ``--profile`` value (``bench layer``, ``bench planner``, ``simulate``) and
``parallelize_moe(profile=...)`` go through ``load_profile``: a preset name (``PRESETS``) or the
path of a JSON file written by ``mixmoe calibrate`` (``save_profile``).

JSON layout (one object)::

    {"format": "mixmoe-hardware-profile", "version": 1,
     "name": ..., "gemm_flops": ..., "link_bandwidth": ..., "link_latency": ...,
     "step_fixed_s": ..., "row_overhead_s": ..., "replica_fixed_s": ...,   # optional, 0.0
     "shared_core_efficiency": ...,                                        # optional, 1.0
     "ranks_per_node": ..., "inter_node_bandwidth": ..., "inter_node_latency": ...,
                                         # optional, together: the topology (absent: one link)
     "measured": true|false, "source": "how the numbers were obtained",
     "measurements": {...}}          # optional: calibrate's raw sweeps, kept for the record
                                     # (with a topology: intra_node / inter_node and their fits)

The fixed costs (``HardwareProfile``) are optional: files written before they existed load with
0.0 (the cost model without them); so is ``shared_core_efficiency`` (1.0: fair sharing), and so
is the topology (absent: one link between every pair of ranks; written only when the profile has
one, so a profile without it writes the same file as before).

Presets are ESTIMATES, not measurements: vendor peak x a stated efficiency, the efficiency being
a typical sustained fraction (dense bf16 GEMM ~60% of the tensor-core peak, grouped GEMMs on
skewed segments lower; NCCL all-to-all ~70% of the NVLink / PCIe per-direction rate, ~80% of an
InfiniBand NIC's). Calibrate the machine (``mixmoe calibrate``) before trusting absolute numbers.
Torch-free.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixmoe.placement.profile import (
    CPU_PROFILE,
    FIXED_COSTS,
    GPU_PROFILE,
    TOPOLOGY,
    HardwareProfile,
)

__all__ = [
    "FORMAT",
    "PRESETS",
    "Preset",
    "load_profile",
    "profile_record",
    "read_profile_record",
    "save_profile",
]

FORMAT = "mixmoe-hardware-profile"
VERSION = 1


@dataclass(frozen=True)
class Preset:
    """A named profile and where its figures come from (``measured`` False: an estimate)."""

    profile: HardwareProfile
    source: str
    measured: bool = False


def _estimate(
    name: str, peak_flops: float, flops_eff: float, link: float, link_eff: float, lat: float, what
) -> Preset:
    source = (
        f"ESTIMATE, not measured: {what}; gemm = {peak_flops / 1e12:g} TFLOP/s peak x "
        f"{flops_eff:g}, link = {link / 1e9:g} GB/s per direction x {link_eff:g}, "
        f"latency {lat * 1e6:g} us per all-to-all (typical NCCL launch + sync)"
    )
    profile = HardwareProfile(name, peak_flops * flops_eff, link * link_eff, lat)
    return Preset(profile, source)


def _estimate_nodes(
    name: str,
    peak_flops: float,
    gpus: int,
    nvlink: float,
    nic: float,
    what: str,
    flops_eff: float = 0.6,
    nvlink_eff: float = 0.7,
    nic_eff: float = 0.8,
    nvlink_lat: float = 15e-6,
    nic_lat: float = 30e-6,
) -> Preset:
    """Nodes of ``gpus`` GPUs on NVLink (the intra-node link) joined by one NIC per GPU."""
    source = (
        f"ESTIMATE, not measured: {what}; gemm = {peak_flops / 1e12:g} TFLOP/s peak x "
        f"{flops_eff:g}; {gpus} ranks per node; intra-node link = {nvlink / 1e9:g} GB/s per "
        f"direction x {nvlink_eff:g}, latency {nvlink_lat * 1e6:g} us; inter-node link = "
        f"{nic / 1e9:g} GB/s per direction x {nic_eff:g}, latency {nic_lat * 1e6:g} us per "
        "all-to-all (typical NCCL launch + sync)"
    )
    profile = HardwareProfile(
        name,
        peak_flops * flops_eff,
        nvlink * nvlink_eff,
        nvlink_lat,
        ranks_per_node=gpus,
        inter_node_bandwidth=nic * nic_eff,
        inter_node_latency=nic_lat,
    )
    return Preset(profile, source)


PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        CPU_PROFILE,
        "built-in CPU default (gloo loopback, one thread per rank), measured once on the "
        "development host; see mixmoe/placement/profile.py",
        measured=True,
    ),
    "gpu": Preset(
        GPU_PROFILE,
        "ESTIMATE, not measured: built-in generic GPU default (no NVLink between EP ranks); "
        "see mixmoe/placement/profile.py",
    ),
    "h100-nvlink": _estimate(
        "h100-nvlink",
        989e12,
        0.6,
        450e9,
        0.7,
        15e-6,
        "H100 SXM, bf16 dense tensor-core peak; NVLink 4 (900 GB/s bidirectional)",
    ),  # fmt: skip
    "a100-nvlink": _estimate(
        "a100-nvlink",
        312e12,
        0.6,
        300e9,
        0.7,
        15e-6,
        "A100 SXM, bf16 dense tensor-core peak; NVLink 3 (600 GB/s bidirectional)",
    ),  # fmt: skip
    "h100-pcie": _estimate(
        "h100-pcie",
        756e12,
        0.6,
        64e9,
        0.7,
        20e-6,
        "H100 PCIe, bf16 dense peak; PCIe Gen5 x16 only (64 GB/s per direction)",
    ),  # fmt: skip
    "a100-pcie": _estimate(
        "a100-pcie",
        312e12,
        0.6,
        32e9,
        0.7,
        20e-6,
        "A100 PCIe, bf16 dense peak; PCIe Gen4 x16 only (32 GB/s per direction)",
    ),  # fmt: skip
    "h100-ib": _estimate(
        "h100-ib",
        989e12,
        0.6,
        50e9,
        0.8,
        30e-6,
        "H100 SXM, EP group across nodes over one 400 Gb/s InfiniBand NDR NIC per GPU",
    ),  # fmt: skip
    "h100-nvlink-ib": _estimate_nodes(
        "h100-nvlink-ib",
        989e12,
        8,
        450e9,
        50e9,
        "8x H100 SXM nodes (HGX), bf16 dense tensor-core peak; NVLink 4 (900 GB/s "
        "bidirectional) inside a node, one 400 Gb/s InfiniBand NDR NIC per GPU between nodes",
    ),  # fmt: skip
    "a100-nvlink-ib": _estimate_nodes(
        "a100-nvlink-ib",
        312e12,
        8,
        300e9,
        25e9,
        "8x A100 SXM nodes (HGX), bf16 dense tensor-core peak; NVLink 3 (600 GB/s "
        "bidirectional) inside a node, one 200 Gb/s InfiniBand HDR NIC per GPU between nodes",
    ),  # fmt: skip
    "a100-ib": _estimate(
        "a100-ib",
        312e12,
        0.6,
        25e9,
        0.8,
        30e-6,
        "A100 SXM, EP group across nodes over one 200 Gb/s InfiniBand HDR NIC per GPU",
    ),  # fmt: skip
    "v100-pcie": _estimate(
        "v100-pcie",
        125e12,
        0.5,
        16e9,
        0.7,
        20e-6,
        "V100, fp16 tensor-core peak; PCIe Gen3 x16 only (16 GB/s per direction)",
    ),  # fmt: skip
    "v100-nvlink": _estimate(
        "v100-nvlink",
        125e12,
        0.5,
        150e9,
        0.7,
        15e-6,
        "V100 SXM2, fp16 tensor-core peak; NVLink 2 (300 GB/s bidirectional)",
    ),  # fmt: skip
}


def profile_record(
    profile: HardwareProfile,
    *,
    source: str,
    measured: bool,
    measurements: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON object of a profile (see the module doc)."""
    record: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "name": profile.name,
        "gemm_flops": profile.gemm_flops,
        "link_bandwidth": profile.link_bandwidth,
        "link_latency": profile.link_latency,
        **{k: getattr(profile, k) for k in FIXED_COSTS},
        "shared_core_efficiency": profile.shared_core_efficiency,
        # the topology only when there is one: files of one-link profiles stay as they were
        **(
            {k: getattr(profile, k) for k in TOPOLOGY} if profile.ranks_per_node is not None else {}
        ),
        "measured": bool(measured),
        "source": source,
    }
    if measurements is not None:
        record["measurements"] = measurements
    return record


def save_profile(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write ``record`` (``profile_record``) as indented JSON; parent directories are created."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out


def read_profile_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object of a profile file, checked: ``ValueError`` naming the file and the fix
    (not JSON, not a profile, a format version other than ``VERSION``, a required key missing);
    ``FileNotFoundError`` for a missing file."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"profile file {os.fspath(path)!r} does not exist; write one with `mixmoe calibrate "
            f"--out {os.fspath(path)}` or use a preset ({', '.join(PRESETS)})"
        ) from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile file {os.fspath(path)!r} is not JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(
            f"profile file {os.fspath(path)!r} is not a mixmoe hardware profile (no "
            f'"format": "{FORMAT}"); write one with `mixmoe calibrate`'
        )
    if record.get("version", VERSION) != VERSION:  # hand-written files may leave it out
        raise ValueError(
            f"profile file {os.fspath(path)!r} has format version {record['version']!r}; this "
            f"mixmoe reads version {VERSION}: recalibrate with `mixmoe calibrate` or upgrade mixmoe"
        )
    missing = [
        k for k in ("name", "gemm_flops", "link_bandwidth", "link_latency") if k not in record
    ]
    if missing:
        raise ValueError(f"profile file {os.fspath(path)!r} lacks {missing}")
    return record


def load_profile(spec: str | os.PathLike[str] | HardwareProfile) -> HardwareProfile:
    """A ``HardwareProfile`` from a preset name (``PRESETS``), a calibrate JSON file, or a
    profile (returned as is). Unknown names that are not files raise ``ValueError`` listing the
    presets; a missing ``.json`` path raises ``FileNotFoundError`` (an ``OSError``)."""
    if isinstance(spec, HardwareProfile):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"profile must be a preset name, a JSON path or a HardwareProfile: {spec!r}"
        )
    text = os.fspath(spec)
    if text in PRESETS:
        return PRESETS[text].profile
    if not os.path.exists(text) and not text.endswith(".json"):
        raise ValueError(
            f"profile {text!r} is neither a preset ({', '.join(PRESETS)}) nor an existing file; "
            "use a preset name or the JSON written by `mixmoe calibrate`"
        )
    record = read_profile_record(text)
    keys = ("gemm_flops", "link_bandwidth", "link_latency", *FIXED_COSTS)
    values = [record.get(k, 0.0) for k in keys]  # the fixed costs are optional (older files)
    values.append(record.get("shared_core_efficiency", 1.0))  # optional too: fair sharing
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values) or not all(
        math.isfinite(v) for v in values
    ):
        raise ValueError(f"profile file {text!r} holds non-numeric figures {values}")
    topology = {k: record.get(k) for k in TOPOLOGY}  # optional: absent is None (one link)
    R = topology["ranks_per_node"]
    if isinstance(R, float) and R.is_integer():
        topology["ranks_per_node"] = int(R)  # JSON written by hand may say 8.0
    for k in ("inter_node_bandwidth", "inter_node_latency"):
        if isinstance(topology[k], int) and not isinstance(topology[k], bool):
            topology[k] = float(topology[k])
    try:
        return HardwareProfile(str(record["name"]), *(float(v) for v in values), **topology)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"profile file {text!r}: {exc}") from None


def describe(spec: str | os.PathLike[str] | HardwareProfile) -> tuple[str, bool]:
    """(source, measured) of a preset name or a profile file (a file without them: ('', False));
    a bare profile: ('given in code', False)."""
    if isinstance(spec, HardwareProfile):
        return "given in code", False
    text = os.fspath(spec)
    if text in PRESETS:
        return PRESETS[text].source, PRESETS[text].measured
    record = read_profile_record(text)
    return str(record.get("source", "")), bool(record.get("measured", False))
