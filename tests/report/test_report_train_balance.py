"""Balance metrics of training runs: the dead-expert window, reading runs back from a
``train.jsonl`` (several runs appended), the per-layer table and the heat-map.

Legend: N experts.
"""

from __future__ import annotations

import json

import pytest
import torch

from mixmoe.formats.train_log import is_train_log, read_train_runs
from mixmoe.report.load_balance import balance_rows, plot_load_heatmap
from mixmoe.train.balance_log import BalanceLog
from mixmoe.types import LoadRecord


def _rec(load, bias=None) -> LoadRecord:
    lo, hi = (None, None) if bias is None else bias
    return LoadRecord(torch.tensor(load), forwards=1, replicas=2, bias_min=lo, bias_max=hi)


def test_dead_experts_over_the_window():
    log = BalanceLog(window=2)
    (a,) = log.step([("l", _rec([3, 0, 1, 0]))])
    assert a["dead"] == 2 and a["max_over_mean"] == 3.0 and a["replicas"] == 2
    (b,) = log.step([("l", _rec([0, 0, 4, 0]))])
    assert b["dead"] == 2  # experts 1 and 3 saw no row in the last 2 steps
    (c,) = log.step([("l", _rec([0, 0, 0, 4]))])
    assert c["dead"] == 2  # expert 0's step fell out of the window; 3 revived
    with pytest.raises(ValueError, match="window must be >= 1"):
        BalanceLog(window=0)


def _write(path, runs):
    with open(path, "w") as f:
        for config, steps in runs:
            for step, loads in steps:
                log = BalanceLog()
                moe = log.step([("h.0", _rec(loads, (-0.01, 0.02)))])
                line = {"kind": "train", "config": config, "step": step, "loss": 1.0 / (step + 1)}
                f.write(json.dumps({**line, "eval_loss": None, "moe": list(moe)}) + "\n")
        f.write("\n")


def test_runs_table_and_heatmap(tmp_path):
    path = tmp_path / "train.jsonl"
    _write(
        path,
        [
            ({"model": "deepseek"}, [(0, [6, 2, 0, 0]), (1, [4, 2, 2, 0]), (2, [2, 2, 2, 2])]),
            ({"model": "deepseek"}, [(0, [1, 1, 1, 1])]),  # appended: a new run
        ],
    )
    assert is_train_log(path)
    runs = read_train_runs(path)
    assert [len(r) for r in runs] == [3, 1]
    (row,) = balance_rows(runs[0])
    assert row[:6] == ["h.0", 3, "3.000", "2.000", "1.000", "0.000"]
    assert row[7:] == ["2.0", "[-0.0100, +0.0200]"]
    png = plot_load_heatmap(runs[0], tmp_path / "h.png", "t")
    assert png.stat().st_size > 1000
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "train", "step": 0}\n{oops\n{"kind": "train", "step": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        read_train_runs(bad)
    torn = tmp_path / "torn.jsonl"  # a run killed while writing its last line: skipped
    torn.write_text('{"kind": "train", "step": 0}\n{"kind": "train", "st')
    assert [[r["step"] for r in run] for run in read_train_runs(torn)] == [[0]]
