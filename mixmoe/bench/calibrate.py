"""The calibration engine (``mixmoe calibrate``, CLI in ``mixmoe.commands.calibrate``): measure
the three numbers of a ``HardwareProfile`` on this machine.

Legend: E experts, R rows per expert, D model dim, F expert hidden dim, W ranks.

1. Expert MLP rate, measured on every rank at once (W processes sharing the machine as in a
   W-rank benchmark; each point is the slowest rank's median). E experts' two-GEMM MLPs (``x_ERD @ w1_EDF -> gelu -> @ w2_EFD``, batched
   matmuls: the grouped GEMM of equal segments) at several R, forward and backward timed apart
   (medians over ``repeats`` after ``warmup``). Forward FLOPs = 4 * E * R * D * F, backward 2x.
   ``gemm_flops`` is the slope of a least-squares line of forward + backward seconds against
   FLOPs over the sweep (the intercept, a fixed cost per call, is reported, not used by the cost
   model); on a machine too noisy for a positive slope, the mean rate over the sweep.
2. all_to_all. ``all_to_all_single`` with equal splits on W ranks (gloo over ``spawn_gloo`` on
   CPU, NCCL on GPU when launched by torchrun: the same ``_a2a_rank`` code), each rank sending
   S bytes in all (S (W-1)/W of them to other ranks) for a sweep of S. A step's time is the max
   over ranks (all-reduced), its median over repeats is the point. ``link_latency`` and
   ``link_bandwidth`` are the intercept and 1 / slope of a least-squares line of seconds against
   the bytes a rank sends to others (the cost model's ``latency + bytes / bandwidth``); the
   intercept is floored at the smallest measured time / 2 when the fit makes it negative. Too
   noisy for a positive slope: latency = the fastest call, bandwidth from the largest size.
   ``measurements`` records which method gave the numbers.
3. The fixed costs (``step_fixed_s``, ``row_overhead_s``, ``replica_fixed_s``): a fit to short
   runs of the real layer at ``layer_tokens`` tokens per rank (``mixmoe.bench.calibrate_layer``;
   ``layer_tokens=()`` skips it and leaves them 0.0); with ``processors`` (ranks sharing that
   many cores) the fit aggregates ranks as ``simulate --processors`` does.

One rank (``world_size=1``: a one-GPU machine, or one CPU process; no process group, also when
torchrun launched one process). The GEMM sweep and the fixed-cost fit (``local`` layer runs:
``step_fixed_s``, ``row_overhead_s``) are measured as above. A single rank has no link, so
``link_bandwidth`` and ``link_latency`` are NOT measured: they are the figures of the preset
named by ``links`` (default ``gpu`` on CUDA, ``cpu`` on CPU), and so is ``replica_fixed_s`` (one
rank holds no replica). ``measurements["not_measured"]`` lists them and ``measurements["links"]``
names the preset and its source; the CLI prints it. The profile then predicts one-device steps
(``mixmoe simulate --world-size 1``) from measured figures; multi-rank predictions from it rest
on the preset's link.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mixmoe.bench.timing import median
from mixmoe.comm import Communicator
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.profile_io import PRESETS
from mixmoe.validation import check_int

__all__ = [
    "CalibrateConfig",
    "calibrate",
    "fit_line",
    "links_preset",
    "measure_a2a",
    "measure_gemm",
    "measure_ranks",
]


@dataclass(frozen=True)
class CalibrateConfig:
    """rows: rows per expert of the GEMM sweep; a2a_bytes: bytes each rank sends per all_to_all;
    layer_tokens: tokens per rank of the layer runs the fixed costs are fitted to (at least two
    distinct sizes, or () to skip the fit and leave them 0.0); links: on one rank
    (world_size=1), the preset whose link figures (and replica_fixed_s) the profile takes, not
    measured ("": ``gpu`` on CUDA, ``cpu`` on CPU); with world_size >= 2 the links are measured
    and ``links`` must stay ""; processors: the cores the ranks share (None: a core per rank),
    the fixed costs then fitted under the simulator's processor-sharing aggregation."""

    model_dim: int = 256
    hidden_size: int = 1024
    experts: int = 4
    rows: tuple[int, ...] = (64, 256, 1024)
    world_size: int = 2
    a2a_bytes: tuple[int, ...] = (4096, 65536, 1 << 20, 4 << 20)
    layer_tokens: tuple[int, ...] = (256, 512, 1024)
    repeats: int = 10
    warmup: int = 3
    threads: int = 1
    device: str = "cpu"
    name: str = "calibrated"
    links: str = ""
    processors: int | None = None

    def __post_init__(self) -> None:
        for name, lo in (
            ("model_dim", 1),
            ("hidden_size", 1),
            ("experts", 1),
            ("world_size", 1),
            ("repeats", 1),
            ("warmup", 0),
            ("threads", 1),
        ):
            check_int(name, getattr(self, name), lo)
        for name in ("rows", "a2a_bytes"):
            values = getattr(self, name)
            if len(values) < 2 or any(
                isinstance(v, bool) or not isinstance(v, int) for v in values
            ):
                raise ValueError(f"{name} needs at least two integer sizes, got {values!r}")
            if min(values) < 1:
                raise ValueError(f"{name} must be positive, got {values!r}")
        tokens = self.layer_tokens
        if tokens and (
            any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in tokens)
            or len(set(tokens)) < 2
        ):
            raise ValueError(
                f"layer_tokens needs at least two distinct positive integers, got {tokens!r}; "
                "or () to skip the fixed-cost fit"
            )
        if not self.name:
            raise ValueError("name must be a non-empty string")
        if self.links and self.world_size > 1:
            raise ValueError(
                f"links={self.links!r} is for one rank (world_size 1), where no link can be "
                f"measured; on {self.world_size} ranks the all_to_all sweep measures it: drop "
                "--links"
            )
        if self.processors is not None:
            check_int("processors", self.processors, 1)
        if self.links and self.links not in PRESETS:
            raise ValueError(
                f"links={self.links!r} is not a preset; use one of {', '.join(PRESETS)}"
            )


