"""Checks shared by every configuration (layer, benchmarks, CLI): one rule per question.

Each check raises ``TypeError``/``ValueError`` naming the value and the fix, so a bad setting fails
where it was written. Torch is imported only by the checks that need it (``torch_dtype``,
``check_device``), so configurations stay importable without it.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

__all__ = [
    "BLOCK_SIZES",
    "DTYPE_NAMES",
    "check_block_size",
    "check_bool",
    "check_choice",
    "check_device",
    "check_dtype",
    "check_float",
    "check_int",
    "check_str",
    "torch_dtype",
]

# the schedule's block sizes the kernels are built and tested for
BLOCK_SIZES = (16, 32, 64, 128)
# accepted spelling -> torch dtype name
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def check_float(name: str, value: object, lo: float = 0.0) -> None:
    """``value`` a finite number >= ``lo`` (NaN and inf rejected: ``--lr inf`` trained to a
    NaN loss without a word)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    if not value >= lo:  # also rejects NaN
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if value == math.inf:
        raise ValueError(f"{name} must be finite, got {value}")


def check_plan_ahead(plan_ahead: object, strategy: str, fix: str) -> None:
    """``plan_ahead`` (``MoEConfig.plan_ahead`` set from outside a layer): a bool, and only
    with the strategy that plans (``mix``); ``fix``: the caller's way to turn it off."""
    if not isinstance(plan_ahead, bool):
        raise TypeError(f"plan_ahead must be True or False, got {plan_ahead!r}")
    if plan_ahead and strategy != "mix":
        raise ValueError(
            f"plan_ahead plans the mixed strategy a step ahead; strategy {strategy!r} has no "
            f"plan: use strategy 'mix', or {fix}"
        )


def check_bool(name: str, value: object) -> None:
    """``value`` is True or False (a NaN or 1 passed for a flag reads as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_str(name: str, value: object, *, none: bool = False) -> None:
    """``value`` is a str (a name or a path; ``none``: or None)."""
    if not (isinstance(value, str) or (none and value is None)):
        raise TypeError(f"{name} must be a string{' or None' if none else ''}, got {value!r}")


def check_choice(name: str, value: object, choices: Collection[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name} {value!r} is unknown; use one of {sorted(choices)}")


def check_block_size(block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}; got {block_size}"
        )


def check_dtype(name: str) -> None:
    check_choice("dtype", name, DTYPE_NAMES)


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of an accepted spelling (``bf16`` -> ``torch.bfloat16``)."""
    import torch

    check_dtype(name)
    return getattr(torch, DTYPE_NAMES[name])


def check_device(text: str) -> None:
    """``text`` names a device this torch can use now (``cpu``, ``cuda``, ``cuda:N``)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {text!r} is not understood; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"device {text!r}: mixmoe runs on cpu or cuda; use one of them")
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"device {text!r}: CUDA is not available ({why}); use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"device {text!r}: only {count} CUDA device(s) are visible; use cuda:0..cuda:{count - 1}"
        )
