"""Run a function on W local gloo processes (CPU tests, benchmarks, the demo): a launcher for
benchmarks and tests, built on ``mixmoe.comm`` (which stays the only ``torch.distributed`` code).

Each child initialises gloo over a ``FileStore`` in a fresh temporary directory, sets one torch
thread (unless told otherwise), calls ``fn(comm, *args)`` and sends back its return value or its
traceback. The parent waits at most ``timeout_s``: a hang becomes an error naming the ranks that
did not finish, never a stuck test.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from mixmoe.comm import init_file_store, shutdown_distributed


def _child(rank, world_size, store_path, threads, pg_timeout_s, fn, args, results) -> None:
    try:
        torch.set_num_threads(threads)
        comm = init_file_store(store_path, rank=rank, world_size=world_size, timeout_s=pg_timeout_s)
        out = fn(comm, *args)
        buf = io.BytesIO()  # plain bytes: tensors must not outlive this process as shared memory
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        shutdown_distributed()


def spawn_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    threads: int = 1,
    pg_timeout_s: float | None = 120.0,
) -> list[Any]:
    """``[fn(comm_rank0, *args), ..., fn(comm_rankW-1, *args)]``; ``fn`` must be picklable
    (a module-level function). Raises RuntimeError with the children's tracebacks on failure."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="mixmoe-gloo-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, store_path, threads, pg_timeout_s, fn, args, results),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world_size:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if p.exitcode is not None and r not in got
                    ]
                    if dead:  # exited without reporting (crashed at start-up, killed, ...)
                        time.sleep(1.0)  # a result may still be in the pipe
                        if results.empty():
                            codes = {r: procs[r].exitcode for r in dead}
                            raise RuntimeError(
                                f"ranks {dead} exited without a result (exit codes {codes})"
                            ) from None
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(got))
                        raise RuntimeError(
                            f"ranks {missing} did not finish within {timeout_s:.0f} s"
                        ) from None
                    continue
                got[rank] = (ok, value)
                if not ok:  # one rank failed: give the others a moment to report, then stop
                    deadline = min(deadline, time.monotonic() + 30.0)
        except RuntimeError:
            if not any(not ok for ok, _ in got.values()):
                raise
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if failures:
        raise RuntimeError("distributed run failed:\n" + "\n".join(failures))
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]


def under_torchrun() -> bool:
    """Whether this process was launched by ``torchrun`` (its environment is set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_on_ranks(
    rank_fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    threads: int = 1,
    timeout_s: float = 3600.0,
    command: str = "mixmoe ...",
) -> Any:
    """``rank_fn(comm, *args)`` on ``world_size`` ranks, for the commands with ``--world-size``:
    torchrun's group when launched by torchrun (the result on rank 0, None on the others),
    otherwise ``world_size`` gloo CPU processes spawned here (rank 0's result). ValueError when
    torchrun launched another number of ranks, or when spawning is asked for a GPU device."""
    if under_torchrun():
        from mixmoe.comm import init_distributed

        comm = init_distributed("auto")
        if comm.world_size != world_size:
            raise ValueError(
                f"--world-size {world_size} but torchrun launched {comm.world_size} ranks; "
                f"give --world-size {comm.world_size} (or leave it out)"
            )
        result = rank_fn(comm, *args)
        return result if comm.rank == 0 else None
    if not device.startswith("cpu"):
        raise ValueError(
            f"--world-size spawns gloo CPU processes, not {device} ones; launch GPU runs with "
            f"torchrun (torchrun --nproc-per-node {world_size} -m {command})"
        )
    return spawn_gloo(rank_fn, world_size, *args, threads=threads, timeout_s=timeout_s)[0]
