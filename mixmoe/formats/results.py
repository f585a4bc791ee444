"""Benchmark results on disk: JSONL records, each with the environment it was measured in.

torch-free at import, like the rest of ``formats``: ``environment`` imports torch when called
(its callers pass a ``torch.device``)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: torch.device) -> dict[str, Any]:
    """Python, torch, Triton, platform, threads, device (GPU name and CUDA on GPU), git commit."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "git_commit": _git_commit(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def append_jsonl(
    path: str | os.PathLike[str],
    kind: str,
    config: Mapping[str, Any],
    device: torch.device,
    records: Iterable[Mapping[str, Any]],
) -> Path:
    """Append one line per record: ``{"kind", "config", "environment", **record}``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    with open(out, "a") as f:
        for r in records:
            line = {"kind": kind, "config": dict(config), "environment": env, **r}
            f.write(json.dumps(line) + "\n")
    return out
