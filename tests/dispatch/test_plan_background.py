"""The ``mix`` dispatcher's background plan on one rank (``LocalCommunicator``): the plan span
overlaps the own rows' compute in the trace, what the step waited for the plan is recorded
(``MoEAux.plan_wait_ms``, ``moe.plan.wait``) with and without ``plan_ahead``, a planner error surfaces
on the caller and leaves the dispatcher usable, the thread is started lazily and shut down, and
the layer still copies."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import pytest
import torch

import mixmoe.dispatch.expert_parallel as expert_parallel
from mixmoe import MoE, MoEConfig
from mixmoe.comm import LocalCommunicator
from mixmoe.formats.chrome import TID_COMPUTE, TID_HOST, chrome_trace_events
from mixmoe.parallel import parallelize_moe
from mixmoe.tracing import TraceRecorder

WAIT_S = 30.0  # only reached if planning were not concurrent (then the test fails, not hangs)


def _layer(plan_async: bool = True) -> MoE:
    torch.manual_seed(0)
    config = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, plan_async=plan_async)
    return parallelize_moe(MoE(config, dtype=torch.float64), LocalCommunicator(), "mix")


def _x(T: int = 40) -> torch.Tensor:
    return torch.randn(T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(T))


def _wrap_planner(layer, wrap) -> None:
    """The layer's planner replaced by one returning ``wrap(plan)``, ``plan()`` making the real
    planner's plan of the step's counts (on whichever thread calls it)."""
    real = layer.dispatcher.spec.planner

    def planner(C, shape, profile, config, sums=None):
        return wrap(lambda: real(C, shape, profile, config, sums=sums))

    layer.dispatcher.spec = dataclasses.replace(layer.dispatcher.spec, planner=planner)


def _own_rows_signal(monkeypatch, after: threading.Event | None = None) -> threading.Event:
    """The dispatcher's own-rows compute patched to wait for ``after`` (when given), run, then
    set the event returned."""
    done, real_run_work = threading.Event(), expert_parallel.run_work

    def run_work(*args, **kwargs):
        if after is not None:
            assert after.wait(WAIT_S), "the plan did not start before the own rows"
        out = real_run_work(*args, **kwargs)
        done.set()
        return out

    monkeypatch.setattr(expert_parallel, "run_work", run_work)
    return done


def test_plan_span_overlaps_the_own_rows_compute(monkeypatch) -> None:
    """Made deterministic with two events: the own rows start only once the plan has started,
    and the plan ends only once the own rows are done. A synchronous plan would wait for the own
    rows forever (here: WAIT_S, then fail)."""
    layer = _layer()
    plan_started = threading.Event()
    own_done = _own_rows_signal(monkeypatch, after=plan_started)
    planner_threads = []

    def wrap(plan):
        planner_threads.append(threading.current_thread().name)
        plan_started.set()
        assert own_done.wait(WAIT_S), "the own rows were not computed while the plan ran"
        return plan()

    _wrap_planner(layer, wrap)
    rec = TraceRecorder(rank=0, device="cpu")
    with rec.activate(), rec.op("forward_step", batch_id=0):
        y, _ = layer(_x())
    layer.dispatcher.close()
    assert planner_threads and planner_threads[0].startswith("mixmoe-plan")
    subs = rec.records()[0].sub_ops
    plan = [s for s in subs if s.name == "moe.plan"]
    own = [s for s in subs if s.name == "moe.experts_local"]
    assert len(plan) == 1 and plan[0].kind == "host"
    assert own, [s.name for s in subs]  # the own rows' span (recorded by the main thread)
    assert plan[0].start_ms < own[0].start_ms < own[0].timestamp_ms < plan[0].timestamp_ms
    assert y.isfinite().all()
    # in Chrome / Perfetto the plan has a track of its own beside the compute
    events = chrome_trace_events(rec.records())
    tid = {e["name"]: e["tid"] for e in events if e.get("cat") == "mixmoe.sub"}
    assert tid["moe.plan"] == TID_HOST and tid["moe.experts_local"] == TID_COMPUTE


PLAN_S = 0.3  # the slow planner below: its sleep after the step could have started waiting


def _waits(rec: TraceRecorder) -> list:
    return [s for r in rec.records() for s in r.sub_ops if s.name == "moe.plan.wait"]


def test_the_wait_for_a_slow_plan_is_recorded(monkeypatch) -> None:
    """The plan ends PLAN_S after the own rows are done: the step waits at least ~that long,
    in its stats and in a host span after the own rows' (the plan's unhidden part)."""
    layer = _layer()
    own_done = _own_rows_signal(monkeypatch)

    def wrap(plan):
        assert own_done.wait(WAIT_S), "the own rows were not computed while the plan ran"
        time.sleep(PLAN_S)
        return plan()

    _wrap_planner(layer, wrap)
    rec = TraceRecorder(rank=0, device="cpu")
    with rec.activate(), rec.op("forward_step", batch_id=0):
        _, aux = layer(_x())
    layer.dispatcher.close()
    waited_ms = aux.plan_wait_ms
    assert PLAN_S * 1e3 / 3 <= waited_ms < WAIT_S * 1e3, waited_ms
    (wait,) = _waits(rec)
    own = [s for s in rec.records()[0].sub_ops if s.name == "moe.experts_local"]
    assert wait.kind == "host" and own[0].timestamp_ms <= wait.start_ms
    assert wait.timestamp_ms - wait.start_ms == pytest.approx(waited_ms, abs=5.0)


def test_plan_ahead_records_the_wait_for_the_step_befores_plan() -> None:
    """Under plan_ahead the first step plans its own counts here and the second fits that plan
    (no wait), starting its own counts' plan on the thread; the third, called at once, waits for
    that plan (PLAN_S of it); the fourth, called once the third's plan is done (the layer's other
    work hid it), waits for nothing."""
    torch.manual_seed(0)
    config = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, plan_async=True, plan_ahead=True)
    layer = parallelize_moe(MoE(config, dtype=torch.float64), LocalCommunicator(), "mix")
    planned = threading.Semaphore(0)  # released by each plan made on the thread

    def wrap(plan):
        on_thread = threading.current_thread().name.startswith("mixmoe-plan")
        if on_thread:
            time.sleep(PLAN_S)
        made = plan()
        if on_thread:
            planned.release()
        return made

    _wrap_planner(layer, wrap)
    x = _x()
    rec = TraceRecorder(rank=0, device="cpu")
    with rec.activate(), rec.op("forward_step", batch_id=0):
        auxes = [layer(x)[1] for _ in range(3)]  # back to back
    assert [a.stats["plan_fitted"] for a in auxes] == [False, True, True]
    assert auxes[0].plan_wait_ms == 0.0  # nothing asked of the thread yet
    assert auxes[1].plan_wait_ms < PLAN_S * 1e3 / 3  # the first step's plan, made here
    assert PLAN_S * 1e3 / 3 <= auxes[2].plan_wait_ms < WAIT_S * 1e3
    assert len(_waits(rec)) == 2  # the fitting steps' (the first made its plan here)
    assert planned.acquire(timeout=WAIT_S) and planned.acquire(timeout=WAIT_S)
    fourth = layer(x)[1]  # the third step's plan is done: nothing left to wait for
    layer.dispatcher.close()
    assert fourth.stats["plan_fitted"] and fourth.plan_wait_ms < PLAN_S * 1e3 / 3


class PlanError(ValueError):
    pass


def test_a_planner_error_reaches_the_caller_and_the_next_step_plans_again() -> None:
    layer, x = _layer(), _x()
    with torch.no_grad():
        want = layer(x)[0]
    spec = layer.dispatcher.spec

    def planner(C, shape, profile, config, sums=None):
        raise PlanError(f"no plan for counts {C.tolist()}")

    layer.dispatcher.spec = dataclasses.replace(spec, planner=planner)
    with pytest.raises(PlanError, match="no plan for counts"):
        layer(x)
    layer.dispatcher.spec = spec
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], want, rtol=0, atol=0)
    layer.dispatcher.close()


def _planner_workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("mixmoe-plan")}


def test_the_thread_is_lazy_shut_down_by_close_and_not_copied() -> None:
    layer = _layer()
    assert layer.dispatcher._planner_thread is None  # nothing started before a step
    x = _x()
    before = _planner_workers()
    y = layer(x)[0]
    workers = _planner_workers() - before  # the worker thread this dispatcher started
    assert len(workers) == 1
    thread = layer.dispatcher._planner_thread
    assert thread is not None
    twin = copy.deepcopy(layer)  # a copy starts its own thread when it plans
    assert twin.dispatcher._planner_thread is None
    torch.testing.assert_close(twin(x)[0], y, rtol=0, atol=0)
    assert twin.dispatcher._planner_thread not in (None, thread)
    for dispatcher in (layer.dispatcher, twin.dispatcher):
        dispatcher.close()
        assert dispatcher._planner_thread is None
    assert not any(w.is_alive() for w in workers)  # close waits for the worker to end
    with pytest.raises(RuntimeError):
        thread.submit(print)  # shut down


def test_plan_async_false_plans_on_the_caller_with_the_same_numbers() -> None:
    fast, slow = _layer(True), _layer(False)
    assert fast.dispatcher.plans_async() and not slow.dispatcher.plans_async()
    x = _x(70)
    torch.testing.assert_close(fast(x)[0], slow(x)[0], rtol=0, atol=0)
    assert slow.dispatcher._planner_thread is None
    fast.dispatcher.close()


@pytest.mark.parametrize("strategy", ["a2a", "shadow"])
def test_only_mix_plans_in_the_background(strategy: str) -> None:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(model_dim=8, hidden_dim=12, num_experts=4), dtype=torch.float64)
    parallelize_moe(layer, LocalCommunicator(), strategy)
    layer(_x())
    assert not layer.dispatcher.plans_async() and layer.dispatcher._planner_thread is None


def test_plan_async_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="plan_async must be True, False or None"):
        MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, plan_async=1)


def test_default_plans_in_the_background_on_cuda_only() -> None:
    """``plan_async=None`` (the default): background planning for CUDA steps, where the own rows
    run on the GPU while the host plans; on CPU the plan comes first (the plan thread and the
    compute would share the cores). A CPU step of the default layer starts no thread."""
    torch.manual_seed(0)
    layer = MoE(MoEConfig(model_dim=8, hidden_dim=12, num_experts=4), dtype=torch.float64)
    parallelize_moe(layer, LocalCommunicator(), "mix")
    d = layer.dispatcher
    assert d.plans_async("cuda") and d.plans_async(torch.device("cuda", 0))
    assert not d.plans_async("cpu") and not d.plans_async()  # the default device: the CPU
    layer(_x())
    assert d._planner_thread is None
    forced = _layer(True).dispatcher
    assert forced.plans_async("cpu") and forced.plans_async("cuda")
    never = _layer(False).dispatcher
    assert not never.plans_async("cpu") and not never.plans_async("cuda")
