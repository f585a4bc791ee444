"""Where the time goes in CMD traces: phase totals, host gaps, pipeline bubble, MoE communication,
per-call collective statistics and expert-load imbalance. Pure computations on ``CmdOp`` lists.

Definitions (per rank, times in ms):

- span: first op start to last op end (timed ops; short-form ops without a duration are counted
  in ``untimed_ops`` and otherwise ignored).
- phases: ``PHASE_OF`` maps op names to phases; unknown names go to ``other``. Pipeline
  send/recv: a send op and a recv op with identical duration and timestamp are one fused call
  (logged twice by the producer) and count once.
- host gaps: span minus the union of op intervals (time inside no op).
- pipeline bubble (1F1B): window = first start to last end of the data/forward/backward/p2p ops;
  measured bubble = (window - forward - backward) / window, ideal = (P-1)/(M+P-1) with
  M = distinct forward batch ids and P = warm-up forwards + stage_id + 1 (1F1B runs
  min(P - s - 1, M) warm-up forwards on stage s), unless given.
- MoE communication share: comm sub-operations inside forward (backward) ops over the phase total.
- collectives: grouped by (where, comm_func or op, group, shape, dtype); bytes = elements of the
  input x dtype size; GB/s = bytes / mean duration (algorithm bandwidth, 1e9 bytes).
- expert load: for all-to-alls with split sizes, rows received (sum out_splits) over rows sent
  (sum in_splits) on the dispatch; without splits (legacy traces), the rows of the second over the
  first all-to-all of each consecutive pair in a forward op. A factor > 1 means this rank's
  experts process more rows than a balanced share (assuming equal tokens per rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mixmoe.formats.cmd_trace import CmdOp, SubOp

__all__ = [
    "PHASES",
    "PHASE_OF",
    "CollectiveStats",
    "ExpertLoad",
    "PipelineBubble",
    "RankSummary",
    "dtype_bytes",
    "phase_of",
    "summarize_rank",
    "cross_rank_load_imbalance",
]

PHASES = (
    "data",
    "forward",
    "backward",
    "pipeline p2p",
    "dp allreduce",
    "ep-dp allreduce",
    "optimizer",
    "other",
)
FINALIZE_PHASES = ("dp allreduce", "ep-dp allreduce", "optimizer")
PHASE_OF: dict[str, str] = {
    "get_batch": "data",
    "forward_step": "forward",
    "backward_step": "backward",
    "dp_allreduce": "dp allreduce",
    "ep_dp_allreduce": "ep-dp allreduce",
    "optimizer_step": "optimizer",
}
_DTYPE_BYTES = {
    name: size
    for size, names in {
        8: ("float64", "double", "complex64", "int64", "long"),
        4: ("float32", "float", "int32", "int"),
        2: ("float16", "half", "bfloat16", "int16", "short"),
        1: ("int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"),
    }.items()
    for name in names
}


def phase_of(name: str) -> str:
    """The phase of a (canonical) op name; ``send_*``/``recv_*`` are ``pipeline p2p``."""
    if name.startswith(("send_", "recv_")):
        return "pipeline p2p"
    return PHASE_OF.get(name, "other")


def dtype_bytes(dtype: str | None) -> int | None:
    """Bytes per element of ``torch.X`` / ``X``; None if unknown."""
    if dtype is None:
        return None
    return _DTYPE_BYTES.get(dtype.removeprefix("torch."))


def _nbytes(shape: tuple[int, ...] | None, dtype: str | None) -> int | None:
    size = dtype_bytes(dtype)
    return None if shape is None or size is None else math.prod(shape) * size


@dataclass(frozen=True)
class CollectiveStats:
    """Per-call statistics of one kind of collective (see the module docstring)."""

    where: str
    op: str
    group: str | None
    shape: tuple[int, ...] | None
    dtype: str | None
    calls: int
    total_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    bytes_per_call: int | None

    @property
    def gbps(self) -> float | None:
        """Effective GB/s at the mean duration (None without bytes or with zero time)."""
        if self.bytes_per_call is None or self.mean_ms <= 0:
            return None
        return self.bytes_per_call / (self.mean_ms * 1e-3) / 1e9


@dataclass(frozen=True)
class PipelineBubble:
    stages: int
    microbatches: int
    window_ms: float
    forward_ms: float
    backward_ms: float
    p2p_ms: float
    data_ms: float

    @property
    def idle_ms(self) -> float:
        return self.window_ms - self.forward_ms - self.backward_ms

    @property
    def measured(self) -> float:
        return self.idle_ms / self.window_ms if self.window_ms > 0 else 0.0

    @property
    def ideal(self) -> float:
        return (self.stages - 1) / (self.microbatches + self.stages - 1)


@dataclass(frozen=True)
class ExpertLoad:
    """``source`` is ``"splits"`` (exact) or ``"shapes"`` (legacy pairing heuristic)."""

    source: str
    calls: int
    sent_rows: tuple[int, ...]
    received_rows: tuple[int, ...]
    destination_imbalance: float | None  # mean over calls of max(in_splits)/mean(in_splits)

    @property
    def load_factor(self) -> float:
        sent = sum(self.sent_rows)
        return sum(self.received_rows) / sent if sent else float("nan")


@dataclass(frozen=True)
class RankSummary:
    rank: int
    stage_id: int | None
    ops: int
    untimed_ops: int
    span_ms: float
    phase_ms: Mapping[str, float]
    fused_p2p_pairs: int
    gap_ms: float
    gaps: int
    largest_gap_ms: float
    bubble: PipelineBubble | None
    bubble_note: str | None
    moe_comm_ms: Mapping[str, float]  # "forward" / "backward" -> comm sub-op ms
    # (phase, label, kind) -> (calls, ms), in order of first appearance
    sub_op_ms: Mapping[tuple[str, str, str], tuple[int, float]]
    collectives: tuple[CollectiveStats, ...]
    load: ExpertLoad | None
    unknown_ops: tuple[str, ...]

    @property
    def finalize_ms(self) -> float:
        return sum(self.phase_ms.get(p, 0.0) for p in FINALIZE_PHASES)

    def moe_comm_share(self, phase: str) -> float | None:
        total = self.phase_ms.get(phase, 0.0)
        return self.moe_comm_ms.get(phase, 0.0) / total if total > 0 else None


def p2p_calls(ops: Sequence[CmdOp]) -> list[tuple[CmdOp, ...]]:
    """Timed pipeline send/recv ops as calls: a send and a recv with identical duration and
    timestamp form one fused call (a 2-tuple), every other op is a call of its own."""
    calls: list[tuple[CmdOp, ...]] = []
    open_sends: dict[tuple[float, float], int] = {}
    open_recvs: dict[tuple[float, float], int] = {}
    for op in ops:
        if phase_of(op.name) != "pipeline p2p" or not op.is_timed:
            continue
        key = (op.duration_ms, op.timestamp_ms)
        is_send = op.name.startswith("send_") and "_recv_" not in op.name
        is_recv = op.name.startswith("recv_")
        partner = open_recvs if is_send else open_sends if is_recv else None
        if partner is not None and key in partner:
            i = partner.pop(key)
            calls[i] = (*calls[i], op)
            continue
        calls.append((op,))
        if is_send:
            open_sends[key] = len(calls) - 1
        elif is_recv:
            open_recvs[key] = len(calls) - 1
    return calls


def _interval(op: CmdOp) -> tuple[float, float]:
    """(start, end) of a timed op."""
    assert op.duration_ms is not None and op.timestamp_ms is not None
    return op.timestamp_ms - op.duration_ms, op.timestamp_ms


def _gaps(intervals: list[tuple[float, float]]) -> list[float]:
    intervals.sort()
    gaps, end = [], intervals[0][1]
    for s, e in intervals[1:]:
        if s > end:
            gaps.append(s - end)
        end = max(end, e)
    return gaps


def _collectives(ops: Sequence[CmdOp], calls: list[tuple[CmdOp, ...]]) -> list[CollectiveStats]:
    groups: dict[tuple, list[float]] = {}
    for op in ops:
        phase = phase_of(op.name)
        for sub in op.sub_ops:
            if sub.is_comm and sub.duration_ms is not None:
                key = (phase, sub.comm_func or sub.label, sub.group, sub.shape, sub.dtype)
                groups.setdefault(key, []).append(sub.duration_ms)
        if phase in ("dp allreduce", "ep-dp allreduce") and op.duration_ms is not None:
            groups.setdefault((phase, op.name, op.group_kind, op.shape, op.dtype), []).append(
                op.duration_ms
            )
    for call in calls:
        head = call[0]
        key = (
            "pipeline p2p",
            "+".join(o.name for o in call),
            head.group_kind,
            head.shape,
            head.dtype,
        )
        groups.setdefault(key, []).append(head.duration_ms or 0.0)
    out = []
    for (where, name, group, shape, dtype), durations in groups.items():
        out.append(
            CollectiveStats(
                where,
                name,
                group,
                shape,
                dtype,
                len(durations),
                sum(durations),
                sum(durations) / len(durations),
                min(durations),
                max(durations),
                _nbytes(shape, dtype),
            )
        )
    return out


def _a2a_pairs(op: CmdOp) -> list[tuple[SubOp, SubOp | None]]:
    a2a = [s for s in op.sub_ops if s.comm_func == "all_to_all"]
    with_splits = [s for s in a2a if s.in_splits is not None and s.out_splits is not None]
    if with_splits:
        named = [s for s in with_splits if s.name and "dispatch" in s.name]
        return [(s, None) for s in (named or with_splits[0::2])]
    if len(a2a) % 2 or any(s.shape is None or not s.shape for s in a2a):
        return []
    return list(zip(a2a[0::2], a2a[1::2], strict=True))


def expert_load(ops: Sequence[CmdOp]) -> ExpertLoad | None:
    """This rank's expert load from its forward all-to-alls (module docstring), or None."""
    sent: list[int] = []
    received: list[int] = []
    imbalance: list[float] = []
    source = "shapes"
    for op in ops:
        if phase_of(op.name) != "forward":
            continue
        for first, second in _a2a_pairs(op):
            if second is None:
                assert first.in_splits is not None and first.out_splits is not None
                source = "splits"
                sent.append(sum(first.in_splits))
                received.append(sum(first.out_splits))
                mean = sum(first.in_splits) / max(len(first.in_splits), 1)
                if mean > 0:
                    imbalance.append(max(first.in_splits) / mean)
            else:
                assert first.shape and second.shape
                sent.append(first.shape[0])
                received.append(second.shape[0])
    if not sent:
        return None
    dest = sum(imbalance) / len(imbalance) if imbalance else None
    return ExpertLoad(source, len(sent), tuple(sent), tuple(received), dest)


