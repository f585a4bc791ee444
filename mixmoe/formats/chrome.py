"""Chrome / Perfetto trace JSON (docs/formats.md section 5): writer and reader of mixmoe's traces.

Layout: one ``pid`` per rank (named ``rank R (stage S)``), one ``tid`` per role:
``0`` top-level ops, ``1`` compute sub-operations, ``2`` communication sub-operations, ``3`` host
sub-operations (span kind ``host``: e.g. the plan, which may run on a background thread while
the compute track is busy).
Every op and sub-op is a complete event (``ph: "X"``) with ``ts``/``dur`` in microseconds on the
recorder's host-monotonic clock; ``args`` keep the CMD fields (``op_index`` ties a sub-op to its
op, so ``read_chrome_trace`` can load the file back). Untimed ops (short-form lines with
``duration=None``) have no place on a timeline and are left out.

The reader rebuilds the ``CmdOp`` records of every rank from the complete events of category
``mixmoe.op`` and ``mixmoe.sub``: ``pid`` -> rank, ``ts``/``dur`` (microseconds) -> start and
duration in ms, ``args.op_index`` -> the op a sub-operation belongs to. Other events (metadata,
torch.profiler events merged into the same file) are ignored. Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from mixmoe.formats.cmd_trace import CmdOp, SubOp, read_cmd_file


class HasRecords(Protocol):
    """Anything with ``records() -> list[CmdOp]``, e.g. ``mixmoe.tracing.TraceRecorder``."""

    def records(self) -> list[CmdOp]: ...


__all__ = [
    "TID_COMM",
    "TID_COMPUTE",
    "TID_HOST",
    "TID_OPS",
    "chrome_trace_events",
    "read_chrome_trace",
    "write_chrome_trace",
]

TID_OPS, TID_COMPUTE, TID_COMM, TID_HOST = 0, 1, 2, 3
_TID_NAMES = {
    TID_OPS: "ops",
    TID_COMPUTE: "sub-ops: compute",
    TID_COMM: "sub-ops: comm",
    TID_HOST: "sub-ops: host",
}


def _us(ms: float) -> float:
    return round(ms * 1e3, 3)


def _shape(x: tuple[int, ...] | None) -> list[int] | None:
    return None if x is None else list(x)


def _sub_args(sub: SubOp, op_index: int) -> dict[str, Any]:
    args: dict[str, Any] = {"op_index": op_index, "name": sub.name, "kind": sub.kind}
    args["comm_func"] = sub.comm_func
    args.update(group=sub.group, shape=_shape(sub.shape), dtype=sub.dtype)
    args.update(in_splits=_shape(sub.in_splits), out_splits=_shape(sub.out_splits))
    if sub.counts is not None:  # the count exchange only; absent elsewhere (older files too)
        args["counts"] = list(sub.counts)
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
                tid = TID_COMM if sub.is_comm else TID_HOST if sub.kind == "host" else TID_COMPUTE
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


Source = str | os.PathLike[str] | HasRecords | Sequence[CmdOp]


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


# ----------------------------------------------------------------------------- reader


def _ints(x: Any) -> tuple[int, ...] | None:
    return None if x is None else tuple(int(v) for v in x)


def _pairs(x: Any) -> tuple[tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in (x or {}).items())


def read_chrome_trace(path: str | os.PathLike[str]) -> list[CmdOp]:
    """All mixmoe ops in the file, ordered by (rank, op_index). Raises ValueError if the file is
    not JSON, has no ``traceEvents``, or holds no mixmoe events."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{os.fspath(path)}: not valid JSON ({err}); truncated file?") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{os.fspath(path)}: no 'traceEvents' list; is this a Chrome trace?")
    ops: dict[tuple[int, int], dict[str, Any]] = {}
    subs: dict[tuple[int, int], list[SubOp]] = {}
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat, args = ev.get("cat"), ev.get("args") or {}
        if cat not in ("mixmoe.op", "mixmoe.sub"):
            continue
        key = (int(ev["pid"]), int(args["op_index"]))
        duration_ms = float(ev["dur"]) / 1e3
        end_ms = (float(ev["ts"]) + float(ev["dur"])) / 1e3
        if cat == "mixmoe.op":
            ops[key] = {"name": ev["name"], "duration_ms": duration_ms, "end_ms": end_ms, **args}
        else:
            subs.setdefault(key, []).append(
                SubOp(
                    name=args.get("name"),
                    kind=args.get("kind"),
                    comm_func=args.get("comm_func"),
                    group=args.get("group"),
                    shape=_ints(args.get("shape")),
                    dtype=args.get("dtype"),
                    duration_ms=duration_ms,
                    timestamp_ms=end_ms,
                    in_splits=_ints(args.get("in_splits")),
                    out_splits=_ints(args.get("out_splits")),
                    extra=_pairs(args.get("extra")),
                    counts=_ints(args.get("counts")),
                )
            )
    if not ops:
        raise ValueError(f"{os.fspath(path)}: no mixmoe events (cat 'mixmoe.op') found")
    out = []
    for key in sorted(ops):
        a = ops[key]
        out.append(
            CmdOp(
                rank=key[0],
                name=a["name"],
                stage_id=a.get("stage_id"),
                batch_id=a.get("batch_id"),
                mg_state=a.get("mg_state"),
                duration_ms=a["duration_ms"],
                description=a.get("description"),
                group_kind=a.get("group_kind"),
                shape=_ints(a.get("shape")),
                dtype=a.get("dtype"),
                timestamp_ms=a["end_ms"],
                sub_ops=tuple(sorted(subs.get(key, []), key=lambda s: s.timestamp_ms or 0.0)),
                extra=_pairs(a.get("extra")),
            )
        )
    return out
