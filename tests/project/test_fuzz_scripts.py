"""The fuzz scripts (``scripts/fuzz``, docs/testing.md) still run: a few cases each, 0 failed; and
the planner's checks report a planted broken guarantee (the a2a fallback under nodes removed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

import mixmoe.placement.planner as planner

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_planner_fuzz_runs_clean() -> None:
    proc = _run(str(ROOT / "scripts/fuzz/planner.py"), "3", "24")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "seed 3: 24 cases, 0 failed"


def test_layer_fuzz_runs_clean() -> None:
    proc = _run(str(ROOT / "scripts/fuzz/layer_ranks.py"), "5", "2", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "seed 5, W=2: 6 cases, 0 failed"


def test_modern_fuzz_runs_clean() -> None:
    proc = _run(str(ROOT / "scripts/fuzz/modern_ranks.py"), "5", "3", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "seed 5, W=3: 6 cases, 0 failed"


def test_planner_fuzz_reports_a_broken_guarantee(monkeypatch, tmp_path) -> None:
    """The regression case of ``test_never_slower_than_a2a_when_the_repriced_candidate_costs_more``
    through the script's checks, with the Python planner's fallback planted away (the compiled
    planner off, so both twins are the planted Python)."""
    spec = importlib.util.spec_from_file_location("fuzz_planner", ROOT / "scripts/fuzz/planner.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    C = torch.tensor([
        [152, 216, 35, 247, 3796, 160, 140, 30, 38, 286, 35, 159],
        [9, 298, 95, 201, 254, 52, 73, 295, 4, 216, 78, 239],
        [129, 184, 249, 72, 56, 200, 223, 48, 254, 159, 292, 231],
    ])  # fmt: skip
    shape = fuzz.LayerShape(1024, 512, 4, 3, 2)
    knobs = {"overlap": True, "search_width": 1, "block_size": 16, "balance": True}
    two = fuzz.dataclasses.replace(fuzz.NODES, ranks_per_node=2)
    fuzz.check(C, shape, 1, knobs, two)  # passes as built
    monkeypatch.setenv(fuzz.native_lib.ENV_OFF, "0")
    monkeypatch.setattr(planner, "_no_worse", lambda best: best)
    try:
        fuzz.check(C, shape, 1, knobs, two)
    except AssertionError as e:
        assert "slower than a2a" in str(e)
    else:
        raise AssertionError("the fuzz missed a plan slower than a2a")
