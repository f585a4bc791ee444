"""Differentiable all-to-alls (rows of dim 0). Backward swaps the splits.

``all_to_all``        synchronous.
``all_to_all_start``/``all_to_all_wait``  asynchronous: the output buffer is returned at once and
                      must pass through ``all_to_all_wait`` before it is read. Backward mirrors
                      it: the wait's backward starts the reverse all-to-all, the start's backward
                      waits for it, so autograd runs the nodes between them (the local blocks'
                      backward) while the gradient is in flight.
``cached_all_to_all`` forward either moves ``x`` or, when every rank agrees the receiver already
                      holds the result (``cached`` given), moves nothing; backward always returns
                      the gradient to the senders (replica gradients go home to their owners).

Tracing. Given ``trace=(name, group)``, the backward all-to-all of each is recorded as a
``trace_span`` named ``name + BACKWARD`` (e.g. ``moe.dispatch.backward``) with the keys of the
forward span (``comm_func=all_to_all``, the group, the shape and dtype of the rows it sends,
``in_splits``: rows sent to each rank, ``out_splits``: rows received), so a trace holds the
backward exchanges too. Like the forward spans, an asynchronous one times its launch
(``_Wait.backward``), the wait being spent in the ops around it. The recorder is looked up in
forward (``recorder_lookup``): backward may run on an autograd worker thread.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from mixmoe.comm.communicator import Communicator
from mixmoe.tracing.span import recorder_lookup, trace_span

BACKWARD = ".backward"  # suffix of a backward exchange's span name


def _trace_of(trace: tuple[str, str] | None) -> tuple[str, str, Any] | None:
    """(backward span name, group, recorder lookup) when tracing is asked for, else None."""
    if trace is None:
        return None
    name, group = trace
    return name + BACKWARD, group, recorder_lookup()


def _span(trace, x_RC: torch.Tensor, sent: list[int], received: list[int]):
    """The span of one backward exchange (``x_RC`` the rows sent), or nothing untraced."""
    if trace is None:
        return nullcontext()
    name, group, fallback = trace
    return trace_span(
        name,
        kind="comm",
        comm_func="all_to_all",
        group=group,
        shape=tuple(x_RC.shape),
        dtype=x_RC.dtype,
        in_splits=sent,
        out_splits=received,
        fallback=fallback,
    )


class _Pending:
    """Holds the in-flight work of an async all-to-all between start and wait (forward), and
    between wait and start (backward)."""

    def __init__(self) -> None:
        self.work = None
        self.comm = None
        self.splits: tuple[list[int], list[int]] | None = None  # (out, in) of the forward
        self.grad_in = None  # backward: reverse all-to-all output, valid after grad_work.wait()
        self.grad_work = None
        self.trace = None  # _trace_of(...) of the exchange, for its backward span


def _move(
    comm: Communicator,
    x_RC: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    async_op=False,
):
    out = x_RC.new_empty((sum(out_splits),) + tuple(x_RC.shape[1:]))
    work = comm.all_to_all(out, x_RC, out_splits, in_splits, async_op=async_op)
    return out, work


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RC, comm, out_splits, in_splits, pending, cached, trace):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        ctx.pending = pending
        ctx.trace = _trace_of(trace)
        if cached is not None:
            return cached.detach().clone()
        out, work = _move(comm, x_RC, out_splits, in_splits, async_op=pending is not None)
        if pending is not None:
            pending.work, pending.comm, pending.splits = work, comm, (out_splits, in_splits)
            pending.trace = ctx.trace
        return out

    @staticmethod
    def backward(ctx, grad_out):
        pending = ctx.pending
        if pending is not None and pending.grad_work is not None:  # started by _Wait.backward
            pending.grad_work.wait()
            grad_in, pending.grad_in, pending.grad_work = pending.grad_in, None, None
        else:
            grad_out = grad_out.contiguous()
            with _span(ctx.trace, grad_out, ctx.out_splits, ctx.in_splits):
                grad_in, _ = _move(ctx.comm, grad_out, ctx.in_splits, ctx.out_splits)
        return grad_in, None, None, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out_RC, pending):
        pending.work.wait()
        pending.work = None
        ctx.pending = pending
        return out_RC.view_as(out_RC)

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending
        out_splits, in_splits = pending.splits
        grad_RC = grad.contiguous()
        with _span(pending.trace, grad_RC, out_splits, in_splits):
            pending.grad_in, pending.grad_work = _move(
                pending.comm, grad_RC, in_splits, out_splits, async_op=True
            )
        return grad, None


def all_to_all(
    comm: Communicator,
    x_RC: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    trace: tuple[str, str] | None = None,
) -> torch.Tensor:
    """``trace``: (span name, group) to record the backward exchange under (module doc)."""
    return _AllToAll.apply(x_RC, comm, out_splits, in_splits, None, None, trace)


def all_to_all_start(
    comm: Communicator,
    x_RC: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    trace: tuple[str, str] | None = None,
) -> tuple[torch.Tensor, _Pending]:
    pending = _Pending()
    return _AllToAll.apply(x_RC, comm, out_splits, in_splits, pending, None, trace), pending


def all_to_all_wait(out_RC: torch.Tensor, pending: _Pending) -> torch.Tensor:
    return _Wait.apply(out_RC, pending)


def cached_all_to_all(
    comm: Communicator,
    x_RC: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    cached: torch.Tensor | None,
    trace: tuple[str, str] | None = None,
) -> torch.Tensor:
    return _AllToAll.apply(x_RC, comm, out_splits, in_splits, None, cached, trace)
