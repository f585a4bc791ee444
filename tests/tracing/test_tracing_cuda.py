"""The CUDA clock: spans are timed by CUDA events on the stream (device time, placed on the host
timeline), resolved only when the recorder is flushed. Tier 4: needs a CUDA device."""

from __future__ import annotations

import time

import pytest
import torch

from mixmoe.tracing import TraceRecorder, trace_span

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_events_time_device_work_not_host_launches() -> None:
    rec = TraceRecorder(rank=0, stage_id=0, device="cuda")
    torch.cuda._sleep(1000)  # warm the kernel up outside the trace
    torch.cuda.synchronize()
    before = time.perf_counter() * 1e3
    with rec.activate():
        with rec.op("forward_step", batch_id=0, mg_state="steady"):
            t0 = time.perf_counter()
            with trace_span("moe.experts"):
                torch.cuda._sleep(50_000_000)  # tens of ms of device time, returns at once
            host_ms = (time.perf_counter() - t0) * 1e3
    (op,) = rec.records()
    after = time.perf_counter() * 1e3
    (sub,) = op.sub_ops
    assert sub.duration_ms > 5.0 > host_ms  # the device ran long after the host moved on
    assert op.duration_ms >= sub.duration_ms
    assert op.start_ms <= sub.start_ms + 1e-3 and sub.timestamp_ms <= op.timestamp_ms + 1e-3
    # device times sit on the host perf_counter timeline (anchored once; ~0.1 ms slack)
    assert before - 1.0 <= op.start_ms and op.timestamp_ms <= after + 1.0
