"""``TraceRecorder``: per-rank record of a training loop's ops and the spans inside them.

Usage::

    rec = TraceRecorder(rank=r, stage_id=0)
    with rec.activate():
        for b, batch in enumerate(loader):
            with rec.op("get_batch", batch_id=b, mg_state="steady"):
                x = next(batch)
            with rec.op("forward_step", batch_id=b, mg_state="steady"):
                y, aux = moe(x)          # the layer's trace_span calls become sub-operations
            ...
    rec.write_cmd(f"trace_rank{r}.txt")  # docs/formats.md section 3, one file per rank

Ops are flat (an op inside an op is an error); ``trace_span`` calls inside an op become its
sub-operations, calls outside any op (but inside ``activate()``) become ops of their own.
Timing marks are resolved only by ``records()`` / ``write_cmd()`` (one wait per CUDA event there,
none while running).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from mixmoe.formats.cmd_trace import CmdOp, SubOp, write_cmd_file
from mixmoe.tracing.clocks import CpuClock, CudaClock, clock_for
from mixmoe.tracing.span import ACTIVE, Frame, PendingSpan

__all__ = ["TraceRecorder"]


@dataclass
class _PendingOp:
    name: str
    batch_id: int | None
    mg_state: str | None
    description: str | None
    group_kind: str | None
    shape: Sequence[int] | None
    dtype: Any
    spans: list[PendingSpan] = field(default_factory=list)
    start: Any = None
    end: Any = None


def _ints(x: Any) -> tuple[int, ...] | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    return tuple(int(v) for v in x)


def _dtype_text(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype)


class TraceRecorder:
    """Records the ops of one rank. ``device`` picks the clock: CUDA events for a CUDA device,
    ``perf_counter`` otherwise; ``None`` means the current CUDA device if CUDA is available,
    else CPU."""

    def __init__(
        self, rank: int, stage_id: int | None = 0, device: str | torch.device | None = None
    ) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"TraceRecorder rank={rank!r}; pass the process rank (an int >= 0)")
        if device is None:
            available = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if available else "cpu"
        self.rank = rank
        self.stage_id = stage_id
        self.device = torch.device(device)
        self._clock: CpuClock | CudaClock = clock_for(self.device)
        self._pending: list[_PendingOp] = []
        self._loose: list[PendingSpan] = []
        self._done: list[CmdOp] = []
        self._open: list[Frame] = []  # frames of activate() / op() now open, innermost last

    def _close(self, frame: Frame) -> None:
        """Drop ``frame`` (by identity: frames compare by value) from the open frames."""
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i] is frame:
                del self._open[i]
                return

    def _current(self) -> Frame | None:
        """The innermost open frame (read by ``trace_span``'s fallback on autograd threads)."""
        return self._open[-1] if self._open else None

    @contextmanager
    def activate(self) -> Iterator[TraceRecorder]:
        """Make this recorder the one ``trace_span`` reports to, in this context (thread/task)."""
        frame = Frame(self._clock, self._loose, None, self._current)
        token = ACTIVE.set(frame)
        self._open.append(frame)
        try:
            yield self
        finally:
            self._close(frame)
            ACTIVE.reset(token)

    @contextmanager
    def op(
        self,
        name: str,
        *,
        batch_id: int | None = None,
        mg_state: str | None = None,
        description: str | None = None,
        group_kind: str | None = None,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> Iterator[None]:
        """Time one top-level op (``get_batch``, ``forward_step``, ``send_forward``, ...).

        Also labels it with ``record_function(name)`` and activates this recorder inside it, so
        ``trace_span`` calls within become its sub-operations.
        """
        outer = ACTIVE.get()
        if outer is not None and outer.op_name is not None:
            raise ValueError(
                f"op {name!r} opened inside op {outer.op_name!r}; CMD ops are flat: close the "
                f"outer op first, or use trace_span({name!r}) for a sub-operation"
            )
        pending = _PendingOp(name, batch_id, mg_state, description, group_kind, shape, dtype)
        frame = Frame(self._clock, pending.spans, name, self._current)
        token = ACTIVE.set(frame)
        self._open.append(frame)
        try:
            with record_function(name):
                pending.start = self._clock.mark()
                try:
                    yield
                finally:
                    pending.end = self._clock.mark()
        finally:
            self._close(frame)
            ACTIVE.reset(token)
            self._pending.append(pending)

    # ------------------------------------------------------------------ flushing

    def _sub_op(self, span: PendingSpan) -> SubOp:
        start = self._clock.to_ms(span.start)
        end = self._clock.to_ms(span.end)
        return SubOp(
            name=span.name,
            kind=span.kind,
            comm_func=span.comm_func,
            group=span.group,
            shape=_ints(span.shape),
            dtype=_dtype_text(span.dtype),
            duration_ms=end - start,
            timestamp_ms=end,
            in_splits=_ints(span.in_splits),
            out_splits=_ints(span.out_splits),
            counts=_ints(span.counts),
        )

    def _resolve(self, op: _PendingOp) -> CmdOp:
        start = self._clock.to_ms(op.start)
        end = self._clock.to_ms(op.end)
        subs = sorted((self._sub_op(s) for s in op.spans), key=lambda s: s.timestamp_ms or 0.0)
        return CmdOp(
            rank=self.rank,
            name=op.name,
            stage_id=self.stage_id,
            batch_id=op.batch_id,
            mg_state=op.mg_state,
            duration_ms=end - start,
            description=op.description,
            group_kind=op.group_kind,
            shape=_ints(op.shape),
            dtype=_dtype_text(op.dtype),
            timestamp_ms=end,
            sub_ops=tuple(subs),
        )

    def _resolve_loose(self, span: PendingSpan) -> CmdOp:
        sub = self._sub_op(span)
        return CmdOp(
            rank=self.rank,
            name=span.name,
            stage_id=self.stage_id,
            duration_ms=sub.duration_ms,
            group_kind=sub.group,
            shape=sub.shape,
            dtype=sub.dtype,
            timestamp_ms=sub.timestamp_ms,
            sub_ops=(sub,),
        )

    def records(self) -> list[CmdOp]:
        """All finished ops so far, ordered by end time (the order a line logger writes them).

        Resolves pending marks (on CUDA this waits for the recorded events). A span outside any
        op becomes an op named after the span holding itself as its only sub-operation.
        """
        pending, self._pending = self._pending, []
        loose = list(self._loose)
        del self._loose[:]  # in place: an active Frame keeps appending to this very list
        self._done.extend(self._resolve(op) for op in pending)
        self._done.extend(self._resolve_loose(span) for span in loose)
        self._done.sort(key=lambda op: op.timestamp_ms or 0.0)
        return list(self._done)

    def write_cmd(self, path: str | os.PathLike[str]) -> Path:
        """Write ``records()`` as CMD lines (docs/formats.md section 3) to ``path``; returns it."""
        return write_cmd_file(self.records(), path)
