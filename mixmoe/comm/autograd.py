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
"""

from __future__ import annotations

import torch


class _Pending:
    """Holds the in-flight work of an async all-to-all between start and wait (forward), and
    between wait and start (backward)."""

    def __init__(self) -> None:
        self.work = None
        self.comm = None
        self.splits: tuple[list[int], list[int]] | None = None  # (out, in) of the forward
        self.grad_in = None  # backward: reverse all-to-all output, valid after grad_work.wait()
        self.grad_work = None


def _move(comm, x_RC: torch.Tensor, out_splits: list[int], in_splits: list[int], async_op=False):
    out = x_RC.new_empty((sum(out_splits),) + tuple(x_RC.shape[1:]))
    work = comm.all_to_all(out, x_RC, out_splits, in_splits, async_op=async_op)
    return out, work


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RC, comm, out_splits, in_splits, pending, cached):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        ctx.pending = pending
        if cached is not None:
            return cached.detach().clone()
        out, work = _move(comm, x_RC, out_splits, in_splits, async_op=pending is not None)
        if pending is not None:
            pending.work, pending.comm, pending.splits = work, comm, (out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        pending = ctx.pending
        if pending is not None and pending.grad_work is not None:  # started by _Wait.backward
            pending.grad_work.wait()
            grad_in, pending.grad_in, pending.grad_work = pending.grad_in, None, None
        else:
            grad_in, _ = _move(ctx.comm, grad_out.contiguous(), ctx.in_splits, ctx.out_splits)
        return grad_in, None, None, None, None, None


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
        pending.grad_in, pending.grad_work = _move(
            pending.comm, grad.contiguous(), in_splits, out_splits, async_op=True
        )
        return grad, None


def all_to_all(
    comm, x_RC: torch.Tensor, out_splits: list[int], in_splits: list[int]
) -> torch.Tensor:
    return _AllToAll.apply(x_RC, comm, out_splits, in_splits, None, None)


def all_to_all_start(
    comm, x_RC: torch.Tensor, out_splits: list[int], in_splits: list[int]
) -> tuple[torch.Tensor, _Pending]:
    pending = _Pending()
    return _AllToAll.apply(x_RC, comm, out_splits, in_splits, pending, None), pending


def all_to_all_wait(out_RC: torch.Tensor, pending: _Pending) -> torch.Tensor:
    return _Wait.apply(out_RC, pending)


def cached_all_to_all(
    comm,
    x_RC: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    cached: torch.Tensor | None,
) -> torch.Tensor:
    return _AllToAll.apply(x_RC, comm, out_splits, in_splits, None, cached)
