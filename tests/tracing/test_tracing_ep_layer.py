"""The expert-parallel layer traces itself: a 2-rank ``mix`` run records its count exchange,
replica fetch, token all-to-alls (with split sizes) and compute stages, and in backward the
reverse exchanges (``NAME.backward``, splits swapped); the CMD files read back with the recorded
durations, and the splits of the two ranks agree with each other. An ``a2a`` run whose backward
runs on another thread (as autograd's device threads do) still records into ``backward_step``."""

from __future__ import annotations

import threading

import pytest
import torch

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.formats.traces import read_traces
from mixmoe.parallel import parallelize_moe
from mixmoe.placement.profile import HardwareProfile
from mixmoe.tracing import TraceRecorder, write_chrome_trace

pytestmark = pytest.mark.dist

REPLICATE = HardwareProfile("compute-bound", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9)


def _worker(comm, tmp: str) -> dict:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(model_dim=16, hidden_dim=24, num_experts=4, top_k=2, gate=GateConfig()))
    with torch.no_grad():
        layer.gate.wg.bias[0] = 1.5  # a hot expert on rank 0, so mix replicates it
    parallelize_moe(layer, comm, "mix", profile=REPLICATE)
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(70 + 30 * comm.rank, 16, generator=gen).requires_grad_()  # dispatch backward
    rec = TraceRecorder(rank=comm.rank, stage_id=0, device="cpu")
    with rec.activate():
        with rec.op("forward_step", batch_id=0, mg_state="steady"):
            y, aux = layer(x)
        with rec.op("backward_step", batch_id=0, mg_state="steady"):
            y.square().sum().backward()
    path = rec.write_cmd(f"{tmp}/rank{comm.rank}.txt")
    recorded = [
        (s.name, s.duration_ms, s.in_splits, s.out_splits) for s in rec.records()[0].sub_ops
    ]
    return {"path": str(path), "recorded": recorded, "stats": aux.stats}


def _backward_exchanges(forward, backward) -> dict:
    """The backward all-to-alls by name, checked against the forward ones they reverse."""
    fwd = {s.name: s for s in forward.sub_ops}
    bwd = {s.name: s for s in backward.sub_ops if s.comm_func == "all_to_all"}
    for name, sub in bwd.items():
        assert name.endswith(".backward") and (sub.kind, sub.group) == ("comm", "exp")
        f = fwd[name.removesuffix(".backward")]
        assert (sub.in_splits, sub.out_splits) == (f.out_splits, f.in_splits)
        assert sub.shape[0] == sum(sub.in_splits) and sub.duration_ms >= 0
    return bwd


def test_mix_layer_trace_round_trips(tmp_path) -> None:
    from mixmoe.comm.launch import spawn_gloo

    out = spawn_gloo(_worker, 2, str(tmp_path))
    by_rank = read_traces([o["path"] for o in out])
    assert out[0]["stats"]["replicas"] > 0
    subs = {}
    for rank in (0, 1):
        forward = by_rank[rank][0]
        assert forward.name == "forward_step"
        got = [(s.name, s.duration_ms, s.in_splits, s.out_splits) for s in forward.sub_ops]
        for (n, d, i, o), (n2, d2, i2, o2) in zip(got, out[rank]["recorded"], strict=True):
            assert (n, i, o) == (n2, i2, o2)
            assert d == pytest.approx(d2, abs=1e-5)
        names = [s.name for s in forward.sub_ops]
        for stage in (
            "moe.gate",
            "moe.count_exchange",
            "moe.plan",
            "moe.replica_fetch",
            "moe.dispatch",
            "moe.experts_local",
            "moe.experts_remote",
            "moe.return",
            "moe.combine",
        ):
            assert stage in names, (stage, names)
        # replicas exist, so every rank runs two local work items (own experts, replicas: empty
        # on a rank holding none) and one on the received rows, each under its stage's name; a
        # helper of a plan with share entries runs a second one: rows it computes with replicas
        assert names.count("moe.experts_local") == 2, names
        helper = out[rank]["stats"]["shares"] > 0 and out[rank]["stats"]["replicas"] > 0
        assert names.count("moe.experts_remote") in ((1, 2) if helper else (1,)), names
        subs[rank] = {s.name: s for s in forward.sub_ops}
        assert subs[rank]["moe.dispatch"].kind == "comm"
        assert subs[rank]["moe.dispatch"].comm_func == "all_to_all"
    # what rank 0 sends to rank 1 is what rank 1 receives from rank 0, and the return mirrors it
    for a, b in ((0, 1), (1, 0)):
        assert subs[a]["moe.dispatch"].in_splits[b] == subs[b]["moe.dispatch"].out_splits[a]
        assert subs[a]["moe.return"].in_splits == subs[a]["moe.dispatch"].out_splits
        assert (
            subs[a]["moe.replica_fetch"].in_splits[b] == subs[b]["moe.replica_fetch"].out_splits[a]
        )
    assert subs[0]["moe.dispatch"].shape[0] == sum(subs[0]["moe.dispatch"].in_splits)
    # backward: the token exchanges (async under mix: timed by their launch) and the replica
    # gradients going home, in backward_step, with the forward's keys and swapped splits
    for rank in (0, 1):
        forward, backward = by_rank[rank]
        assert backward.name == "backward_step"
        assert sorted(_backward_exchanges(forward, backward)) == [
            "moe.dispatch.backward", "moe.replica_fetch.backward", "moe.return.backward"
        ]  # fmt: skip
    chrome = write_chrome_trace([o["path"] for o in out], tmp_path / "trace.json")
    assert chrome.stat().st_size > 0


def _a2a_worker(comm, tmp: str) -> str:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(model_dim=16, hidden_dim=24, num_experts=4, top_k=2, gate=GateConfig()))
    parallelize_moe(layer, comm, "a2a")
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(50 + 20 * comm.rank, 16, generator=gen).requires_grad_()
    rec = TraceRecorder(rank=comm.rank, stage_id=0, device="cpu")
    with rec.activate():
        with rec.op("forward_step", batch_id=0, mg_state="steady"):
            y, _ = layer(x)
        with rec.op("backward_step", batch_id=0, mg_state="steady"):
            # a fresh thread has no recorder in its context: the exchanges find the recorder's
            # open op through the lookup captured in forward
            worker = threading.Thread(target=lambda: y.square().sum().backward())
            worker.start()
            worker.join()
    assert x.grad is not None
    return str(rec.write_cmd(f"{tmp}/a2a{comm.rank}.txt"))


def test_a2a_backward_exchanges_recorded_from_another_thread(tmp_path) -> None:
    from mixmoe.comm.launch import spawn_gloo

    paths = spawn_gloo(_a2a_worker, 2, str(tmp_path))
    for rank, ops in read_traces(paths).items():
        assert [op.name for op in ops] == ["forward_step", "backward_step"], rank
        assert sorted(_backward_exchanges(*ops)) == ["moe.dispatch.backward", "moe.return.backward"]
