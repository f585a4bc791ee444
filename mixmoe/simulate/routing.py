"""Routing sources for the simulator: where the count matrices C [W, N] come from.

Legend: W ranks, N experts, T tokens per rank, K top-k.

- ``uniform``, ``zipf:S``, ``hot:P``: ``mixmoe.gating.synthetic.synthetic_counts`` (the planner
  benchmark's generator; expert popularity shuffled across owners unless ``contiguous``, which
  puts the hottest experts on rank 0 as ``bench layer``'s synthetic ids do);
- ``hotset:H:P``, ``hotrank:P``, ``idle:F``, ``rotate:H:P[:S]``: the imbalance workloads of
  ``mixmoe.gating.imbalance`` (``rotate``: S matrices, the hot set moving every step);
- ``counts:PATH``: the recorded matrices of a counts file (``mixmoe.formats.counts``, written by
  ``mixmoe bench layer --save-counts``); W and N must match the simulated shape.
- ``trace:PATH``: one matrix per count exchange recorded in the layer's traces (``mixmoe bench
  layer --trace DIR``, or any ``TraceRecorder`` run): PATH is a trace file holding every rank
  (a merged Chrome trace) or a directory of per-rank files
  (``mixmoe.formats.traces.trace_count_steps``); W is the number of ranks in the traces.
"""

from __future__ import annotations

import torch

from mixmoe.formats.counts import read_counts
from mixmoe.formats.traces import read_traces, trace_count_steps, trace_paths
from mixmoe.gating.imbalance import Workload, workload_counts
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts

__all__ = ["counts_source"]


def counts_source(
    source: str,
    world_size: int,
    num_experts: int,
    tokens: int,
    top_k: int,
    *,
    seed: int = 0,
    contiguous: bool = False,
) -> list[torch.Tensor]:
    """The count matrices (int64 [W, N], one per step) of ``source`` (see the module doc)."""
    if not isinstance(source, str):
        raise TypeError(f"routing must be a string, got {source!r}")
    if source.startswith(("counts:", "trace:")):
        kind, path = source.split(":", 1)
        if kind == "counts":
            steps = read_counts(path)["steps"]
        else:
            steps = trace_count_steps(read_traces(trace_paths(path)), where=f"trace {path!r}")
        W, N = len(steps[0]), len(steps[0][0])
        if (W, N) != (world_size, num_experts):
            raise ValueError(
                f"{kind} {path!r} holds W={W}, N={N} but the simulated layer has "
                f"W={world_size}, N={num_experts}; pass --world-size {W} and experts matching N"
            )
        return [torch.tensor(C, dtype=torch.int64) for C in steps]
    if source.split(":", 1)[0] in ("hotset", "hotrank", "idle", "rotate"):
        return workload_counts(
            Workload.parse(source), world_size, tokens, top_k, num_experts, seed=seed
        )
    try:
        spec = RoutingSpec.parse(source)
    except ValueError:
        raise ValueError(
            f"routing {source!r} is not understood; use uniform, zipf:S (S > 0), hot:P "
            "(0 <= P <= 1), hotset:H:P, hotrank:P, idle:F, rotate:H:P[:S] (imbalance "
            "workloads), counts:PATH (a file from `mixmoe bench layer --save-counts`) or "
            "trace:PATH (the traces of `mixmoe bench layer --trace DIR`)"
        ) from None
    if spec.kind == "gate":
        raise ValueError(
            "routing 'gate' needs a trained gate; record its counts with `mixmoe bench layer "
            "--routing gate --save-counts FILE` and simulate with --routing counts:FILE"
            " (or --trace DIR and --routing trace:DIR)"
        )
    gen = torch.Generator().manual_seed(seed)
    return [
        synthetic_counts(
            spec, world_size, tokens, top_k, num_experts, gen, shuffle_experts=not contiguous
        )
    ]
