"""Low-overhead tracing for training loops and the MoE layer.

- ``trace_span(name, kind=..., ...)``: used by the layer around its stages; always a
  ``torch.profiler.record_function`` label, timed only while a recorder is active.
- ``TraceRecorder(rank, stage_id)``: ``activate()``, ``op(name, batch_id=..., mg_state=...)``,
  ``records()``, ``write_cmd(path)`` (CMD lines, FORMATS.md section 3, one file per rank).
- ``write_chrome_trace(paths_or_records, out_path)``: all ranks in one Chrome/Perfetto JSON.
- ``CmdOp`` / ``SubOp``: the records, shared with the readers in ``mixmoe.report``.

Submodules are loaded on first attribute access, so the torch-free ones (``cmd_format``) can be
imported by readers without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mixmoe.tracing.chrome import write_chrome_trace
    from mixmoe.tracing.cmd_format import CmdOp, SubOp
    from mixmoe.tracing.recorder import TraceRecorder
    from mixmoe.tracing.span import trace_span

__all__ = ["CmdOp", "SubOp", "TraceRecorder", "trace_span", "write_chrome_trace"]

_HOME = {
    "CmdOp": "mixmoe.tracing.cmd_format",
    "SubOp": "mixmoe.tracing.cmd_format",
    "TraceRecorder": "mixmoe.tracing.recorder",
    "trace_span": "mixmoe.tracing.span",
    "write_chrome_trace": "mixmoe.tracing.chrome",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'mixmoe.tracing' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
