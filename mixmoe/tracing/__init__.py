"""Low-overhead tracing for training loops and the MoE layer.

- ``trace_span(name, kind=..., ...)``: used by the layer around its stages; always a
  ``torch.profiler.record_function`` label, timed only while a recorder is active.
- ``TraceRecorder(rank, stage_id)``: ``activate()``, ``op(name, batch_id=..., mg_state=...)``,
  ``records()``, ``write_cmd(path)`` (CMD lines, docs/formats.md section 3, one file per rank).
- ``write_chrome_trace(paths_or_records, out_path)``: all ranks in one Chrome/Perfetto JSON.
- ``CmdOp`` / ``SubOp``: the records; they and both file formats live in ``mixmoe.formats``
  (torch-free), re-exported here for convenience.

Submodules are loaded on first attribute access: importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mixmoe.formats.chrome import write_chrome_trace
    from mixmoe.formats.cmd_trace import CmdOp, SubOp
    from mixmoe.tracing.recorder import TraceRecorder
    from mixmoe.tracing.span import trace_span

__all__ = ["CmdOp", "SubOp", "TraceRecorder", "trace_span", "write_chrome_trace"]

_HOME = {
    "CmdOp": "mixmoe.formats.cmd_trace",
    "SubOp": "mixmoe.formats.cmd_trace",
    "TraceRecorder": "mixmoe.tracing.recorder",
    "trace_span": "mixmoe.tracing.span",
    "write_chrome_trace": "mixmoe.formats.chrome",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'mixmoe.tracing' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
