"""``scripts/rows_tradeoff.py`` (what leveling the rows computed per rank costs ``mix``'s step)
still runs, starts from the plan ``bench balance`` reports, and refuses bad input in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixmoe.simulate.workloads import BalanceConfig, case_records

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/rows_tradeoff.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_rows_tradeoff_starts_from_bench_balance_plan() -> None:
    proc = _run("--cases", "deepseek:8:hotrank:0.5", "--speedups", "1,2,10000",
                "--tolerances", "0,0.5")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == ["deepseek", "8", "hotrank:0.5"]
    rows, step, within0, within50 = map(float, cells[3:7])
    # k = 1 is the plan bench balance reports for the case (another path to the same plan)
    cfg = BalanceConfig(shapes=("deepseek",), worlds=(8,), workloads=("hotrank:0.5",),
                        strategies=("mix",), repeats=1, cold=False)  # fmt: skip
    (record,) = case_records(cfg, "deepseek", 8, "hotrank:0.5")
    assert rows == pytest.approx(record["imbalance"], abs=0.006)
    assert step == pytest.approx(record["step_ms"], abs=0.0006)
    # the plans within a larger tolerance include those within a smaller one
    assert within50 <= within0 <= rows
    # links 10**4 times faster plan as if transfers were free: the rows level, the step rises
    last, change = cells[7].split()
    assert float(last) < rows and float(change.strip("(%)")) > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--cases", "seeds:8"), "is not shape:W:workload"),
        (("--cases", "bogus:8:zipf:1.2"), "shape 'bogus' is unknown"),
        (("--cases", "seeds:8:bogus"), "workload 'bogus' is not understood"),
        (("--speedups", "2,4"), "--speedups must start at 1"),
        (("--tolerances", "x"), "--tolerances must be comma-separated numbers"),
        (("--profile", "nope"), "profile 'nope'"),
    ],
)
def test_rows_tradeoff_refuses_bad_input(argv: tuple[str, ...], needle: str) -> None:
    proc = _run(*argv)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert needle in proc.stderr and "Traceback" not in proc.stderr
