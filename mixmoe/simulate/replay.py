"""Replay of a CMD trace (docs/formats.md section 3) under another hardware profile or strategy.

Legend: W ranks in the expert-parallel group, N experts, C a count matrix [W, N].

``replay_trace`` (another *profile*): every operation of one rank's trace keeps its measured
duration, except the MoE token all-to-alls inside it (sub-operations with
``comm_func=all_to_all`` and ``group=exp``): each is re-predicted as the cost model prices a
collective, ``link_latency + bytes sent to other ranks / link_bandwidth``, with the bytes from the
sub-operation's shape and dtype (the buffer this rank sends, split evenly over the ``ep_size``
ranks of the group, ``(ep_size - 1) / ep_size`` of it leaving the rank) or from its ``in_splits``
when the trace has them (the rank's own split taken at its rank modulo the group size). The
replayed iteration is the measured one (first start to last end on the rank) plus the sum of the
changes: the all-to-alls are assumed to sit on the rank's critical path, as they do in a
synchronous expert-parallel step.

``replay_strategies`` (another *strategy*, a2a / shadow / mix, under a profile): needs the count
matrix of every MoE layer step (one forward + backward of one layer), which a CMD trace of
another producer does not carry: from the traces' own count exchanges (``trace:PATH``) or a
counts file given beside the trace (``counts:FILE``; ``mixmoe.simulate.routing``). A layer step
of the replayed rank is one MoE count exchange in its trace (a sub-operation with
``comm_func=allgather`` and ``group=exp``), in order; the i-th is paired with the i-th count
matrix, or every one with the single matrix of a one-step source. For each strategy S and layer
step, the planner S runs on C (``mixmoe.simulate.layer.predict_layer``: the planners' cost
model, nothing re-derived) and the rank's MoE collective time is predicted as

    collective[r] = step_S - compute_S[r]
                  = exposed_S[r]  (token all-to-alls after S's overlap + replica transfer)
                  + wait_S[r]     (step_S - compute_S[r] - exposed_S[r]: waiting for the slowest
                                   rank, which a synchronous all-to-all measures too)

with r = the replayed rank modulo W (its rank in the group). The replayed iteration is the
measured one minus every measured MoE all-to-all of the rank (token and replica exchanges, forward
and backward) plus the sum of collective[r] over the layer steps. Assumed, and printed with the
result:

- everything else is kept as measured: the rank's expert compute stays what the traced strategy
  ran (rows that S would move to another rank or bring here are not re-timed; the cost model's
  compute_S only sets the wait), and so do the count exchange, the gate, the dense layers, the
  pipeline sends and the optimizer;
- the trace's MoE all-to-alls are all of the layer's collectives: 4 token all-to-alls per layer
  step (dispatch and return, forward and backward, as the cost model prices them) plus the
  replica exchanges (fetch and gradient return). mixmoe's layer records every one that runs,
  the backward ones as ``NAME.backward`` spans inside ``backward_step`` (``mixmoe.comm.autograd``;
  docs/formats.md section 3); all of them are subtracted. A trace with fewer token all-to-alls
  gets the missing ones predicted anyway, and the result says how many it found
  (``token_calls``, ``token_calls_note``): either they did not run (a layer whose input needs
  no gradient, as in ``bench layer``, never runs the dispatch's backward) or the trace does not
  record them (another producer, or a mixmoe trace written before the backward exchanges were
  recorded: then they are also kept inside the measured ops, so counted twice);
- an asynchronous exchange (``mix``'s token all-to-alls, forward and backward) is recorded by its
  launch; the wait for it is spent in the ops around it and kept as measured.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from mixmoe.formats.cmd_trace import CmdOp, SubOp, read_cmd_trace
from mixmoe.placement.cost_model import TOKEN_COLLECTIVES, LayerShape
from mixmoe.placement.profile import HardwareProfile
from mixmoe.simulate.layer import STRATEGIES, predict_layer

__all__ = [
    "Replay",
    "StrategyReplay",
    "replay_strategies",
    "replay_trace",
    "token_calls_note",
]

_DTYPE_BYTES = {
    "torch.float32": 4,
    "torch.float": 4,
    "torch.float16": 2,
    "torch.half": 2,
    "torch.bfloat16": 2,
    "torch.int64": 8,
    "torch.int32": 4,
    "torch.float64": 8,
}


@dataclass(frozen=True)
class Replay:
    """Milliseconds: the measured iteration, its MoE all-to-alls measured and re-predicted, the
    replayed iteration; ``a2a_calls`` all-to-alls replayed, ``skipped`` those without a shape."""

    iteration_ms: float
    a2a_measured_ms: float
    a2a_predicted_ms: float
    replayed_ms: float
    a2a_calls: int
    skipped: int


def _rank_ops(path: str | os.PathLike[str], rank: int | None) -> tuple[int, list[CmdOp], float]:
    """(rank, its ops, its measured iteration in ms: first start to last end)."""
    ops = read_cmd_trace(path)
    rank = ops[0].rank if rank is None else rank
    ops = [op for op in ops if op.rank == rank]
    if not ops:
        raise ValueError(f"{os.fspath(path)}: no operation of rank {rank}")
    spans = [
        (op.timestamp_ms - op.duration_ms, op.timestamp_ms)
        for op in ops
        if op.timestamp_ms is not None and op.duration_ms is not None
    ]
    if not spans:
        raise ValueError(f"{os.fspath(path)}: no operation with a duration and a timestamp")
    return rank, ops, max(e for _, e in spans) - min(s for s, _ in spans)


def _moe_all_to_all(sub: SubOp) -> bool:
    return sub.comm_func == "all_to_all" and sub.group == "exp" and sub.duration_ms is not None


def replay_trace(
    path: str | os.PathLike[str], profile: HardwareProfile, ep_size: int, rank: int | None = None
) -> Replay:
    """Replay the ops of ``rank`` (default: the first rank in the file) under ``profile``."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 2:
        raise ValueError(
            f"ep_size must be an int >= 2 (the expert-parallel group), got {ep_size!r}"
        )
    rank, ops, iteration = _rank_ops(path, rank)
    measured = predicted = 0.0
    calls = skipped = 0
    for op in ops:
        for sub in op.sub_ops:
            if not _moe_all_to_all(sub):
                continue
            elem = _DTYPE_BYTES.get(sub.dtype or "")
            if sub.in_splits is not None and sub.shape and elem:
                row = math.prod(sub.shape[1:]) * elem
                own = sub.in_splits[rank % len(sub.in_splits)]  # rows that stay on this rank
                sent = (sum(sub.in_splits) - own) * row
            elif sub.shape and elem:
                sent = math.prod(sub.shape) * elem * (ep_size - 1) / ep_size
            else:
                skipped += 1
                continue
            measured += sub.duration_ms
            predicted += (profile.link_latency + sent / profile.link_bandwidth) * 1e3
            calls += 1
    return Replay(
        iteration_ms=iteration,
        a2a_measured_ms=measured,
        a2a_predicted_ms=predicted,
        replayed_ms=iteration - measured + predicted,
        a2a_calls=calls,
        skipped=skipped,
    )


