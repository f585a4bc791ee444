"""The short runs of the real layer that ``mixmoe calibrate`` fits a ``HardwareProfile``'s fixed
costs to (``step_fixed_s``, ``row_overhead_s``, ``replica_fixed_s``), after the GEMM and all_to_all
sweeps of ``mixmoe.bench.calibrate``. This module measures; the fit is
``mixmoe.simulate.fixed_cost_fit``.

Legend: W ranks, E experts per rank, T tokens per rank, C = counts_WN (rows rank s routes to g).

Runs (every rank at once, ``bench layer``'s step: forward + backward + SGD step, the step time
the max over ranks, medians over ``repeats`` after ``warmup``; the runs interleaved step by step so
that a change of load on a shared machine reaches all of them), top-2, on the GEMM sweep's D, F,
E:

1. ``a2a`` under uniform routing at every T of ``layer_tokens``, and under ``hot:0.6`` at the
   largest T (no replica: the step is the base model plus ``step_fixed_s`` and ``row_overhead_s``
   at the slowest rank).
2. ``mix`` under ``hot:0.6`` at the largest T, planned with a compute-bound profile so that it
   replicates (up to the layer's ``max_replicas`` per rank; the plan is recomputed here from the
   run's counts, the planner being deterministic).

On one rank (W = 1, no process group: ``comm`` None) the runs are ``local`` under uniform routing
at every T of ``layer_tokens`` (nothing moves, nothing is replicated): they give
``step_fixed_s`` and the per-row figures; ``replica_fixed_s`` cannot be fitted there (0.0 from
the fit; ``mixmoe.bench.calibrate`` takes it from the link preset and says so).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from mixmoe.bench.timing import median
from mixmoe.comm import Communicator
from mixmoe.simulate.fixed_cost_fit import HOT, REPLICATE, TOP_K

__all__ = ["layer_runs"]


def layer_runs(comm: Communicator, cfg) -> list[dict[str, Any]]:
    """Every rank (``comm`` of W ranks, or None on one rank without a process group; ``cfg`` a
    ``CalibrateConfig``): the runs of the module doc, one record each (tokens, routing, strategy,
    step_s, replicas, counts_WN); the same on all ranks. The runs are interleaved step by step
    (one step of each, ``warmup + repeats`` times), so a change of load on a shared machine
    reaches them all alike."""
    from mixmoe.bench.layer import LayerBenchConfig, _inputs, build_layer
    from mixmoe.bench.timing import StageTimer
    from mixmoe.placement.profile_io import profile_record, save_profile

    W, rank = (1, 0) if comm is None else (comm.world_size, comm.rank)
    tokens = sorted(cfg.layer_tokens)
    if W == 1:
        runs = [(T, "uniform", "local") for T in tokens]
    else:
        runs = [(T, "uniform", "a2a") for T in tokens]
        runs += [(tokens[-1], HOT, s) for s in ("a2a", "mix")]
    dtype = "float32" if cfg.device == "cpu" else "bfloat16"
    device = torch.device(cfg.device)
    steps = []
    with tempfile.TemporaryDirectory(prefix="mixmoe-calibrate-") as tmp:
        forced = Path(tmp) / "replicate.json"
        save_profile(forced, profile_record(REPLICATE, source="calibrate's fit", measured=False))
        for T, routing, strategy in runs:
            bench = LayerBenchConfig(
                model_dim=cfg.model_dim,
                hidden_size=cfg.hidden_size,
                tokens=T,
                num_local_experts=cfg.experts,
                top_k=TOP_K,
                dtype=dtype,
                device=cfg.device,
                routing=routing,
                strategies=(strategy,),
                world_size=W,
                profile=str(forced),
            )
            x_TD, dy_TD, ids_TK = _inputs(bench, rank)
            layer = build_layer(bench, strategy, ids_TK, comm)
            with torch.no_grad():
                counts_N = layer(x_TD)[1].counts_N.to(torch.int64)
            if comm is None:
                counts_WN = [counts_N.cpu().tolist()]
            else:
                counts_WN = comm.all_gather_rows(counts_N).cpu().tolist()
            opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
            steps.append((layer, opt, x_TD, dy_TD, counts_WN))
    times = torch.zeros(len(runs), cfg.warmup + cfg.repeats, dtype=torch.float64)
    replicas = [0] * len(runs)
    for i in range(cfg.warmup + cfg.repeats):
        for j, (layer, opt, x_TD, dy_TD, _) in enumerate(steps):
            if comm is not None:
                comm.barrier()
            timer = StageTimer(device)
            timer.mark()
            y_TD, aux = layer(x_TD)
            torch.autograd.backward([y_TD, aux.loss], [dy_TD, torch.ones_like(aux.loss)])
            opt.step()
            opt.zero_grad(set_to_none=True)
            timer.mark()
            times[j, i] = timer.elapsed_ms()[0] / 1e3
            replicas[j] = int((aux.stats or {}).get("replicas", 0))
    if comm is not None:  # a step takes as long as its slowest rank
        times = comm.all_reduce_max(times.to(device)).cpu()
    return [
        {
            "tokens": T,
            "routing": routing,
            "strategy": strategy,
            "step_s": median(times[j, cfg.warmup :].tolist()),
            "replicas": replicas[j],
            "counts_WN": steps[j][4],
        }
        for j, (T, routing, strategy) in enumerate(runs)
    ]
