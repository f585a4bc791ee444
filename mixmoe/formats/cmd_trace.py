"""The CMD operation-trace line format (docs/formats.md section 3): records, reader and writer.

One operation per line::

    rank:<R>:<op>(stage_id=S,batch_id=B,mg_state=STATE,duration=MS,description=TEXT|None,
                  group_kind=G|None,input__shape=[..]|None,input__dtype=torch.X|None,
                  timestamp=MS,sub_operations=['key=value,key=value,...', ...])

- ``duration`` and ``timestamp`` are milliseconds; ``timestamp`` is the op's END on a host-local
  monotonic clock. The short form stops after ``group_kind`` (six fields, ``duration=None``).
- ``sub_operations`` is a Python list of strings, each ``key=value,...``; values may be lists
  (``input__shape=[2048, 4096]``, ``in_splits=[3, 1]``), so sub-op fields split only at bracket
  depth 0. mixmoe adds the keys ``name``, ``kind``, ``in_splits``, ``out_splits`` and, on the
  layer's count exchange, ``counts`` (rows this rank routed to each expert that step, c_N).
  Readers that predate a key keep it in ``extra``, so older readers read newer files.
- ``description`` is free text (commas, parentheses, ``k=v`` pairs): it ends only at a comma
  followed by one of the op's known keys.

Line level (``parse_cmd_line`` / ``format_cmd_line`` / ``read_cmd_file``) is literal: op names are
kept as written, and writing then parsing a line gives back an equal ``CmdOp`` up to the 1 ns
rounding of the written milliseconds. ``read_cmd_trace`` is what analyses use: the same ops with
their names normalised through ``OP_ALIASES`` (producers disagree: ``exp_dp_allreduce`` vs
``ep_dp_allreduce``); unknown names are kept as written. Torch-free.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "OP_ALIASES",
    "CmdOp",
    "SubOp",
    "canonical_op_name",
    "format_cmd_line",
    "normalised",
    "parse_cmd_line",
    "read_cmd_file",
    "read_cmd_trace",
    "write_cmd_file",
]

SHORT_FORM_KEYS = ("stage_id", "batch_id", "mg_state", "duration", "description", "group_kind")
FULL_FORM_KEYS = ("input__shape", "input__dtype", "timestamp", "sub_operations")
_OP_KEYS = frozenset(SHORT_FORM_KEYS + FULL_FORM_KEYS)
_LINE = re.compile(r"^rank:(-?\d+):([^()\s]+)\((.*)\)\s*$")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_CMD_PREFIX = re.compile(r"^rank:-?\d+:")


def _start_ms(duration_ms: float | None, timestamp_ms: float | None) -> float | None:
    """Start of a span logged by its END timestamp and duration (None if either is unknown)."""
    if duration_ms is None or timestamp_ms is None:
        return None
    return timestamp_ms - duration_ms


@dataclass(frozen=True)
class SubOp:
    """One timed sub-operation inside an op: a collective (legacy producers) or a mixmoe span.

    ``timestamp_ms`` is the END (same clock as the op); ``start_ms`` derives from it.
    ``in_splits[j]`` / ``out_splits[j]`` are the rows sent to / received from rank j of the group
    (all-to-alls only). ``counts[g]`` (the MoE layer's count exchange only) is the rows this rank
    routed to expert g in that step: its row of the step's count matrix C [W, N].
    ``extra`` keeps unknown keys in file order (e.g. ``trace_src_func``).
    """

    name: str | None = None
    kind: str | None = None
    comm_func: str | None = None
    group: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    duration_ms: float | None = None
    timestamp_ms: float | None = None
    in_splits: tuple[int, ...] | None = None
    out_splits: tuple[int, ...] | None = None
    extra: tuple[tuple[str, str], ...] = ()
    counts: tuple[int, ...] | None = None

    @property
    def start_ms(self) -> float | None:
        return _start_ms(self.duration_ms, self.timestamp_ms)

    @property
    def is_comm(self) -> bool:
        """True for collectives: a ``comm_func`` is named or the span kind is ``comm``."""
        return self.comm_func is not None or self.kind == "comm"

    @property
    def label(self) -> str:
        """Human name: the span name, else ``trace_src_func``, else the collective, else ``sub``."""
        if self.name:
            return self.name
        extra = dict(self.extra)
        return extra.get("trace_src_func") or self.comm_func or "sub"


@dataclass(frozen=True)
class CmdOp:
    """One CMD line. ``timestamp_ms`` is the END; ``None`` fields were ``None`` or absent."""

    rank: int
    name: str
    stage_id: int | None = None
    batch_id: int | None = None
    mg_state: str | None = None
    duration_ms: float | None = None
    description: str | None = None
    group_kind: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    timestamp_ms: float | None = None
    sub_ops: tuple[SubOp, ...] = ()
    extra: tuple[tuple[str, str], ...] = ()
    line_no: int | None = field(default=None, compare=False)

    @property
    def start_ms(self) -> float | None:
        return _start_ms(self.duration_ms, self.timestamp_ms)

    @property
    def is_timed(self) -> bool:
        return self.duration_ms is not None and self.timestamp_ms is not None


# ----------------------------------------------------------------------------- splitting


def split_fields(text: str, free_text_keys: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Split ``k=v,k=v`` at commas at bracket depth 0 (outside quotes) followed by ``ident=``.

    A field whose key is in ``free_text_keys`` ends only at a comma followed by one of
    ``_OP_KEYS`` (depth and quotes ignored), so free text may hold anything but such a key.
    Raises ValueError if ``text`` does not start with ``key=``.
    """
    free = frozenset(free_text_keys)
    out: list[tuple[str, str]] = []
    n = len(text)
    pos = 0
    while pos < n:
        m = _KEY.match(text, pos)
        if m is None:
            raise ValueError(f"expected 'key=' at column {pos} of {text[:80]!r}")
        key = m.group()[:-1]
        i = m.end()
        start = i
        depth = 0
        quote: str | None = None
        while i < n:
            ch = text[i]
            if key in free:
                if ch == "," and (k := _KEY.match(text, i + 1)) and k.group()[:-1] in _OP_KEYS:
                    break
            elif quote is not None:
                if ch == "\\":
                    i += 1
                elif ch == quote:
                    quote = None
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth = max(0, depth - 1)
            elif ch == "," and depth == 0 and _KEY.match(text, i + 1):
                break
            i += 1
        out.append((key, text[start:i]))
        pos = i + 1
    return out


# ----------------------------------------------------------------------------- values


def _none_or(value: str) -> str | None:
    value = value.strip()
    return None if value in ("None", "") else value


def _int_or_none(key: str, value: str) -> int | None:
    v = _none_or(value)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not an integer or None") from None


def _float_or_none(key: str, value: str) -> float | None:
    v = _none_or(value)
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a number of milliseconds or None") from None


def _ints_or_none(key: str, value: str) -> tuple[int, ...] | None:
    v = _none_or(value)
    if v is None:
        return None
    try:
        parsed = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        raise ValueError(f"{key}={value!r} is not a list of integers (unclosed bracket?)") from None
    if isinstance(parsed, int):
        parsed = [parsed]
    if not isinstance(parsed, list | tuple) or not all(isinstance(x, int) for x in parsed):
        raise ValueError(f"{key}={value!r} is not a list of integers")
    return tuple(parsed)


def _fmt_ms(x: float | None) -> str:
    """Milliseconds with ns resolution and no trailing zeros (``0.04``, ``3371168147.09``)."""
    if x is None:
        return "None"
    text = f"{x:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def _fmt_ints(x: tuple[int, ...] | None) -> str:
    return "None" if x is None else "[" + ", ".join(str(int(v)) for v in x) + "]"


def _fmt_text(x: str | None) -> str:
    return "None" if x is None else " ".join(str(x).split())


# ----------------------------------------------------------------------------- sub-operations

_SUB_TYPED = {
    "name",
    "kind",
    "comm_func",
    "group",
    "input__shape",
    "input__dtype",
    "duration",
    "timestamp",
    "in_splits",
    "out_splits",
    "counts",
}


def parse_sub_op(text: str) -> SubOp:
    """Parse one ``key=value,...`` sub-operation string; unknown keys go to ``extra``."""
    kv = split_fields(text)
    typed = {k: v for k, v in kv if k in _SUB_TYPED}
    return SubOp(
        name=_none_or(typed.get("name", "None")),
        kind=_none_or(typed.get("kind", "None")),
        comm_func=_none_or(typed.get("comm_func", "None")),
        group=_none_or(typed.get("group", "None")),
        shape=_ints_or_none("input__shape", typed.get("input__shape", "None")),
        dtype=_none_or(typed.get("input__dtype", "None")),
        duration_ms=_float_or_none("duration", typed.get("duration", "None")),
        timestamp_ms=_float_or_none("timestamp", typed.get("timestamp", "None")),
        in_splits=_ints_or_none("in_splits", typed.get("in_splits", "None")),
        out_splits=_ints_or_none("out_splits", typed.get("out_splits", "None")),
        extra=tuple((k, v) for k, v in kv if k not in _SUB_TYPED),
        counts=_ints_or_none("counts", typed.get("counts", "None")),
    )


def format_sub_op(sub: SubOp) -> str:
    """The ``key=value,...`` string of a sub-operation; ``None`` fields are left out."""
    parts: list[str] = []
    for key, value in (("name", sub.name), ("kind", sub.kind)):
        if value is not None:
            parts.append(f"{key}={_fmt_text(value)}")
    parts.extend(f"{k}={v}" for k, v in sub.extra)
    parts.append(f"duration={_fmt_ms(sub.duration_ms)}")
    parts.append(f"timestamp={_fmt_ms(sub.timestamp_ms)}")
    if sub.shape is not None:
        parts.append(f"input__shape={_fmt_ints(sub.shape)}")
    if sub.dtype is not None:
        parts.append(f"input__dtype={sub.dtype}")
    for key, ints in (
        ("in_splits", sub.in_splits),
        ("out_splits", sub.out_splits),
        ("counts", sub.counts),
    ):
        if ints is not None:
            parts.append(f"{key}={_fmt_ints(ints)}")
    for key, value in (("group", sub.group), ("comm_func", sub.comm_func)):
        if value is not None:
            parts.append(f"{key}={_fmt_text(value)}")
    return ",".join(parts)


# ----------------------------------------------------------------------------- lines


def parse_cmd_line(line: str, line_no: int | None = None) -> CmdOp:
    """Parse one CMD line (full or six-field short form) into a ``CmdOp``.

    Raises ValueError naming the problem when the line is not ``rank:R:op(...)``, a value does not
    parse, or the line stops part-way (truncated file).
    """
    m = _LINE.match(line.strip())
    if m is None:
        raise ValueError(
            "not a complete 'rank:<R>:<op>(...)' line (truncated? the closing ')' is missing)"
        )
    rank, name, body = int(m.group(1)), m.group(2), m.group(3)
    fields = split_fields(body, free_text_keys=("description",))
    kv = dict(fields)
    missing = [k for k in SHORT_FORM_KEYS if k not in kv]
    if missing:
        raise ValueError(f"op {name!r} lacks the fields {missing} (truncated line?)")
    full = [k for k in FULL_FORM_KEYS if k in kv]
    if full and len(full) != len(FULL_FORM_KEYS):
        lacking = [k for k in FULL_FORM_KEYS if k not in kv]
        raise ValueError(f"op {name!r} has {full} but lacks {lacking} (truncated line?)")
    raw_subs = kv.get("sub_operations", "[]").strip()
    try:
        strings = ast.literal_eval(raw_subs)
    except (ValueError, SyntaxError):
        raise ValueError(
            f"sub_operations of op {name!r} is not a Python list of strings (truncated line?)"
        ) from None
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"sub_operations of op {name!r} must be a list of strings")
    subs = tuple(parse_sub_op(s) for s in strings)
    return CmdOp(
        rank=rank,
        name=name,
        stage_id=_int_or_none("stage_id", kv["stage_id"]),
        batch_id=_int_or_none("batch_id", kv["batch_id"]),
        mg_state=_none_or(kv["mg_state"]),
        duration_ms=_float_or_none("duration", kv["duration"]),
        description=_none_or(kv["description"]),
        group_kind=_none_or(kv["group_kind"]),
        shape=_ints_or_none("input__shape", kv.get("input__shape", "None")),
        dtype=_none_or(kv.get("input__dtype", "None")),
        timestamp_ms=_float_or_none("timestamp", kv.get("timestamp", "None")),
        sub_ops=subs,
        extra=tuple((k, v) for k, v in fields if k not in _OP_KEYS),
        line_no=line_no,
    )


