"""Faults told plainly, through the command line as a user meets them: one rank of a 2- or
3-rank ``mixmoe train --world-size W`` is killed (SIGKILL) at a random step, or stopped
(SIGSTOP) so it hangs without dying. Every rank is gone within 10 s, the user reads one line per
rank and one with the last complete checkpoint and the command to resume (no traceback), the
step log holds every step finished before the kill, and ``--resume auto`` continues from the
last complete checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixmoe.train.outputs import read_log

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _argv(world: int, tmp: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "mixmoe", "train", "--model", "gpt2", "--preset", "tiny",
        "--seq-len", "16", "--batch-size", "6", "--world-size", str(world), "--num-experts", "6",
        "--save-dir", str(tmp / "ckpt"), "--save-every", "2", "--out", str(tmp / "run"),
        "--no-progress", "--eval-every", "0", "--collective-timeout", "3", *extra,
    ]  # fmt: skip


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _rank_pid(parent: int, rank: int, wait_s: float = 60.0) -> int:
    """The pid of the child of ``parent`` named ``mixmoe-rank<rank>``."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        for pid in children:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == f"mixmoe-rank{rank}":
                    return int(pid)
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under pid {parent}")


def _log_lines(tmp: Path) -> int:
    try:
        return len((tmp / "run" / "train.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _fault(world: int, victim: int, sig: int, after_steps: int, tmp: Path) -> dict:
    """Run until ``after_steps`` steps are logged, send ``sig`` to rank ``victim``; the exit
    code, the seconds from the signal to the end of EVERY rank, stderr's lines."""
    proc = subprocess.Popen(
        _argv(world, tmp, "--max-steps", "100000"),
        env=_env(), cwd=tmp, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pids = [_rank_pid(proc.pid, r) for r in range(world)]
        end = time.monotonic() + 120
        while _log_lines(tmp) < after_steps and time.monotonic() < end:
            time.sleep(0.05)
        logged_at_kill = _log_lines(tmp)
        t0 = time.monotonic()
        os.kill(pids[victim], sig)
        rc = proc.wait(timeout=60)
        while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < t0 + 30:
            time.sleep(0.05)  # the ranks (reaped by the launcher) are gone too
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    return {
        "rc": rc,
        "seconds": seconds,
        "lines": proc.stderr.read().strip().splitlines(),
        "logged_at_kill": logged_at_kill,
    }


def _check_told_plainly(out: dict, world: int, victim: int, what: str, tmp: Path) -> None:
    lines = out["lines"]
    assert out["rc"] == 1, out
    assert out["seconds"] < 10, out
    assert len(lines) == world + 1, lines  # one per rank + where to resume from
    assert all(line.startswith("mixmoe: ") for line in lines), lines
    assert not any("Traceback" in line for line in lines), lines
    assert lines[0] == f"mixmoe: rank {victim} failed first: {what}", lines
    others = sorted(int(line.split()[2]) for line in lines[1:-1])
    assert others == sorted(set(range(world)) - {victim}), lines
    assert f"last complete checkpoint: {tmp / 'ckpt'}/step-" in lines[-1], lines
    assert "--resume auto" in lines[-1], lines


def test_a_killed_rank_stops_every_rank_and_the_run_resumes(tmp_path):
    for world in (2, 3):
        tmp = tmp_path / f"w{world}"
        tmp.mkdir()
        victim, steps = random.randrange(world), random.randint(3, 6)
        out = _fault(world, victim, signal.SIGKILL, steps, tmp)
        _check_told_plainly(out, world, victim, "killed by signal SIGKILL", tmp)
        logged = [r["step"] for r in read_log(tmp / "run" / "train.jsonl")]
        assert logged == list(range(len(logged))) and len(logged) >= out["logged_at_kill"]
        if world == 3:
            continue
        last = max(int(p.name.split("-")[1]) for p in (tmp / "ckpt").glob("step-*"))
        argv = _argv(world, tmp, "--max-steps", str(last + 2), "--resume", "auto")
        done = subprocess.run(argv, env=_env(), cwd=tmp, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        again = [r["step"] for r in read_log(tmp / "run" / "train.jsonl")]
        # the killed run's steps intact, then the resumed run's from the checkpoint on
        assert again == logged + [last, last + 1], (again, logged, last)


def test_a_stopped_rank_is_found_by_the_collective_timeout(tmp_path):
    out = _fault(3, 1, signal.SIGSTOP, 3, tmp_path)
    # the grace after the first failure: one collective timeout (3 s) + 1 s
    what = "no answer within 4 s of the first failure (stalled); killed"
    _check_told_plainly(out, 3, 1, what, tmp_path)
