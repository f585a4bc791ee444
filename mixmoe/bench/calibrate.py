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
2. The links (``mixmoe.bench.calibrate_links``). ``all_to_all_single`` on W ranks (gloo over
   ``spawn_gloo`` on CPU, NCCL on GPU when launched by torchrun: the same code), each rank
   sending S bytes for a sweep of S; a point is the slowest rank's time, its median over repeats.
   Without ``ranks_per_node`` (or with one node, or one rank per node) one sweep to every rank:
   ``link_latency`` and ``link_bandwidth`` are the intercept and 1 / slope of a least-squares
   line of seconds against the bytes a rank sends to others (the cost model's ``latency + bytes
   / bandwidth``; ``fit_link``: the intercept floored at the smallest time / 2, a fallback when
   too noisy for a positive slope). With R ranks per node (2 <= R < W, R dividing W) two sweeps
   fitted the same way: inside the nodes (``link_*``, the intra-node link) and across them
   (``inter_node_bandwidth`` / ``inter_node_latency``); the profile gets the topology
   (``ranks_per_node`` R). ``measurements`` records the sweeps, the fits and their methods, and
   ``measurements["topology"]`` what was measured and why.
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

from mixmoe.bench.calibrate_links import (
    check_ranks_per_node,
    fit_line,
    link_sweeps,
    links_profile,
    sweep_links,
)
from mixmoe.bench.timing import median
from mixmoe.comm import Communicator
from mixmoe.placement.profile import HardwareProfile
from mixmoe.placement.profile_io import PRESETS
from mixmoe.validation import check_device, check_int, check_str

__all__ = [
    "CalibrateConfig",
    "calibrate",
    "fit_line",
    "links_preset",
    "measure_gemm",
    "measure_links",
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
    the fixed costs then fitted under the simulator's processor-sharing aggregation;
    ranks_per_node: R ranks per node (rank r on node r // R): with 2 <= R < world_size the
    intra-node and inter-node links are measured apart and the profile gets the topology; None
    (default), R >= world_size (one node) or R == 1 (every pair across nodes): one link.
    ``ValueError`` when R does not divide world_size or world_size is 1."""

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
    ranks_per_node: int | None = None

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
        check_str("name", self.name)
        check_str("links", self.links)
        check_device(self.device)
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
        check_ranks_per_node(self.world_size, self.ranks_per_node)


def links_preset(cfg: CalibrateConfig) -> str:
    """The preset whose link figures a one-rank calibration takes: ``cfg.links``, else ``gpu``
    on CUDA and ``cpu`` on CPU."""
    if cfg.links:
        return cfg.links
    return "cpu" if torch.device(cfg.device).type == "cpu" else "gpu"


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
) -> tuple[list[dict], dict[str, list[dict]], list[dict]]:
    """Every rank at once: the expert MLP sweep (each rank's times all-reduced to the slowest:
    the per-rank rate while W ranks share the machine, as in a W-rank benchmark), the link
    sweeps ({sweep name: points}, ``mixmoe.bench.calibrate_links``), then the layer runs of the
    fixed-cost fit; every rank returns the same figures. ``comm`` None: one rank without a
    process group (no link sweep: {})."""
    gemm = measure_gemm(cfg)
    if comm is None:
        links: dict[str, list[dict]] = {}
    else:
        device = torch.device(cfg.device)
        times = torch.tensor([[p["fwd_s"], p["bwd_s"]] for p in gemm], dtype=torch.float64)
        slowest = comm.all_reduce_max(times.to(device)).cpu().tolist()
        for p, (f, b) in zip(gemm, slowest, strict=True):
            p.update(fwd_s=f, bwd_s=b, fwd_flops=p["flops_fwd_bwd"] / 3 / f)
            p["bwd_flops"] = p["flops_fwd_bwd"] * 2 / 3 / b
        links = _link_rank(comm, cfg)
    if not cfg.layer_tokens:
        return gemm, links, []
    from mixmoe.bench.calibrate_layer import layer_runs

    return gemm, links, layer_runs(comm, cfg)


def _link_rank(comm: Communicator, cfg: CalibrateConfig) -> dict[str, list[dict]]:
    """Every rank: the link sweeps ``link_sweeps`` names for this W and R, in order."""
    sweeps, _ = link_sweeps(comm.world_size, cfg.ranks_per_node)
    return sweep_links(comm, cfg, sweeps, cfg.ranks_per_node)


def measure_ranks(
    cfg: CalibrateConfig, comm: Communicator | None = None
) -> tuple[list[dict], dict[str, list[dict]], list[dict]]:
    """(expert MLP sweep, link sweeps by name, layer runs) measured on ``comm`` (torchrun's group)
    or on W spawned gloo ranks (CPU), all ranks at once; on one rank (``cfg.world_size`` 1) in
    this process on ``cfg.device``, without a process group (no link sweep)."""
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


def measure_links(
    cfg: CalibrateConfig, comm: Communicator | None = None
) -> dict[str, list[dict[str, float]]]:
    """The link sweeps alone, {sweep name: points} (see ``measure_ranks``)."""
    if comm is not None:
        return _link_rank(comm, cfg)
    from mixmoe.comm.launch import spawn_gloo

    return spawn_gloo(_link_rank, cfg.world_size, cfg, threads=cfg.threads, timeout_s=600)[0]


def calibrate(
    cfg: CalibrateConfig, comm: Communicator | None = None
) -> tuple[HardwareProfile, dict[str, Any]]:
    """(the measured profile, the raw measurements and the fits)."""
    gemm, sweeps, runs = measure_ranks(cfg, comm)
    flops = [p["flops_fwd_bwd"] for p in gemm]
    secs = [p["fwd_s"] + p["bwd_s"] for p in gemm]
    icpt_g, slope_g = fit_line(flops, secs)
    gemm_method = "least-squares slope"
    if slope_g <= 0:  # a noisy machine: fall back to the mean rate over the sweep
        slope_g, gemm_method = sum(secs) / sum(flops), "mean rate (the fit's slope was <= 0)"
    measurements: dict[str, Any] = {
        "gemm": gemm,
        "gemm_fit": {"intercept_s": icpt_g, "flops": 1.0 / slope_g, "method": gemm_method},
    }
    one_rank = not sweeps
    if not one_rank:
        W = cfg.world_size
        profile, fits = links_profile(cfg.name, 1.0 / slope_g, sweeps, W, cfg.ranks_per_node)
        measurements.update(fits)
    else:  # one rank: no link to measure; the preset's figures, said so
        preset = links_preset(cfg)
        links = PRESETS[preset].profile
        profile = HardwareProfile(cfg.name, 1.0 / slope_g, links.link_bandwidth, links.link_latency)
        measurements["all_to_all"] = []
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
    if one_rank:  # nothing replicated on one rank: the preset's figure, not measured
        replica = PRESETS[links_preset(cfg)].profile.replica_fixed_s
        profile = dataclasses.replace(profile, replica_fixed_s=replica)
        fixed["replica_fixed_s"] = replica
        fixed["method"] += (
            f"; replica_fixed_s NOT MEASURED (one rank): preset {links_preset(cfg)!r}"
        )
    measurements["fixed_costs"] = fixed
    return profile, measurements
