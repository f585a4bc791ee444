"""Run a function on W local gloo processes (CPU tests, benchmarks, the demo): a launcher for
benchmarks and tests, built on ``mixmoe.comm`` (which stays the only ``torch.distributed`` code).

Each child initialises gloo over a ``FileStore`` in a fresh temporary directory, sets one torch
thread (unless told otherwise), calls ``fn(comm, *args)`` and sends back its return value or its
traceback. The parent waits at most ``timeout_s``: a hang becomes an error naming the ranks that
did not finish, never a stuck test.
"""

from __future__ import annotations

import atexit
import io
import os
import queue
import re
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from mixmoe.comm import init_file_store, shutdown_distributed
from mixmoe.comm.communicator import Communicator
from mixmoe.validation import check_int

# after the first failure, how long the other ranks may take to report before they are killed
FAILURE_GRACE_S = 3.0


def failure_grace_s(collective_timeout_s: float | None) -> float:
    """How long to wait for the other ranks' reports after the first failure: a rank blocked
    in a collective that began after the first failed one times out up to one collective
    timeout later (capped at 30 s: torchrun's own grace), so one timeout + 1 s, at least
    ``FAILURE_GRACE_S``."""
    return max(FAILURE_GRACE_S, min(collective_timeout_s or 0.0, 30.0) + 1.0)


def name_process(rank: int) -> None:
    """Name this process ``mixmoe-rank<r>`` (``ps``, ``top``, ``pkill``-free tests find a rank
    by it); a no-op where /proc/self/comm is not writable."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(f"mixmoe-rank{rank}"[:15])
    except OSError:
        pass


def first_error_line(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, without gloo's ``[source/file.cc:123]`` prefix and
    its boilerplate advice, cut at ``limit`` characters."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically caused")[0]
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended badly: ``cause`` "raised" (its exception's first line in ``error``,
    the traceback in ``details``), "died" (exited without a result: a signal or a crash) or
    "stalled" (alive but silent after another rank failed, or past the deadline: killed).
    ``at``: wall-clock time it was seen."""

    rank: int
    cause: str
    error: str
    details: str
    at: float


def _order(failures: list[RankFailure]) -> list[RankFailure]:
    # a dead or stalled rank is the root cause the others' errors follow from; then by time
    return sorted(failures, key=lambda f: (f.cause == "raised", f.at, f.rank))


class RanksFailed(RuntimeError):
    """A multi-rank run failed. ``failures``: the failed ranks, the first failure first;
    ``user_lines``: one line per rank for a terminal (a command may append its own advice);
    ``str()``: every rank's traceback (``--debug``). ``local``: raised by one torchrun rank,
    which knows only its own failure."""

    def __init__(self, failures: list[RankFailure], local: bool = False) -> None:
        self.failures = _order(failures)
        self.local = local
        self.user_lines = self.rank_lines()
        super().__init__(
            "distributed run failed:\n"
            + "\n".join(f"--- rank {f.rank} ---\n{f.details or f.error}" for f in self.failures)
        )

    def rank_lines(self) -> list[str]:
        if self.local:
            return [f"rank {f.rank} stopped: {f.error}" for f in self.failures]
        first = self.failures[0]
        lines = [f"rank {first.rank} failed first: {first.error}"]
        lines += [
            f"rank {f.rank} stopped after rank {first.rank}: {f.error}" for f in self.failures[1:]
        ]
        return lines


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (a launcher killed
    by pid would otherwise leave its ranks training on as orphans); exit now if it is already
    gone. A no-op where prctl is unavailable."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child(
    rank, world_size, store_path, threads, pg_timeout_s, fn, args, results, parent_pid
) -> None:
    name_process(rank)
    die_with_parent(parent_pid)
    try:
        torch.set_num_threads(threads)
        comm = init_file_store(store_path, rank=rank, world_size=world_size, timeout_s=pg_timeout_s)
        out = fn(comm, *args)
        buf = io.BytesIO()  # plain bytes: tensors must not outlive this process as shared memory
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue(), time.time()))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, (first_error_line(e), traceback.format_exc()), time.time()))
        results.close()
        results.join_thread()  # the report is in the pipe
        os._exit(1)  # no teardown: destroying a group with a dead peer may block
    finally:
        shutdown_distributed()


