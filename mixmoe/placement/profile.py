"""Hardware profiles: the three numbers the placement cost model needs about a machine.

A profile is deliberately coarse: one sustained GEMM rate, one link bandwidth (each rank sends
and, at the same time, receives at this rate) and one fixed cost per collective call. The planner
only compares alternatives under the same profile, so what matters is the *ratio* of compute to
communication, not the absolute numbers. Benchmarks that want exact predictions should measure
their own profile and pass it in.

Where the built-in numbers come from:

``CPU_PROFILE`` (gloo over loopback, one torch thread per rank), measured on the development host
(AMD EPYC VM, torch 2.13 CPU, 2 processes):

- ``gemm_flops = 50e9``: a bare fp32 two-GEMM MLP forward+backward sustained 59-77 GFLOP/s on one
  thread (bare ``x @ w``: 60-97 GFLOP/s); ~20% is taken off for the gathers, scatters and block
  padding around the expert GEMMs.
- ``link_bandwidth = 1.2e9``: ``all_to_all_single`` between two gloo ranks moved 1.0-1.4 GB/s per
  rank for 1-32 MiB buffers.
- ``link_latency = 200e-6``: the same collective with 4 B - 4 KiB buffers took 210-450 us (less on
  an idle many-core host, more when ranks outnumber cores).

``GPU_PROFILE`` (a generic modern GPU node without NVLink between the EP ranks): ~300 TFLOP/s of
sustained bf16 grouped GEMM (an H100-class part runs dense bf16 GEMMs at 60-70% of its ~990 TFLOP/s
peak; grouped GEMMs on skewed segments run lower), ~50 GB/s per rank (PCIe Gen5 x16 / 400 Gb/s
InfiniBand class) and ~20 us per NCCL all-to-all launch + synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    """Coarse performance numbers of one rank of an expert-parallel group.

    name:           a label (shows up in benchmark reports).
    gemm_flops:     sustained FLOP/s of the expert GEMMs on one rank.
    link_bandwidth: bytes/s a rank can send and, simultaneously, receive.
    link_latency:   seconds of fixed cost per collective call.

    All three numbers must be positive and finite (``ValueError`` naming the field otherwise;
    ``TypeError`` if a field is not a real number at all).
    """

    name: str
    gemm_flops: float
    link_bandwidth: float
    link_latency: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareProfile.name must be a non-empty string, got {self.name!r}")
        for field_name in ("gemm_flops", "link_bandwidth", "link_latency"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"HardwareProfile.{field_name} must be a real number, got {value!r} "
                    f"({type(value).__name__})"
                )
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"HardwareProfile.{field_name} must be positive and finite, got {value!r}"
                )


CPU_PROFILE = HardwareProfile(
    name="cpu-gloo-loopback", gemm_flops=50e9, link_bandwidth=1.2e9, link_latency=200e-6
)
GPU_PROFILE = HardwareProfile(
    name="gpu-generic", gemm_flops=300e12, link_bandwidth=50e9, link_latency=20e-6
)

_DEFAULTS = {"cpu": CPU_PROFILE, "cuda": GPU_PROFILE}


def default_profile(device_type: str) -> HardwareProfile:
    """The built-in profile for a device type: ``"cpu"`` -> ``CPU_PROFILE``, ``"cuda"`` ->
    ``GPU_PROFILE``. Anything else raises ``ValueError`` (build a ``HardwareProfile`` yourself)."""
    profile = _DEFAULTS.get(device_type) if isinstance(device_type, str) else None
    if profile is None:
        raise ValueError(
            f"no default hardware profile for device type {device_type!r}; use one of "
            f"{sorted(_DEFAULTS)} or pass a HardwareProfile(name, gemm_flops, link_bandwidth, "
            "link_latency)"
        )
    return profile
