"""Reader of the Chrome trace JSON that ``mixmoe.tracing.write_chrome_trace`` writes.

Rebuilds the ``CmdOp`` records of every rank from the complete events (``ph: "X"``) of category
``mixmoe.op`` and ``mixmoe.sub``: ``pid`` -> rank, ``ts``/``dur`` (microseconds) -> start and
duration in ms, ``args.op_index`` -> the op a sub-operation belongs to. Other events (metadata,
torch.profiler events merged into the same file) are ignored. Torch-free.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mixmoe.tracing.cmd_format import CmdOp, SubOp

__all__ = ["read_chrome_trace"]


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