def _died(rank: int, exitcode: int) -> RankFailure:
    if exitcode < 0:
        try:
            error = f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            error = f"killed by signal {-exitcode}"
    else:
        error = f"exited with code {exitcode} without a result"
    return RankFailure(rank, "died", error, "", time.time())


def spawn_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    threads: int = 1,
    pg_timeout_s: float | None = 120.0,
) -> list[Any]:
    """``[fn(comm_rank0, *args), ..., fn(comm_rankW-1, *args)]``; ``fn`` must be picklable
    (a module-level function). ``pg_timeout_s`` bounds every collective (a stalled rank makes
    the others raise after it). When a rank raises or dies, the others get
    ``failure_grace_s(pg_timeout_s)`` to report, then every rank still running is killed and
    ``RanksFailed`` (a RuntimeError with every rank's traceback) is raised: nothing waits for
    the ``timeout_s`` deadline, which only ends a run that hangs without any failure."""
    check_int("world_size", world_size, 1)
    check_int("threads", threads, 1)  # each rank's torch.set_num_threads: before any spawns
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    grace = failure_grace_s(pg_timeout_s)
    got: dict[int, tuple[bool, Any, float]] = {}
    dead: dict[int, RankFailure] = {}
    with tempfile.TemporaryDirectory(prefix="mixmoe-gloo-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    r,
                    world_size,
                    store_path,
                    threads,
                    pg_timeout_s,
                    fn,
                    args,
                    results,
                    os.getpid(),
                ),  # fmt: skip
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        grace_end = None
        all_seen = None  # when every rank had reported or died
        try:
            while len(got) < world_size:
                try:
                    rank, ok, value, at = results.get(timeout=0.2)
                    got[rank] = (ok, value, at)
                    dead.pop(rank, None)  # it reported before exiting
                    if not ok and grace_end is None:
                        grace_end = time.monotonic() + grace
                    continue
                except queue.Empty:
                    pass
                for r, p in enumerate(procs):
                    if r not in got and r not in dead and p.exitcode is not None:
                        dead[r] = _died(r, p.exitcode)  # unless its result is still in the pipe
                        if grace_end is None:
                            grace_end = time.monotonic() + grace
                now = time.monotonic()
                if all_seen is None and len(set(got) | set(dead)) == world_size:
                    all_seen = now
                # a dead rank's result may still be in the pipe: half a second for it
                if all_seen is not None and now > all_seen + 0.5:
                    break
                if (grace_end is not None and now > grace_end) or now > deadline:
                    break
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()  # SIGKILL: also ends a stopped (SIGSTOP) process
            for p in procs:
                p.join(timeout=5)
        while True:  # results that arrived while the loop was ending
            try:
                rank, ok, value, at = results.get_nowait()
            except queue.Empty:
                break
            got[rank] = (ok, value, at)
            dead.pop(rank, None)
    failures = list(dead.values())
    failures += [
        RankFailure(r, "raised", v[0], v[1], at) for r, (ok, v, at) in got.items() if not ok
    ]
    silent = sorted(set(range(world_size)) - set(got) - set(dead))
    if silent:
        why = (
            f"no answer within {grace:.0f} s of the first failure (stalled); killed"
            if failures
            else f"did not finish within {timeout_s:.0f} s; killed"
        )
        failures += [RankFailure(r, "stalled", why, "", time.time()) for r in silent]
    if failures:
        raise RanksFailed(failures)
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]


def _store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _terminated(signum, frame) -> None:
    raise RuntimeError("stopped by torchrun (SIGTERM): another rank failed")