def cross_rank_load_imbalance(summaries: Sequence[RankSummary]) -> float | None:
    """Mean over dispatch calls of max/mean rows received across ranks (needs >= 2 ranks with
    split sizes and the same number of calls), else None."""
    loads = [s.load for s in summaries if s.load is not None and s.load.source == "splits"]
    if len(loads) < 2 or len({ld.calls for ld in loads}) != 1:
        return None
    ratios = []
    for k in range(loads[0].calls):
        rows = [ld.received_rows[k] for ld in loads]
        mean = sum(rows) / len(rows)
        if mean > 0:
            ratios.append(max(rows) / mean)
    return sum(ratios) / len(ratios) if ratios else None


def _bubble(
    ops: Sequence[CmdOp], p2p_ms: float, stages: int | None, microbatches: int | None
) -> tuple[PipelineBubble | None, str | None]:
    fwd = [op for op in ops if op.name == "forward_step"]
    states = {op.mg_state for op in ops}
    if not {"warmup", "steady", "cooldown"} & states and stages is None:
        return None, "no 1F1B phases (mg_state warmup/steady/cooldown) and no --stages given"
    m = microbatches or len({op.batch_id for op in fwd})
    stage = next((op.stage_id for op in ops if op.stage_id is not None), 0)
    warmup = sum(1 for op in fwd if op.mg_state == "warmup")
    if stages is None:
        if warmup >= m:
            return None, f"all {m} forwards are warm-up: P cannot be inferred; pass --stages"
        stages = warmup + stage + 1
        if stages == 1:
            return None, "a single pipeline stage: no warm-up forwards on stage 0"
    pipe = [op for op in ops if op.is_timed and phase_of(op.name) not in FINALIZE_PHASES]
    pipe = [op for op in pipe if phase_of(op.name) != "other"]
    if not pipe or m < 1:
        return None, "no timed forward/backward ops"
    start = min(_interval(op)[0] for op in pipe)
    end = max(_interval(op)[1] for op in pipe)

    def total(phase: str) -> float:
        return sum(op.duration_ms or 0.0 for op in pipe if phase_of(op.name) == phase)

    bubble = PipelineBubble(
        stages, m, end - start, total("forward"), total("backward"), p2p_ms, total("data")
    )
    return bubble, None