def format_cmd_line(op: CmdOp) -> str:
    """The full-form CMD line of ``op`` (no newline). Descriptions are collapsed to one line."""
    parts = [
        f"stage_id={op.stage_id}",
        f"batch_id={op.batch_id}",
        f"mg_state={op.mg_state}",
        f"duration={_fmt_ms(op.duration_ms)}",
        f"description={_fmt_text(op.description)}",
        f"group_kind={op.group_kind}",
        f"input__shape={_fmt_ints(op.shape)}",
        f"input__dtype={op.dtype}",
        f"timestamp={_fmt_ms(op.timestamp_ms)}",
    ]
    parts.extend(f"{k}={v}" for k, v in op.extra)
    parts.append(f"sub_operations={[format_sub_op(s) for s in op.sub_ops]!r}")
    return f"rank:{op.rank}:{op.name}({','.join(parts)})"


def read_cmd_file(path: str | os.PathLike[str]) -> list[CmdOp]:
    """All CMD lines of a file, in file order. Lines not starting with ``rank:<R>:`` are skipped
    (logs interleave noise such as ``rank: 2, nranks: 4``); a ``rank:<R>:`` line that does not
    parse raises ValueError naming ``path:line``."""
    ops: list[CmdOp] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            stripped = line.strip()
            if not _CMD_PREFIX.match(stripped):
                continue
            try:
                ops.append(parse_cmd_line(stripped, line_no))
            except ValueError as err:
                raise ValueError(
                    f"{os.fspath(path)}:{line_no}: {err}; fix or delete that line"
                ) from None
    return ops


