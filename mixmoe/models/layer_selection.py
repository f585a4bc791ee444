"""Which blocks of a model get a MoE FFN: ``"all"``, ``"every:N"`` or a list of block indices.

``"every:N"`` selects every N-th block counting from the first: the N-th, 2N-th, ... (0-based
indices N-1, 2N-1, ...; DeepSpeed's ``expert_interval``), so ``"every:2"`` is the odd blocks
1, 3, 5, ... as in GShard and Switch, and ``"every:1"`` is all of them. The same strings work on
the command line (``"0,3"`` is a list).
"""

from __future__ import annotations

from collections.abc import Sequence

LayerSpec = str | Sequence[int]

_FORMS = "use 'all', 'every:N' (N >= 1) or a list of block indices such as [0, 3] or '0,3'"


def select_layers(spec: LayerSpec, num_blocks: int) -> tuple[int, ...]:
    """Sorted block indices in ``range(num_blocks)`` chosen by ``spec``."""
    if isinstance(spec, bool) or isinstance(spec, int):
        raise TypeError(f"layers={spec!r} is ambiguous; {_FORMS}")
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "all":
            return tuple(range(num_blocks))
        if text.startswith("every:"):
            try:
                n = int(text.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"layers={spec!r} is not understood; {_FORMS}") from None
            if n < 1:
                raise ValueError(f"layers={spec!r}: N must be >= 1; {_FORMS}")
            if n > num_blocks:
                raise ValueError(
                    f"layers={spec!r} selects no block of a model with {num_blocks} blocks; "
                    f"use every:N with N <= {num_blocks}"
                )
            return tuple(range(n - 1, num_blocks, n))
        try:
            indices = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"layers={spec!r} is not understood; {_FORMS}") from None
    else:
        indices = list(spec)
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"layers={spec!r} holds {i!r}, not an int; {_FORMS}")
    if not indices:
        raise ValueError(f"layers={spec!r} selects no block; {_FORMS}")
    bad = [i for i in indices if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(
            f"layers={spec!r}: block indices {bad} are out of range for a model with "
            f"{num_blocks} blocks; use indices 0..{num_blocks - 1}"
        )
    if len(set(indices)) != len(indices):
        raise ValueError(f"layers={spec!r} repeats a block; list each block once")
    return tuple(sorted(indices))
