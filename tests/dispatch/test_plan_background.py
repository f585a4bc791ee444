"""The ``mix`` dispatcher's background plan on one rank (``LocalCommunicator``): the plan span
overlaps the own rows' compute in the trace, a planner error surfaces on the caller and leaves
the dispatcher usable, the thread is started lazily and shut down, and the layer still copies."""

from __future__ import annotations

import copy
import dataclasses
import threading

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


def test_plan_span_overlaps_the_own_rows_compute(monkeypatch) -> None:
    """Made deterministic with two events: the own rows start only once the plan has started,
    and the plan ends only once the own rows are done. A synchronous plan would wait for the own
    rows forever (here: WAIT_S, then fail)."""
    layer = _layer()
    plan_started, own_done = threading.Event(), threading.Event()
    spec = layer.dispatcher.spec
    planner_threads = []

    def planner(C, shape, profile, config, sums=None):
        planner_threads.append(threading.current_thread().name)
        plan_started.set()
        assert own_done.wait(WAIT_S), "the own rows were not computed while the plan ran"
        return spec.planner(C, shape, profile, config, sums=sums)

    real_run_work = expert_parallel.run_work

    def run_work(*args, **kwargs):
        assert plan_started.wait(WAIT_S), "the plan did not start before the own rows"
        out = real_run_work(*args, **kwargs)
        own_done.set()
        return out

    layer.dispatcher.spec = dataclasses.replace(spec, planner=planner)
    monkeypatch.setattr(expert_parallel, "run_work", run_work)
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