@dataclass(frozen=True)
class StrategyReplay:
    """One strategy's replay of one rank (milliseconds; module doc).

    layer_steps: MoE count exchanges of the rank (each one layer step); a2a_calls: its measured
    MoE all-to-alls (token and replica, forward and backward), a2a_measured_ms their sum;
    token_calls: those of them that are token exchanges (not ``moe.replica_fetch`` or its
    ``.backward``; the model prices 4 per layer step);
    collective_ms: the predicted MoE collective time summed over the layer steps, wait_ms the
    part of it spent waiting for the slowest rank; replicas: replica copies the planner chose,
    summed over the layer steps; replayed_ms = iteration_ms - a2a_measured_ms + collective_ms."""

    strategy: str
    rank: int
    iteration_ms: float
    layer_steps: int
    a2a_calls: int
    token_calls: int
    a2a_measured_ms: float
    collective_ms: float
    wait_ms: float
    replicas: int
    replayed_ms: float


def replay_strategies(
    path: str | os.PathLike[str],
    counts: Sequence[object],
    shape: LayerShape,
    profile: HardwareProfile,
    *,
    top_k: int,
    max_replicas: int = 4,
    strategies: Sequence[str] = STRATEGIES,
    rank: int | None = None,
) -> list[StrategyReplay]:
    """Replay ``rank``'s ops (default: the file's first rank) with its MoE communication
    re-predicted under each of ``strategies`` (module doc). ``counts``: the count matrices
    ([W, N] each, W and N those of ``shape``), one per layer step of the rank or a single one
    for every layer step."""
    rank, ops, iteration = _rank_ops(path, rank)
    subs = [sub for op in ops for sub in op.sub_ops]
    layer_steps = sum(s.comm_func == "allgather" and s.group == "exp" for s in subs)
    if layer_steps == 0:
        raise ValueError(
            f"{os.fspath(path)}: rank {rank} has no MoE count exchange (a sub-operation with "
            "comm_func=allgather, group=exp), so its layer steps are unknown; replay this trace "
            "under another profile only (drop --replay-strategy)"
        )
    if len(counts) not in (1, layer_steps):
        raise ValueError(
            f"{os.fspath(path)}: rank {rank} ran {layer_steps} MoE layer steps but the routing "
            f"source holds {len(counts)} count matrices; give one matrix per layer step (the "
            "traces of the same run: --routing trace:PATH) or a single one for all of them"
        )
    a2a = [s for s in subs if _moe_all_to_all(s)]
    measured = sum(s.duration_ms for s in a2a)  # type: ignore[misc]
    token_calls = sum(not s.name.startswith("moe.replica_fetch") for s in a2a)
    r = rank % shape.world_size
    preds = [
        predict_layer(
            C, shape, profile, top_k=top_k, max_replicas=max_replicas, strategies=tuple(strategies)
        )
        for C in counts
    ]
    out = []
    for name in strategies:
        collective = wait = 0.0
        replicas = 0
        for i in range(layer_steps):
            p = preds[i if len(preds) > 1 else 0][name]
            collective += p.step_s - p.compute_W[r]
            wait += p.step_s - p.compute_W[r] - p.exposed_W[r]
            replicas += p.replicas
        out.append(
            StrategyReplay(
                strategy=name,
                rank=rank,
                iteration_ms=iteration,
                layer_steps=layer_steps,
                a2a_calls=len(a2a),
                token_calls=token_calls,
                a2a_measured_ms=measured,
                collective_ms=collective * 1e3,
                wait_ms=wait * 1e3,
                replicas=replicas,
                replayed_ms=iteration - measured + collective * 1e3,
            )
        )
    return out


def token_calls_note(r: StrategyReplay) -> str:
    """A line saying when the trace holds fewer token all-to-alls than the model prices."""
    want = TOKEN_COLLECTIVES * r.layer_steps
    if r.token_calls == want:
        return ""
    if r.token_calls > want:
        return (
            f"note: rank {r.rank}'s trace holds {r.token_calls} MoE token all-to-alls for "
            f"{r.layer_steps} layer steps, more than the {TOKEN_COLLECTIVES} per layer step the "
            "cost model prices; all of them are replaced"
        )
    return (
        f"note: rank {r.rank}'s trace holds {r.token_calls} MoE token all-to-alls for "
        f"{r.layer_steps} layer steps; the cost model prices {TOKEN_COLLECTIVES} per layer step "
        "(dispatch and return, forward and backward) and predicts them all. mixmoe's layer "
        "records every exchange that runs (backward ones as NAME.backward): fewer means some did "
        "not run (an input that needs no gradient skips the dispatch's backward, as in bench "
        "layer: the prediction includes one the run did not make), or, in a trace of another "
        "producer or an older mixmoe, that they ran unrecorded: kept inside the measured ops AND "
        "predicted, counted twice"
    )