def write_cmd_file(ops: Iterable[CmdOp], path: str | os.PathLike[str]) -> Path:
    """Write ``ops`` as full-form CMD lines (one per line, in the given order) to ``path``."""
    out = Path(path)
    out.write_text("".join(format_cmd_line(op) + "\n" for op in ops), encoding="utf-8")
    return out


# ----------------------------------------------------------------------------- op-name aliases

# alias -> canonical op name
OP_ALIASES: dict[str, str] = {
    "exp_dp_allreduce": "ep_dp_allreduce",
    "expert_dp_allreduce": "ep_dp_allreduce",
    "ep_dp_all_reduce": "ep_dp_allreduce",
    "exp_dp_all_reduce": "ep_dp_allreduce",
    "dp_all_reduce": "dp_allreduce",
    "data_parallel_allreduce": "dp_allreduce",
    "forward": "forward_step",
    "backward": "backward_step",
    "optimizer": "optimizer_step",
    "optim_step": "optimizer_step",
    "load_batch": "get_batch",
}


def canonical_op_name(name: str) -> str:
    """``name`` mapped through ``OP_ALIASES``; unknown names are returned unchanged."""
    return OP_ALIASES.get(name, name)


def normalised(ops: Iterable[CmdOp]) -> list[CmdOp]:
    """``ops`` with their names mapped through ``canonical_op_name``."""
    out = []
    for op in ops:
        name = canonical_op_name(op.name)
        out.append(op if name == op.name else dataclasses.replace(op, name=name))
    return out


def read_cmd_trace(path: str | os.PathLike[str]) -> list[CmdOp]:
    """The ops of one CMD trace file, in file order, names normalised (``OP_ALIASES``).

    Lines not starting with ``rank:`` are skipped; an empty result raises ValueError (wrong file).
    """
    ops = normalised(read_cmd_file(path))
    if not ops:
        raise ValueError(
            f"{os.fspath(path)}: no 'rank:<R>:<op>(...)' lines found; is this a CMD trace?"
        )
    return ops
