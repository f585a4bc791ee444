"""TraceRecorder and trace_span on CPU: what is recorded where, and the CMD / Chrome writers."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mixmoe.formats.chrome import read_chrome_trace
from mixmoe.formats.cmd_trace import read_cmd_trace
from mixmoe.tracing import TraceRecorder, trace_span, write_chrome_trace


def _loop(rec: TraceRecorder, sleep_s: float = 0.002) -> None:
    with rec.activate():
        with rec.op("get_batch", batch_id=0, mg_state="steady"):
            time.sleep(sleep_s)
        with rec.op("forward_step", batch_id=0, mg_state="steady"):
            with trace_span("moe.gate", kind="compute"):
                time.sleep(sleep_s)
            x = torch.randn(6, 4)
            with trace_span(
                "moe.dispatch",
                kind="comm",
                comm_func="all_to_all",
                group="exp",
                shape=tuple(x.shape),
                dtype=x.dtype,
                in_splits=torch.tensor([2, 4]),
                out_splits=[5, 1],
            ):
                time.sleep(sleep_s)
        with trace_span("moe.plan", kind="host"):  # outside any op
            pass


def test_ops_and_spans_are_recorded_with_their_metadata() -> None:
    rec = TraceRecorder(rank=3, stage_id=1, device="cpu")
    t0 = time.perf_counter() * 1e3
    _loop(rec)
    t1 = time.perf_counter() * 1e3
    ops = rec.records()
    assert [op.name for op in ops] == ["get_batch", "forward_step", "moe.plan"]
    get_batch, fwd, plan = ops
    assert all(op.rank == 3 and op.stage_id == 1 for op in ops)
    assert get_batch.duration_ms >= 2.0 and fwd.duration_ms >= 4.0
    assert (
        t0 <= get_batch.start_ms < get_batch.timestamp_ms <= fwd.start_ms < fwd.timestamp_ms <= t1
    )
    gate, dispatch = fwd.sub_ops
    assert (gate.name, gate.kind, gate.comm_func) == ("moe.gate", "compute", None)
    assert dispatch.comm_func == "all_to_all" and dispatch.group == "exp"
    assert dispatch.shape == (6, 4) and dispatch.dtype == "torch.float32"
    assert dispatch.in_splits == (2, 4) and dispatch.out_splits == (5, 1)
    # sub-operations lie inside their op, in order
    assert fwd.start_ms <= gate.start_ms < gate.timestamp_ms <= dispatch.start_ms
    assert dispatch.timestamp_ms <= fwd.timestamp_ms
    assert gate.duration_ms >= 2.0 and dispatch.duration_ms >= 2.0
    # a span outside any op is an op holding itself
    assert plan.sub_ops[0].name == "moe.plan" and plan.duration_ms == plan.sub_ops[0].duration_ms
    assert rec.records() == ops  # flushing twice neither loses nor duplicates


def test_nothing_is_recorded_without_an_active_recorder() -> None:
    rec = TraceRecorder(rank=0, device="cpu")
    with trace_span("moe.gate"):
        pass
    with rec.activate():
        pass
    with trace_span("moe.gate"):
        pass
    assert rec.records() == []


def test_recorder_is_per_thread() -> None:
    """ContextVar: a thread without its own activation records nothing into ours."""
    rec = TraceRecorder(rank=0, device="cpu")
    other = TraceRecorder(rank=1, device="cpu")

    def worker() -> None:
        with trace_span("thread.unrecorded"):
            pass
        with other.activate(), trace_span("thread.recorded"):
            pass

    with rec.activate():
        with rec.op("forward_step", batch_id=0):
            thread = threading.Thread(target=worker)
            thread.start()
            thread.join()
            with trace_span("main.span"):
                pass
    assert [s.name for op in rec.records() for s in op.sub_ops] == ["main.span"]
    assert [op.name for op in other.records()] == ["thread.recorded"]


def test_user_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="kind='cmm'"):
        trace_span("x", kind="cmm")
    with pytest.raises(ValueError, match="rank=-1"):
        TraceRecorder(rank=-1)
    rec = TraceRecorder(rank=0, device="cpu")
    with pytest.raises(ValueError, match="CMD ops are flat"):
        with rec.activate(), rec.op("forward_step"), rec.op("send_forward"):
            pass
    with pytest.raises(ValueError, match="pass kind='comm'"):
        with rec.activate(), trace_span("x", comm_func="all_to_all"):
            pass


def test_spans_are_record_function_labels_even_when_not_tracing() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with trace_span("moe.experts"):
            torch.randn(8, 8) @ torch.randn(8, 8)
    names = {e.key for e in prof.key_averages()}
    assert "moe.experts" in names


def test_cmd_and_chrome_files_load_back_with_the_same_durations(tmp_path) -> None:
    recs = [TraceRecorder(rank=r, device="cpu") for r in (0, 1)]
    for rec in recs:
        _loop(rec, sleep_s=0.001)
    paths = [rec.write_cmd(tmp_path / f"rank{rec.rank}.txt") for rec in recs]
    chrome = write_chrome_trace(paths, tmp_path / "trace.json")
    from_records = write_chrome_trace(recs, tmp_path / "trace2.json")
    assert json.loads(chrome.read_text()) == json.loads(from_records.read_text())
    back = read_chrome_trace(chrome)
    for rec, path in zip(recs, paths, strict=True):
        want = rec.records()
        got = read_cmd_trace(path)
        got_chrome = [op for op in back if op.rank == rec.rank]
        assert [op.name for op in got] == [op.name for op in want] == [op.name for op in got_chrome]
        for w, g, c in zip(want, got, got_chrome, strict=True):
            assert g.duration_ms == pytest.approx(w.duration_ms, abs=1e-6)
            assert g.timestamp_ms == pytest.approx(w.timestamp_ms, abs=1e-6)
            assert c.duration_ms == pytest.approx(w.duration_ms, abs=2e-6)
            assert c.timestamp_ms == pytest.approx(w.timestamp_ms, abs=2e-6)
            assert [s.in_splits for s in c.sub_ops] == [s.in_splits for s in w.sub_ops]
            for ws, gs in zip(w.sub_ops, g.sub_ops, strict=True):
                assert gs.duration_ms == pytest.approx(ws.duration_ms, abs=1e-6)
                assert (gs.name, gs.shape, gs.out_splits) == (ws.name, ws.shape, ws.out_splits)
    events = json.loads(chrome.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    comm = [e for e in events if e.get("cat") == "mixmoe.sub" and e["name"] == "moe.dispatch"]
    assert len(comm) == 2 and all(e["tid"] == 2 and e["ph"] == "X" for e in comm)
    with pytest.raises(ValueError, match="rank 0 appears in sources 0 and 1"):
        write_chrome_trace([paths[0], paths[0]], tmp_path / "dup.json")
