"""Chrome / Perfetto trace JSON (FORMATS.md section 5) from CMD records of one or more ranks.

Layout: one ``pid`` per rank (named ``rank R (stage S)``), one ``tid`` per role:
``0`` top-level ops, ``1`` compute/host sub-operations, ``2`` communication sub-operations.
Every op and sub-op is a complete event (``ph: "X"``) with ``ts``/``dur`` in microseconds on the
recorder's host-monotonic clock; ``args`` keep the CMD fields (``op_index`` ties a sub-op to its
op, so ``mixmoe.report.chrome_trace`` can load the file back). Untimed ops (short-form lines
with ``duration=None``) have no place on a timeline and are left out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from mixmoe.tracing.cmd_format import CmdOp, SubOp, read_cmd_file

if TYPE_CHECKING:  # pragma: no cover
    from mixmoe.tracing.recorder import TraceRecorder

__all__ = ["TID_OPS", "TID_COMPUTE", "TID_COMM", "chrome_trace_events", "write_chrome_trace"]

TID_OPS, TID_COMPUTE, TID_COMM = 0, 1, 2
_TID_NAMES = {TID_OPS: "ops", TID_COMPUTE: "sub-ops: compute", TID_COMM: "sub-ops: comm"}


def _us(ms: float) -> float:
    return round(ms * 1e3, 3)


def _shape(x: tuple[int, ...] | None) -> list[int] | None:
    return None if x is None else list(x)


def _sub_args(sub: SubOp, op_index: int) -> dict[str, Any]:
    args: dict[str, Any] = {"op_index": op_index, "name": sub.name, "kind": sub.kind}
    args["comm_func"] = sub.comm_func
    args.update(group=sub.group, shape=_shape(sub.shape), dtype=sub.dtype)
    args.update(in_splits=_shape(sub.in_splits), out_splits=_shape(sub.out_splits))
    args["extra"] = dict(sub.extra)
    return args


def chrome_trace_events(ops: Iterable[CmdOp]) -> list[dict[str, Any]]:
    """Trace events (metadata first) for ``ops`` of any ranks; see the module docstring."""
    by_rank: dict[int, list[CmdOp]] = {}
    for op in ops:
        by_rank.setdefault(op.rank, []).append(op)
    events: list[dict[str, Any]] = []
    for rank in sorted(by_rank):
        stages = {op.stage_id for op in by_rank[rank] if op.stage_id is not None}
        label = f"rank {rank}" + (f" (stage {min(stages)})" if len(stages) == 1 else "")
        events.append(_meta("process_name", rank, 0, label))
        events.append(_meta("process_sort_index", rank, 0, rank, key="sort_index"))
        for tid, name in _TID_NAMES.items():
            events.append(_meta("thread_name", rank, tid, name))
    for rank in sorted(by_rank):
        for index, op in enumerate(by_rank[rank]):
            if not op.is_timed:
                continue
            assert op.start_ms is not None and op.duration_ms is not None
            args = {"op_index": index, "stage_id": op.stage_id, "batch_id": op.batch_id}
            args.update(mg_state=op.mg_state, description=op.description)
            args.update(group_kind=op.group_kind, shape=_shape(op.shape), dtype=op.dtype)
            args["extra"] = dict(op.extra)
            events.append(_complete(op.name, "mixmoe.op", rank, TID_OPS, op.start_ms, op, args))
            for sub in op.sub_ops:
                if sub.start_ms is None:
                    continue
                tid = TID_COMM if sub.is_comm else TID_COMPUTE
                args = _sub_args(sub, index)
                events.append(
                    _complete(sub.label, "mixmoe.sub", rank, tid, sub.start_ms, sub, args)
                )
    return events


def _meta(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _complete(
    name: str, cat: str, pid: int, tid: int, start_ms: float, timed: Any, args: dict[str, Any]
) -> dict[str, Any]:
    event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid}
    event.update(ts=_us(start_ms), dur=_us(timed.duration_ms), args=args)
    return event


Source = Union[str, os.PathLike[str], "TraceRecorder", Sequence[CmdOp]]


def _load(source: Source) -> list[CmdOp]:
    if isinstance(source, str | os.PathLike):
        return read_cmd_file(source)
    if hasattr(source, "records"):  # a TraceRecorder
        return list(source.records())
    ops = list(source)
    if not all(isinstance(op, CmdOp) for op in ops):
        raise ValueError(
            "write_chrome_trace sources must be CMD file paths, TraceRecorders or lists of CmdOp"
        )
    return ops


def write_chrome_trace(
    paths_or_records: Sequence[Source] | str | os.PathLike[str], out_path: str | os.PathLike[str]
) -> Path:
    """Merge ranks into one Chrome trace JSON at ``out_path``; returns the path.

    ``paths_or_records``: CMD file paths (one per rank), ``TraceRecorder`` objects or lists of
    ``CmdOp`` (mixed freely; a single path is accepted too). Raises ValueError if two sources
    hold the same rank.
    """
    sources = (
        [paths_or_records]
        if isinstance(paths_or_records, str | os.PathLike)
        else list(paths_or_records)
    )
    ops: list[CmdOp] = []
    seen: dict[int, int] = {}
    for i, source in enumerate(sources):
        loaded = _load(source)
        for rank in {op.rank for op in loaded}:
            if rank in seen:
                raise ValueError(
                    f"rank {rank} appears in sources {seen[rank]} and {i}; pass each rank once"
                )
            seen[rank] = i
        ops.extend(loaded)
    out = Path(out_path)
    doc = {"traceEvents": chrome_trace_events(ops), "displayTimeUnit": "ms"}
    out.write_text(json.dumps(doc), encoding="utf-8")
    return out