def _publish_pid(comm: Communicator) -> None:
    """torchrun: tell the group's store where this rank runs (host and pid)."""
    try:
        _store().set(f"mixmoe/pid/{comm.rank}", f"{socket.gethostname()} {os.getpid()}")
    except Exception:  # noqa: BLE001 - a store without set: no clean-up of stalled peers
        pass


def _end_stalled_local_peers(comm: Communicator, grace_s: float) -> None:
    """torchrun, at the exit of a rank that failed: mark it failed in the store; after
    ``grace_s``, SIGKILL every rank of this host that has not failed too. A stalled
    (e.g. stopped) rank ignores torchrun's SIGTERM, which waits 30 s before its SIGKILL; the run
    is over anyway. Ranks on other hosts are left to torchrun."""
    try:
        store = _store()
        store.set(f"mixmoe/failed/{comm.rank}", "1")
        host = socket.gethostname()
        peers = {}  # rank -> pid of the other ranks on this host
        for r in range(comm.world_size):
            if r != comm.rank and store.check([f"mixmoe/pid/{r}"]):
                peer_host, pid = store.get(f"mixmoe/pid/{r}").decode().split()
                if peer_host == host:
                    peers[r] = int(pid)
        end = time.monotonic() + grace_s
        while peers and time.monotonic() < end:  # wait for each to fail or be gone
            peers = {
                r: pid
                for r, pid in peers.items()
                if not store.check([f"mixmoe/failed/{r}"]) and _alive(pid)
            }
            time.sleep(0.1)
        for pid in peers.values():  # silent past the grace: stalled
            os.kill(pid, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - best effort: torchrun ends them later
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


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
    pg_timeout_s: float | None = None,
) -> Any:
    """``rank_fn(comm, *args)`` on ``world_size`` ranks, for the commands with ``--world-size``:
    torchrun's group when launched by torchrun (the result on rank 0, None on the others),
    otherwise ``world_size`` gloo CPU processes spawned here (rank 0's result). ValueError when
    torchrun launched another number of ranks, or when spawning is asked for a GPU device."""
    if under_torchrun():
        from mixmoe.comm import init_distributed

        comm = init_distributed("auto", timeout_s=pg_timeout_s)
        name_process(comm.rank)
        _publish_pid(comm)
        try:  # torchrun SIGTERMs the others when a rank dies: tell it as this rank's error
            signal.signal(signal.SIGTERM, _terminated)
        except ValueError:  # not the main thread
            pass
        if comm.world_size != world_size:
            raise ValueError(
                f"--world-size {world_size} but torchrun launched {comm.world_size} ranks; "
                f"give --world-size {comm.world_size} (or leave it out)"
            )
        try:
            result = rank_fn(comm, *args)
        except (ValueError, TypeError):
            raise  # bad input: the same one-line error on every rank
        except Exception as e:  # noqa: BLE001 - told as this rank's one line
            failure = RankFailure(
                comm.rank, "raised", first_error_line(e), traceback.format_exc(), time.time()
            )
            try:  # torchrun SIGTERMs the survivors of a dead rank: print this rank's line first
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (it exits in seconds anyway)
            except ValueError:  # not the main thread
                pass
            grace = failure_grace_s(pg_timeout_s)
            atexit.register(_end_stalled_local_peers, comm, grace)  # after the line is printed
            raise RanksFailed([failure], local=True) from e
        return result if comm.rank == 0 else None
    if not device.startswith("cpu"):
        raise ValueError(
            f"--world-size spawns gloo CPU processes, not {device} ones; launch GPU runs with "
            f"torchrun (torchrun --nproc-per-node {world_size} -m {command})"
        )
    return spawn_gloo(
        rank_fn,
        world_size,
        *args,
        threads=threads,
        timeout_s=timeout_s,
        pg_timeout_s=120.0 if pg_timeout_s is None else pg_timeout_s,
    )[0]
