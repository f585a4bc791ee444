"""Hardware profiles: the numbers the placement cost model needs about a machine.

A profile is deliberately coarse: one sustained GEMM rate, one link bandwidth (each rank sends
and, at the same time, receives at this rate) and one fixed cost per collective call, plus three
optional fixed costs the layer pays around those (all 0.0 by default, which is the model as it
was before they existed): per layer step (``step_fixed_s``: gate, count exchange, plan, sort,
combine, optimizer and framework overhead, the same under every plan), per row computed
(``row_overhead_s``: the gathers, scatters and element-wise work around the expert GEMMs) and
per replica served or held (``replica_fixed_s``: packing, the extra work item for replica slots,
the gradient return and its reduction into the owner's grad, beyond the bytes on the link).
The planner compares alternatives under one profile, so the ratio of compute to communication
matters most; the fixed costs decide whether a replica pays at all at small sizes. Benchmarks
that want exact predictions should measure their own profile (``mixmoe calibrate``).

Where the built-in numbers come from:

``CPU_PROFILE`` (name ``cpu-gloo-loopback``: gloo over loopback, one torch thread per rank),
measured on the development host (AMD EPYC VM, torch 2.13 CPU, 2 processes):

- ``gemm_flops = 50e9``: a bare fp32 two-GEMM MLP forward+backward sustained 59-77 GFLOP/s on one
  thread (bare ``x @ w``: 60-97 GFLOP/s); ~20% is taken off for the gathers, scatters and block
  padding around the expert GEMMs.
- ``link_bandwidth = 1.2e9``: ``all_to_all_single`` between two gloo ranks moved 1.0-1.4 GB/s per
  rank for 1-32 MiB buffers.
- ``link_latency = 200e-6``: the same collective with 4 B - 4 KiB buffers took 210-450 us (less on
  an idle many-core host, more when ranks outnumber cores).
- ``replica_fixed_s = 2e-3``: the lowest per-replica cost the layer fit of ``mixmoe calibrate``
  gave on W=2 (a core per rank) on a quiet host: 1.9-6.7 ms, median ~4 ms, over the 8 W=2
  calibrations of the stored simulator validation (docs/results/2026-11-23-simulator-validation.md). Without it
  the planner priced a replica by its bytes alone and replicated for predicted gains smaller
  than what a replica measured. The other two fixed costs stay 0.0: they are the same under every plan (step_fixed_s)
  or fitted at ~0 on a quiet host (row_overhead_s), so they move absolute predictions, not
  decisions. Under load the fit moved from one calibration to the next (step_fixed_s 0-179 ms,
  replica_fixed_s 0-808 ms at load 6-14): calibrate the machine and pass the JSON
  (``--profile``) for absolute figures.

Topology (optional). ``ranks_per_node`` R splits the EP group into nodes of R consecutive ranks
(rank r on node r // R, as ``torchrun --nproc-per-node R`` numbers them); ``link_bandwidth`` and
``link_latency`` are then the intra-node link (NVLink) and ``inter_node_bandwidth`` /
``inter_node_latency`` the link between nodes (one InfiniBand NIC per GPU). All three None (the
default) is the one-link model: every pair of ranks on ``link_bandwidth`` / ``link_latency``,
exactly as before the fields existed. ``pair_link`` and ``link_seconds`` give the link of a pair
of ranks; a cost model that knows the topology prices each transfer with them (a cost model
that reads ``link_bandwidth`` alone prices every pair as intra-node). ``mixmoe calibrate
--ranks-per-node R`` measures both links (``mixmoe.bench.calibrate_links``).

``GPU_PROFILE`` (name ``gpu-generic``: a generic modern GPU node without NVLink between the EP
ranks), an ESTIMATE: ``gemm_flops = 300e12`` of sustained bf16 grouped GEMM (an H100-class part
runs dense bf16 GEMMs at 60-70% of its ~990 TFLOP/s peak; grouped GEMMs on skewed segments run
lower), ``link_bandwidth = 50e9`` per rank (PCIe Gen5 x16 / 400 Gb/s InfiniBand class) and
``link_latency = 20e-6`` per NCCL all-to-all launch + synchronisation; no fixed costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    """Coarse performance numbers of one rank of an expert-parallel group.

    name:            a label (shows up in benchmark reports).
    gemm_flops:      sustained FLOP/s of the expert GEMMs on one rank.
    link_bandwidth:  bytes/s a rank can send and, simultaneously, receive.
    link_latency:    seconds of fixed cost per collective call.
    step_fixed_s:    seconds per layer step (forward + backward + optimizer) on every rank,
                     whatever the plan (default 0.0: not modelled).
    row_overhead_s:  seconds per row computed at a rank, on top of its GEMM FLOPs (default 0.0).
    replica_fixed_s: seconds per replica a rank serves (as owner) or holds, on top of its bytes
                     on the link (default 0.0).
    ranks_per_node:  ranks per node R (rank r on node r // R), or None (default): one link for
                     every pair. With R, link_bandwidth / link_latency are the intra-node link.
    inter_node_bandwidth, inter_node_latency: the link between two ranks on different nodes
                     (bytes/s each way, seconds per transfer); set exactly when ranks_per_node is.
    shared_core_efficiency: where ranks outnumber the cores they share (``simulate --processors
                     P`` with P < W, never the planner's max over ranks), the share of P cores'
                     work the oversubscribed ranks get, in (0, 1]: 1.0 (default) is fair
                     processor sharing; below 1, a rank that runs while others wait runs
                     1 / efficiency faster than the all-busy share suggests
                     (``mixmoe.simulate.layer.processor_sharing_s``). ``mixmoe calibrate
                     --processors P`` fits it to its skewed ``a2a`` run.

    The first three numbers must be positive and finite, the fixed costs finite and >= 0, the
    efficiency in (0, 1], ranks_per_node an int >= 1 and the inter-node figures positive and
    finite, the three topology fields all None or all set (``ValueError`` naming the field
    otherwise; ``TypeError`` if a field is not a real number, ranks_per_node not an int).
    """

    name: str
    gemm_flops: float
    link_bandwidth: float
    link_latency: float
    step_fixed_s: float = 0.0
    row_overhead_s: float = 0.0
    replica_fixed_s: float = 0.0
    shared_core_efficiency: float = 1.0
    ranks_per_node: int | None = None
    inter_node_bandwidth: float | None = None
    inter_node_latency: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareProfile.name must be a non-empty string, got {self.name!r}")
        for field_name in (
            "gemm_flops",
            "link_bandwidth",
            "link_latency",
            *FIXED_COSTS,
            "shared_core_efficiency",
        ):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"HardwareProfile.{field_name} must be a real number, got {value!r} "
                    f"({type(value).__name__})"
                )
            if field_name == "shared_core_efficiency":
                if not (math.isfinite(value) and 0 < value <= 1):
                    raise ValueError(
                        f"HardwareProfile.shared_core_efficiency must be in (0, 1], got "
                        f"{value!r}; use 1.0 for fair sharing of the cores"
                    )
            elif field_name in FIXED_COSTS:
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(
                        f"HardwareProfile.{field_name} must be finite and >= 0 seconds, got "
                        f"{value!r}; use 0.0 to leave the cost out"
                    )
            elif not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"HardwareProfile.{field_name} must be positive and finite, got {value!r}"
                )
        self._check_topology()

    def _check_topology(self) -> None:
        topology = {name: getattr(self, name) for name in TOPOLOGY}
        given = [name for name, value in topology.items() if value is not None]
        if given and len(given) < len(TOPOLOGY):
            missing = [name for name in TOPOLOGY if name not in given]
            raise ValueError(
                f"HardwareProfile topology is partial: {given} set but {missing} None; set "
                "ranks_per_node, inter_node_bandwidth and inter_node_latency together (or none "
                "of them for one link between every pair of ranks)"
            )
        if not given:
            return
        R = self.ranks_per_node
        if isinstance(R, bool) or not isinstance(R, int):
            raise TypeError(
                f"HardwareProfile.ranks_per_node must be an int or None, got {R!r} "
                f"({type(R).__name__})"
            )
        if R < 1:
            raise ValueError(f"HardwareProfile.ranks_per_node must be >= 1, got {R}")
        for name in ("inter_node_bandwidth", "inter_node_latency"):
            value = topology[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"HardwareProfile.{name} must be a real number or None, got {value!r} "
                    f"({type(value).__name__})"
                )
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"HardwareProfile.{name} must be positive and finite, got {value!r}"
                )

    def node_of(self, rank: int) -> int:
        """The node of ``rank``: rank // ranks_per_node, 0 for every rank without topology."""
        _check_rank("rank", rank)
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node


# the optional fixed costs, in declaration order (0.0: not modelled)
FIXED_COSTS = ("step_fixed_s", "row_overhead_s", "replica_fixed_s")
# the optional topology, set together or not at all (None: one link for every pair)
TOPOLOGY = ("ranks_per_node", "inter_node_bandwidth", "inter_node_latency")


def _check_rank(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def pair_link(profile: HardwareProfile, a: int, b: int) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of the link between ranks ``a`` and ``b``: the inter-node
    figures when the profile has a topology and the two ranks are on different nodes, else
    ``link_bandwidth`` / ``link_latency`` (also for a == b: the caller decides whether a rank
    sending to itself costs anything; ``link_seconds`` says it does not)."""
    _check_rank("a", a)
    _check_rank("b", b)
    if profile.ranks_per_node is not None and profile.node_of(a) != profile.node_of(b):
        assert profile.inter_node_bandwidth is not None and profile.inter_node_latency is not None
        return profile.inter_node_bandwidth, profile.inter_node_latency
    return profile.link_bandwidth, profile.link_latency


def link_seconds(profile: HardwareProfile, src: int, dst: int, nbytes: int) -> float:
    """Seconds to move ``nbytes`` (an int >= 0) from rank ``src`` to rank ``dst`` alone on
    their link: latency + nbytes / bandwidth of ``pair_link``; 0.0 when nothing moves
    (nbytes == 0 or src == dst)."""
    _check_rank("nbytes", nbytes)
    bandwidth, latency = pair_link(profile, src, dst)
    if nbytes == 0 or src == dst:
        return 0.0
    return latency + nbytes / bandwidth


CPU_PROFILE = HardwareProfile(
    name="cpu-gloo-loopback",
    gemm_flops=50e9,
    link_bandwidth=1.2e9,
    link_latency=200e-6,
    replica_fixed_s=2e-3,
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