def links_preset(cfg: CalibrateConfig) -> str:
    """The preset whose link figures a one-rank calibration takes: ``cfg.links``, else ``gpu``
    on CUDA and ``cpu`` on CPU."""
    if cfg.links:
        return cfg.links
    return "cpu" if torch.device(cfg.device).type == "cpu" else "gpu"


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y against x (at least two distinct x)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx == 0:
        raise ValueError(f"a line fit needs at least two distinct sizes, got {x}")
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx
    return my - slope * mx, slope


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gemm(cfg: CalibrateConfig) -> list[dict[str, float]]:
    """One record per rows-per-expert R: fwd_s, bwd_s (medians) and the FLOP/s of each."""
    device = torch.device(cfg.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    E, D, Fh = cfg.experts, cfg.model_dim, cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    w1_EDF = (torch.randn(E, D, Fh, generator=gen) / D**0.5).to(device, dtype).requires_grad_()
    w2_EFD = (torch.randn(E, Fh, D, generator=gen) / Fh**0.5).to(device, dtype).requires_grad_()
    out = []
    for R in cfg.rows:
        x_ERD = torch.randn(E, R, D, generator=gen).to(device, dtype).requires_grad_()
        dy_ERD = torch.randn(E, R, D, generator=gen).to(device, dtype)
        fwd, bwd = [], []
        for i in range(cfg.warmup + cfg.repeats):
            _sync(device)
            t0 = time.perf_counter()
            y_ERD = torch.bmm(F.gelu(torch.bmm(x_ERD, w1_EDF)), w2_EFD)
            _sync(device)
            t1 = time.perf_counter()
            torch.autograd.backward(y_ERD, dy_ERD)
            _sync(device)
            t2 = time.perf_counter()
            x_ERD.grad = w1_EDF.grad = w2_EFD.grad = None
            if i >= cfg.warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        flops = 4.0 * E * R * D * Fh
        f, b = median(fwd), median(bwd)
        out.append(
            {
                "rows_per_expert": R,
                "fwd_s": f,
                "bwd_s": b,
                "fwd_flops": flops / f,
                "bwd_flops": 2 * flops / b,
                "flops_fwd_bwd": 3 * flops,
            }
        )
    return out


def _rank_sweeps(
    comm: Communicator, cfg: CalibrateConfig
) -> tuple[list[dict], list[dict], list[dict]]:
    """Every rank at once: the expert MLP sweep (each rank's times all-reduced to the slowest:
    the per-rank rate while W ranks share the machine, as in a W-rank benchmark), the
    all_to_all sweep, then the layer runs of the fixed-cost fit; every rank returns the same
    figures. ``comm`` None: one rank without a process group (no all_to_all sweep: [])."""
    gemm = measure_gemm(cfg)
    if comm is None:
        a2a: list[dict] = []
    else:
        device = torch.device(cfg.device)
        times = torch.tensor([[p["fwd_s"], p["bwd_s"]] for p in gemm], dtype=torch.float64)
        slowest = comm.all_reduce_max(times.to(device)).cpu().tolist()
        for p, (f, b) in zip(gemm, slowest, strict=True):
            p.update(fwd_s=f, bwd_s=b, fwd_flops=p["flops_fwd_bwd"] / 3 / f)
            p["bwd_flops"] = p["flops_fwd_bwd"] * 2 / 3 / b
        a2a = _a2a_rank(comm, cfg)
    if not cfg.layer_tokens:
        return gemm, a2a, []
    from mixmoe.bench.calibrate_layer import layer_runs

    return gemm, a2a, layer_runs(comm, cfg)


def _a2a_rank(comm: Communicator, cfg: CalibrateConfig) -> list[dict[str, float]]:
    """Every rank: the all_to_all sweep; every rank returns the same (all-reduced) medians."""
    W = comm.world_size
    device = torch.device(cfg.device)
    out = []
    for nbytes in cfg.a2a_bytes:
        per = max(1, nbytes // (4 * W))  # fp32 elements per destination
        x = torch.randn(per * W, device=device)
        y = torch.empty_like(x)
        splits = [per] * W
        times = []
        for i in range(cfg.warmup + cfg.repeats):
            comm.barrier()
            _sync(device)
            t0 = time.perf_counter()
            comm.all_to_all(y, x, splits, splits)
            _sync(device)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            if i >= cfg.warmup:
                times.append(float(comm.all_reduce_max(dt)))
        sent = 4 * per * W
        out.append(
            {"bytes_per_rank": sent, "bytes_to_others": sent * (W - 1) // W, "s": median(times)}
        )
    return out


def measure_ranks(
    cfg: CalibrateConfig, comm: Communicator | None = None
) -> tuple[list[dict], list[dict], list[dict]]:
    """(expert MLP sweep, all_to_all sweep, layer runs) measured on ``comm`` (torchrun's group)
    or on W spawned gloo ranks (CPU), all ranks at once; on one rank (``cfg.world_size`` 1) in
    this process on ``cfg.device``, without a process group (no all_to_all sweep)."""
    W = cfg.world_size if comm is None else comm.world_size
    if W != cfg.world_size:
        raise ValueError(
            f"world_size {cfg.world_size} but torchrun launched {W} ranks; give --world-size {W}"
        )
    if W == 1:
        return _rank_sweeps(None, cfg)
    if comm is not None:
        return _rank_sweeps(comm, cfg)
    if cfg.device != "cpu":
        raise ValueError("spawning ranks is for --device cpu; launch GPU calibration with torchrun")
    from mixmoe.comm.launch import spawn_gloo

    return spawn_gloo(_rank_sweeps, cfg.world_size, cfg, threads=cfg.threads, timeout_s=600)[0]


def measure_a2a(cfg: CalibrateConfig, comm: Communicator | None = None) -> list[dict[str, float]]:
    """The all_to_all sweep alone (see ``measure_ranks``)."""
    if comm is not None:
        return _a2a_rank(comm, cfg)
    from mixmoe.comm.launch import spawn_gloo

    return spawn_gloo(_a2a_rank, cfg.world_size, cfg, threads=cfg.threads, timeout_s=600)[0]


def calibrate(
    cfg: CalibrateConfig, comm: Communicator | None = None
) -> tuple[HardwareProfile, dict[str, Any]]:
    """(the measured profile, the raw measurements and the fits)."""
    gemm, a2a, runs = measure_ranks(cfg, comm)
    flops = [p["flops_fwd_bwd"] for p in gemm]
    secs = [p["fwd_s"] + p["bwd_s"] for p in gemm]
    icpt_g, slope_g = fit_line(flops, secs)
    gemm_method = "least-squares slope"
    if slope_g <= 0:  # a noisy machine: fall back to the mean rate over the sweep
        slope_g, gemm_method = sum(secs) / sum(flops), "mean rate (the fit's slope was <= 0)"
    measurements: dict[str, Any] = {
        "gemm": gemm,
        "gemm_fit": {"intercept_s": icpt_g, "flops": 1.0 / slope_g, "method": gemm_method},
        "all_to_all": a2a,
    }
    if a2a:
        profile, measurements["a2a_fit"] = _fit_links(cfg.name, 1.0 / slope_g, a2a)
    else:  # one rank: no link to measure; the preset's figures, said so
        preset = links_preset(cfg)
        links = PRESETS[preset].profile
        profile = HardwareProfile(cfg.name, 1.0 / slope_g, links.link_bandwidth, links.link_latency)
        measurements["a2a_fit"] = {
            "bandwidth": links.link_bandwidth,
            "intercept_s": links.link_latency,
            "method": f"NOT MEASURED (one rank has no link): preset {preset!r}",
        }
        measurements["links"] = {"preset": preset, "source": PRESETS[preset].source}
        measurements["not_measured"] = ["link_bandwidth", "link_latency", "replica_fixed_s"]
    fixed: dict[str, Any] = {"method": "not fitted (layer_tokens=()): 0.0"}
    if runs:
        from mixmoe.placement.cost_model import LayerShape
        from mixmoe.simulate.fixed_cost_fit import fit_fixed_costs

        shape = LayerShape(
            model_dim=cfg.model_dim,
            hidden_dim=cfg.hidden_size,
            experts_per_rank=cfg.experts,
            world_size=cfg.world_size,
            bytes_per_element=4 if cfg.device == "cpu" else 2,
        )
        profile, fixed = fit_fixed_costs(profile, runs, shape, cfg.processors)
    if not a2a:  # nothing replicated on one rank: the preset's figure, not measured
        replica = PRESETS[links_preset(cfg)].profile.replica_fixed_s
        profile = dataclasses.replace(profile, replica_fixed_s=replica)
        fixed["replica_fixed_s"] = replica
        fixed["method"] += (
            f"; replica_fixed_s NOT MEASURED (one rank): preset {links_preset(cfg)!r}"
        )
    measurements["fixed_costs"] = fixed
    return profile, measurements


def _fit_links(
    name: str, gemm_flops: float, a2a: list[dict[str, float]]
) -> tuple[HardwareProfile, dict[str, Any]]:
    """The profile with the link figures fitted to the all_to_all sweep, and the fit's record."""
    sent = [p["bytes_to_others"] for p in a2a]
    a2a_s = [p["s"] for p in a2a]
    lat, slope_a = fit_line(sent, a2a_s)
    a2a_method = "least-squares intercept and slope"
    if slope_a <= 0:  # noisy: latency = the fastest call, bandwidth from the largest size
        i = max(range(len(sent)), key=sent.__getitem__)
        lat = min(a2a_s)
        slope_a = max(a2a_s[i] - lat, a2a_s[i] / 2) / sent[i]
        a2a_method = "fallback: latency = fastest call, bandwidth at the largest size"
    lat_floor = min(a2a_s) / 2
    profile = HardwareProfile(name, gemm_flops, 1.0 / slope_a, max(lat, lat_floor))
    return profile, {
        "intercept_s": lat,
        "bandwidth": 1.0 / slope_a,
        "latency_floor_s": lat_floor,
        "method": a2a_method,
    }