def summarize_rank(
    ops: Sequence[CmdOp], *, stages: int | None = None, microbatches: int | None = None
) -> RankSummary:
    """Everything ``mixmoe analyze trace`` reports for one rank's ops (canonical names)."""
    if not ops:
        raise ValueError("no ops to summarize; pass a non-empty trace")
    timed = [op for op in ops if op.is_timed]
    if not timed:
        raise ValueError(f"rank {ops[0].rank}: no op has a duration and timestamp to analyse")
    intervals = [_interval(op) for op in timed]
    start = min(s for s, _ in intervals)
    end = max(e for _, e in intervals)
    calls = p2p_calls(ops)
    phase_ms = dict.fromkeys(PHASES, 0.0)
    for op in timed:
        if phase_of(op.name) != "pipeline p2p":
            phase_ms[phase_of(op.name)] += op.duration_ms or 0.0
    phase_ms["pipeline p2p"] = sum(call[0].duration_ms or 0.0 for call in calls)
    gaps = _gaps(list(intervals))
    comm: dict[str, float] = {}
    subs: dict[tuple[str, str, str], tuple[int, float]] = {}
    for op in timed:
        phase = phase_of(op.name)
        for sub in op.sub_ops:
            ms = sub.duration_ms or 0.0
            if sub.is_comm:
                comm[phase] = comm.get(phase, 0.0) + ms
            key = (phase, sub.label, "comm" if sub.is_comm else sub.kind or "compute")
            n, t = subs.get(key, (0, 0.0))
            subs[key] = (n + 1, t + ms)
    bubble, note = _bubble(ops, phase_ms["pipeline p2p"], stages, microbatches)
    unknown = sorted({op.name for op in ops if phase_of(op.name) == "other"})
    return RankSummary(
        rank=ops[0].rank,
        stage_id=next((op.stage_id for op in ops if op.stage_id is not None), None),
        ops=len(ops),
        untimed_ops=len(ops) - len(timed),
        span_ms=end - start,
        phase_ms=phase_ms,
        fused_p2p_pairs=sum(1 for c in calls if len(c) == 2),
        gap_ms=sum(gaps),
        gaps=len(gaps),
        largest_gap_ms=max(gaps, default=0.0),
        bubble=bubble,
        bubble_note=note,
        moe_comm_ms=comm,
        sub_op_ms=subs,
        collectives=tuple(_collectives(ops, calls)),
        load=expert_load(ops),
        unknown_ops=tuple(unknown),
    )
