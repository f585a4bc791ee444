"""The model benchmark log (docs/formats.md section 2): reader and writer. Torch-free.

::

    STEP-0: step_time = 990.000000 ms, foward_time = 800.000000, backward_time = 190.000000
    ...

     mix_moe bert 16 [Summary] Average synchronized step_time = 205.5 ms,

The STEP lines are the layer log's without ``perf``, so the reader is the layer log's
(``mixmoe.formats.layer_log.parse_runs``) with the summary prefix read as
``<variant> <model> <num_local_experts>``.
"""

from __future__ import annotations

import os

from mixmoe.formats.layer_log import BenchRun, group_runs, parse_runs

__all__ = ["read_model_log", "step_line", "summary_line"]


def read_model_log(path: str | os.PathLike[str]) -> dict[tuple, tuple[BenchRun, ...]]:
    """Model runs grouped by ``(variant, model, num_local_experts)`` in order of first appearance.
    Raises ValueError if the file has no steps or summaries."""
    runs = parse_runs(path, "model")
    if not runs:
        raise ValueError(f"{os.fspath(path)}: no benchmark steps or summaries found")
    return group_runs(runs)


def step_line(step: int, step_ms: float, fwd_ms: float, bwd_ms: float) -> str:
    """``STEP-<i>: step_time = X ms, foward_time = F, backward_time = B`` (typo on purpose)."""
    return (
        f"STEP-{step}: step_time = {step_ms:.6f} ms, foward_time = {fwd_ms:.6f}, "
        f"backward_time = {bwd_ms:.6f}"
    )


def summary_line(variant: str, model: str, num_local_experts: int, step_ms: float) -> str:
    """Starts with a newline (the blank line) and a space, as in the wild."""
    return (
        f"\n {variant} {model} {num_local_experts} [Summary] Average synchronized step_time = "
        f"{step_ms:g} ms,"
    )
