"""``scripts/ahead_pipeline.py`` (``plan_ahead``'s planning threads in a model of L layers,
docs/results/2026-11-27-ahead-thread.md) still runs: one table row per L, with its figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ahead_pipeline_prints_a_row_per_layer_count() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = ["--world", "8", "--experts", "64", "--layers", "1,3", "--iterations", "4"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/ahead_pipeline.py"), *argv, "--device", "busy"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[1].split()[:3] == ["L", "wait", "median"]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        wait_median, wait_max, host, step = map(float, r[1:5])
        assert 0 <= wait_median <= wait_max and host >= wait_median and step > 0
        assert r[5].endswith("%")
