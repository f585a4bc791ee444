"""``torch.distributed.checkpoint`` (DCP) for the rest of mixmoe, which must not import
``torch.distributed`` itself: save a flat ``{key: tensor}`` dict from every rank of a
communicator into one directory, list what a directory holds, and load keys back.

Every rank passes the keys IT holds; a key several ranks hold (a replicated dense weight) is
written once (DCP's de-duplication), a key one rank holds (its experts' rows) by that rank only,
each rank writing its own file: nothing is gathered on one rank. Loading reads any subset of the
keys on any number of ranks, so a checkpoint written by W ranks loads on W' ranks.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mixmoe.comm.communicator import Communicator


def _no_dist(comm: Communicator) -> bool:
    return comm is None or comm.world_size == 1 or not dist.is_initialized()


# DCP warns that it assumes one process when there is no process group: that is meant here
_ONE_PROCESS = "torch.distributed is disabled"


def _plain_error(what: str, e: BaseException) -> RuntimeError:
    """DCP's CheckpointException (a BaseException carrying every failed rank's exception) as
    a RuntimeError naming the ranks and the first error."""
    failures = getattr(e, "failures", {}) or {}
    ranks = sorted(failures)
    first = failures[ranks[0]] if ranks else e
    text = str(first).splitlines()[0] if str(first) else type(first).__name__
    return RuntimeError(f"checkpoint {what} failed on rank(s) {ranks}: {text}")


def save_flat(
    state: dict[str, torch.Tensor], path: str | os.PathLike[str], comm: Communicator
) -> None:
    """Collective over ``comm`` (None or a world of one: this process alone): write ``state``
    into the directory ``path`` (created); DCP's ``.metadata`` is written last, by rank 0, once
    every rank's file is complete."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        try:
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(str(path), thread_count=1),
                process_group=None if _no_dist(comm) else comm.group,
                no_dist=_no_dist(comm),
            )
        except CheckpointException as e:
            raise _plain_error(f"save to {path}", e) from e


def stored_keys(path: str | os.PathLike[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (shape, dtype)}`` of every tensor in the DCP directory ``path`` (no collective;
    reads only the metadata)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for key, item in meta.state_dict_metadata.items():
        props = getattr(item, "properties", None)
        if props is not None and hasattr(item, "size"):
            out[key] = (tuple(item.size), props.dtype)
    return out


def load_flat(
    state: dict[str, torch.Tensor], path: str | os.PathLike[str], comm: Communicator
) -> None:
    """Collective over ``comm``: fill the tensors of ``state`` (each rank its own keys, shapes as
    stored) in place from the DCP directory ``path``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        try:
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(str(path)),
                process_group=None if _no_dist(comm) else comm.group,
                no_dist=_no_dist(comm),
            )
        except CheckpointException as e:
            raise _plain_error(f"load from {path}", e) from e
