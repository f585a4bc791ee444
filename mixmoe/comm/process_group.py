"""Process-group set-up: ``init_distributed`` (torchrun environment or an explicit store),
``init_file_store`` / ``shutdown_distributed`` for local processes, and expert-parallel subgroups."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from mixmoe.comm.communicator import Communicator, ProcessGroupCommunicator

# start-up (rendezvous, the first barrier) may wait this long for a slow rank even when the
# collective timeout is short: ranks import torch at their own pace
STARTUP_TIMEOUT_S = 300.0


def init_distributed(
    backend: str = "auto",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
    timeout_s: float | None = None,
) -> Communicator:
    """Initialise the default process group and return a ``Communicator`` over the world.

    backend "auto": NCCL when CUDA is available, gloo otherwise. Without ``store`` the usual
    ``torchrun`` variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are read. ``timeout_s``
    bounds every collective after start-up: a rank that never joins makes the others fail
    instead of hanging (the rendezvous itself may take up to ``STARTUP_TIMEOUT_S``).
    """
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not supported; use 'auto', 'gloo' or 'nccl'")
    if not dist.is_initialized():
        kwargs = {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
        if store is not None:
            if rank is None or world_size is None:
                raise ValueError("init_distributed(store=...) needs rank and world_size")
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, **kwargs
            )
        else:
            missing = [
                k
                for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                if k not in os.environ
            ]
            if missing and rank is None:
                raise RuntimeError(
                    f"init_distributed: environment variables {missing} are not set; launch with "
                    "torchrun or pass store=, rank= and world_size="
                )
            if rank is not None:
                kwargs["rank"] = rank
            if world_size is not None:
                kwargs["world_size"] = world_size
            dist.init_process_group(backend, **kwargs)  # env:// reads the torchrun variables
        if backend == "nccl":
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            )
        if timeout_s is not None and timeout_s < STARTUP_TIMEOUT_S:
            from torch.distributed.distributed_c10d import _set_pg_timeout

            dist.barrier()  # everyone is here: from now on the short timeout holds
            _set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    return ProcessGroupCommunicator()


def init_file_store(
    path: str, *, rank: int, world_size: int, backend: str = "gloo", timeout_s: float | None = None
) -> Communicator:
    """``init_distributed`` over a ``FileStore`` at ``path`` (a file in a directory all ranks of
    this host can reach, fresh for each run): W local processes without torchrun."""
    store = dist.FileStore(path, world_size)
    return init_distributed(
        backend, rank=rank, world_size=world_size, store=store, timeout_s=timeout_s
    )


def shutdown_distributed() -> None:
    """Destroy the default process group if one is initialised (errors while tearing down a
    failed group are ignored: the process is ending anyway)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def new_expert_groups(
    ep_size: int, timeout_s: float | None = None
) -> tuple[Communicator, Communicator]:
    """Split the world into expert-parallel groups of ``ep_size`` consecutive ranks.

    Returns ``(ep, edp)``: the EP group of this rank, and its expert-data-parallel group (the ranks
    holding the same experts in the other EP groups, across which expert gradients are averaged).
    Every rank must call this (group creation is collective). ``timeout_s`` bounds their
    collectives (None: torch's default).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world}")
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    ep_group = edp_group = None
    for start in range(0, world, ep_size):
        g = dist.new_group(list(range(start, start + ep_size)), **kw)
        if start <= rank < start + ep_size:
            ep_group = g
    for offset in range(ep_size):
        g = dist.new_group(list(range(offset, world, ep_size)), **kw)
        if rank % ep_size == offset:
            edp_group = g
    return ProcessGroupCommunicator(ep_group), ProcessGroupCommunicator(edp_group)
