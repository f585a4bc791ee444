"""The measured half of the simulator's validation (``mixmoe simulate --validate FILE
--remeasure``): per case, calibrate this machine on the case's ranks, run ``bench layer`` and
append one record per (case, strategy); ``mixmoe.simulate.agreement`` says what is recorded and
compares the records with the simulator's predictions."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mixmoe.simulate.agreement import DEFAULT_CASES, KIND, MIX_PLANNER, ValidationCase

__all__ = ["measure"]


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _one_thread(fn, cfg):
    """``fn(cfg)`` on CPU with one torch thread (as every spawned rank runs; the count is
    restored after); on another device as is."""
    import torch

    if cfg.device != "cpu":
        return fn(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(cfg)
    finally:
        torch.set_num_threads(threads)


def measure(
    out_path: str | os.PathLike[str],
    cases: Iterable[ValidationCase] = DEFAULT_CASES,
    *,
    steps: int = 8,
    warmup: int = 3,
    calibrate_repeats: int = 8,
    processors: int | None = None,
    log=print,
) -> Path:
    """Calibrate per W, then run every case; appends records to ``out_path`` (see module doc).
    ``processors``: the cores the ranks share, given to the calibration's fixed-cost fit."""
    from mixmoe.bench.calibrate import CalibrateConfig, calibrate
    from mixmoe.bench.layer import LayerBenchConfig, run_rank
    from mixmoe.bench.multiprocess import run_distributed
    from mixmoe.bench.timing import median
    from mixmoe.placement.profile_io import profile_record, save_profile

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mixmoe-validate-") as tmp:
        for i, case in enumerate(cases):
            # calibrate right before the case, on its W ranks and its D, F: the machine is shared,
            # so the profile must describe the load the benchmark is about to run under
            cal = CalibrateConfig(
                model_dim=case.model_dim,
                hidden_size=case.hidden_size,
                experts=case.experts_per_rank,
                rows=(64, 256, 1024),
                world_size=case.world_size,
                repeats=calibrate_repeats,
                warmup=2,
                device=case.device,
                processors=processors,
                name=f"calibrated-{'gloo' if case.device == 'cpu' else case.device}-w"
                f"{case.world_size}",
            )
            cal_uptime = _uptime()
            profile, cal_m = _one_thread(calibrate, cal) if case.world_size == 1 else calibrate(cal)
            path = os.path.join(tmp, f"case{i}.json")
            save_profile(path, profile_record(profile, source=cal_uptime, measured=True))
            bench = LayerBenchConfig(
                model_dim=case.model_dim,
                hidden_size=case.hidden_size,
                tokens=case.tokens,
                num_local_experts=case.experts_per_rank,
                top_k=case.top_k,
                steps=steps,
                warmup=warmup,
                routing=case.routing,
                strategies=case.strategies,
                world_size=case.world_size,
                threads=1,
                profile=path,
                device=case.device,
                dtype=case.dtype,
            )
            before = _uptime()
            if case.world_size == 1:  # in this process, as `bench layer --world-size 1`
                results = _one_thread(run_rank, bench)
            else:
                results = run_distributed(bench)
            after = _uptime()
            m = slice(warmup, None)
            with open(out, "a") as f:
                for r in results:
                    rec = {
                        "kind": KIND,
                        "case": asdict(case),
                        "strategy": r.strategy,
                        "step_ms": median(r.step_ms[m]),
                        "fwd_ms": median(r.fwd_ms[m]),
                        "bwd_ms": median(r.bwd_ms[m]),
                        "step_ms_all": r.step_ms,
                        "warmup": warmup,
                        "replicas": int(r.stats.get("replicas", 0)),
                        "counts_WN": r.counts_WN,
                        "profile": asdict(profile),
                        # the fit's inputs: compare re-fits them under --processors offline
                        "calibration": _fit_inputs(cal_m["fixed_costs"]),
                        "uptime_calibrate": cal_uptime,
                        "uptime_before": before,
                        "uptime_after": after,
                        "command": "mixmoe simulate --validate FILE --remeasure",
                        "mix_planner": MIX_PLANNER,  # compare replays mix with plan_mix
                    }
                    f.write(json.dumps(rec) + "\n")
            log(
                f"{case.label()} ({profile.gemm_flops / 1e9:.1f} GFLOP/s, "
                f"{profile.link_bandwidth / 1e9:.2f} GB/s, {profile.link_latency * 1e6:.0f} us): "
                + ", ".join(f"{r.strategy} {median(r.step_ms[m]):.1f} ms" for r in results)
                + f" | {after}"
            )
    return out


def _fit_inputs(fixed: dict[str, Any]) -> dict[str, Any] | None:
    """What ``fit_fixed_costs`` needs to be redone: the base profile, the layer runs (with their
    counts) and the aggregation they were fitted under (None when the fit was skipped)."""
    if "runs" not in fixed:
        return None
    keep = ("tokens", "routing", "strategy", "step_s", "replicas", "counts_WN")
    return {
        "base_profile": fixed["base_profile"],
        "processors": fixed["processors"],
        "runs": [{k: r[k] for k in keep} for r in fixed["runs"]],
    }
