"""Lazy, headless matplotlib for the report plots (an optional dependency)."""

from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend.

    Raises ImportError with the install command when matplotlib is missing.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plots need matplotlib: pip install 'mixmoe[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt
