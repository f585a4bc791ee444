"""Routing count files: the count matrices C [W, N] of recorded steps (JSON, torch-free).

Legend: W ranks, N experts, C[s][g] = rows (token x choice) rank s routed to expert g.

Written by ``mixmoe bench layer --save-counts`` (the counts of the run's first forward on every
rank) and read by ``mixmoe simulate --routing counts:PATH``. One JSON object::

    {"format": "mixmoe-counts", "version": 1, "world_size": W, "num_experts": N,
     "steps": [C_step0, C_step1, ...],          # each a list of W lists of N ints
     "source": "what recorded them", "config": {...}}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "read_counts", "write_counts"]

FORMAT = "mixmoe-counts"
VERSION = 1


def _check_steps(steps: Sequence[Sequence[Sequence[int]]], where: str) -> tuple[int, int]:
    if not steps:
        raise ValueError(f"{where}: no count matrix (steps is empty)")
    W = len(steps[0])
    N = len(steps[0][0]) if W else 0
    if W < 1 or N < 1:
        raise ValueError(f"{where}: a count matrix must be [W][N] with W, N >= 1")
    for i, C in enumerate(steps):
        if len(C) != W or any(len(row) != N for row in C):
            raise ValueError(f"{where}: step {i} is not a [{W}][{N}] matrix like step 0")
        for s, row in enumerate(C):
            for g, c in enumerate(row):
                if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                    raise ValueError(
                        f"{where}: step {i} C[{s}][{g}] = {c!r} is not a non-negative int"
                    )
    return W, N


def write_counts(
    path: str | os.PathLike[str],
    steps: Sequence[Sequence[Sequence[int]]],
    *,
    source: str,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """Write the count matrices ``steps`` (each [W][N] ints) to ``path``."""
    W, N = _check_steps(steps, os.fspath(path))
    record = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": W,
        "num_experts": N,
        "steps": [[list(map(int, row)) for row in C] for C in steps],
        "source": source,
        "config": dict(config or {}),
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record) + "\n")
    return out


def read_counts(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked object of a counts file (``steps``, ``world_size``, ``num_experts``, ...).
    ``FileNotFoundError`` for a missing file, ``ValueError`` naming the file for anything else."""
    where = os.fspath(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"counts file {where!r} does not exist; record one with `mixmoe bench layer "
            f"--save-counts {where}`"
        ) from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"counts file {where!r} is not JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(
            f'counts file {where!r} is not a mixmoe counts file (no "format": "{FORMAT}")'
        )
    W, N = _check_steps(record.get("steps") or [], where)
    if (record.get("world_size"), record.get("num_experts")) != (W, N):
        raise ValueError(f"counts file {where!r}: world_size / num_experts disagree with steps")
    return record
