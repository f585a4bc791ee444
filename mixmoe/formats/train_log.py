"""Reading ``mixmoe train``'s ``train.jsonl`` (torch-free): one JSON object per optimizer step,
``{"kind": "train", "config", "environment", "step", "loss", ..., "moe": [per-layer dicts]}``
(``mixmoe.train.outputs``, ``mixmoe.train.balance_log``). Runs are appended to the same file;
a run ends where the config changes or the step number does not increase.
"""

from __future__ import annotations

import json
import os
from typing import Any


def is_train_log(path: str | os.PathLike[str]) -> bool:
    """Whether the file's first non-blank line is a ``"kind": "train"`` JSON record."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and first.get("kind") == "train"
    return False


def read_train_runs(path: str | os.PathLike[str]) -> list[list[dict[str, Any]]]:
    """The runs of a ``train.jsonl``, each a list of step records in file order. Lines that are
    not train records (blank, other kinds) are skipped, and so is a torn LAST line (the run was
    killed while writing it: the log is streamed); any other broken JSON line raises
    ValueError naming the line."""
    runs: list[list[dict[str, Any]]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    for i, (n, line) in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # a run killed while writing its last line
                break
            raise ValueError(
                f"{path}:{n}: not a JSON line ({e.msg}); is it a train.jsonl?"
            ) from None
        if not isinstance(rec, dict) or rec.get("kind") != "train":
            continue
        prev = runs[-1][-1] if runs else None
        if prev is None or rec.get("config") != prev.get("config") or rec["step"] <= prev["step"]:
            runs.append([])
        runs[-1].append(rec)
    return runs
