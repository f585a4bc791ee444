"""``Communicator``: the collectives a MoE layer needs, as a protocol, and its two implementations:
``ProcessGroupCommunicator`` (one torch.distributed process group: gloo on CPU, NCCL on CUDA) and
``LocalCommunicator`` (world size 1, no process group). Everything above ``comm`` takes a
``Communicator`` and never touches ``torch.distributed`` itself.

Every split list is in rows of dim 0 and must be identical in meaning on all ranks (rank s's
``in_splits[q]`` == rank q's ``out_splits[s]``). Async variants return a ``Work`` whose ``wait()``
must be called before the output is read.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


class Work(Protocol):
    def wait(self) -> object: ...


# torch.distributed's one-output all-gather: ``all_gather_single`` (torch >= 2.13), else its
# older name; the output is flat, rank-major (gloo takes only the flat form)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """A completed handle (world size 1, or nothing to move)."""

    def wait(self) -> bool:
        return True


@runtime_checkable
class Communicator(Protocol):
    """What the layers, dispatchers, training loop and benchmarks need of a group of ranks."""

    rank: int
    world_size: int
    backend: str
    group: dist.ProcessGroup | None  # None: the world group, or no group at all (local)

    def all_gather_rows(self, x_C: torch.Tensor) -> torch.Tensor: ...

    def all_to_all(
        self,
        out_RC: torch.Tensor,
        in_RC: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        async_op: bool = False,
    ) -> Work: ...

    def all_reduce(self, x: torch.Tensor, op: str = "sum", async_op: bool = False) -> Work: ...

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor: ...

    def broadcast(self, x: torch.Tensor, src: int) -> None: ...

    def barrier(self) -> None: ...


class ProcessGroupCommunicator:
    """``Communicator`` over ``group`` (None = the default/world group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call mixmoe.comm.init_distributed() first "
                "(or use LocalCommunicator for one process)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def all_gather_rows(self, x_C: torch.Tensor) -> torch.Tensor:
        """[C] on every rank -> [W, C] (rank order): one collective into one flat output (a
        list of W outputs costs W tensors and a stack copy: at W = 1024 ranks and C = 4096 int64
        the stack alone moves 32 MiB)."""
        x_C = x_C.contiguous()
        out = torch.empty(self.world_size * x_C.numel(), dtype=x_C.dtype, device=x_C.device)
        _all_gather_flat(out, x_C, group=self.group)
        return out.view(self.world_size, *x_C.shape)

    def all_to_all(
        self,
        out_RC: torch.Tensor,
        in_RC: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        async_op: bool = False,
    ) -> Work:
        work = dist.all_to_all_single(
            out_RC, in_RC.contiguous(), out_splits, in_splits, group=self.group, async_op=async_op
        )
        return work if async_op else _Done()

    def all_reduce(self, x: torch.Tensor, op: str = "sum", async_op: bool = False) -> Work:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        work = dist.all_reduce(x, op=ops[op], group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        self.all_reduce(out, "max")
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> None:
        """In place; ``src`` is a rank of this group."""
        dist.broadcast(
            x, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group
        )

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class LocalCommunicator:
    """World size 1: every collective is a copy (or nothing)."""

    rank = 0
    world_size = 1
    backend = "local"
    group = None

    def all_gather_rows(self, x_C: torch.Tensor) -> torch.Tensor:
        return x_C.unsqueeze(0).clone()

    def all_to_all(self, out_RC, in_RC, out_splits, in_splits, async_op=False) -> Work:
        if out_splits != in_splits:
            raise ValueError(
                f"world size 1 all_to_all needs equal splits, got {out_splits} vs {in_splits}"
            )
        out_RC.copy_(in_RC)
        return _Done()

    def all_reduce(self, x: torch.Tensor, op: str = "sum", async_op: bool = False) -> Work:
        return _Done()

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def broadcast(self, x: torch.Tensor, src: int) -> None:
        return None

    def barrier(self) -> None:
        return None
