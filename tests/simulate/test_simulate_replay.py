"""CMD trace replay under another profile (``mixmoe.simulate.replay``), by hand arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixmoe import cli
from mixmoe.placement import HardwareProfile
from mixmoe.simulate.replay import replay_trace

LINES = [
    "rank:0:forward_step(stage_id=0,batch_id=0,mg_state=warmup,duration=10.0,description=None,"
    "group_kind=None,input__shape=None,input__dtype=None,timestamp=100.0,sub_operations=["
    "'duration=2.0,timestamp=95.0,input__shape=[1000, 100],input__dtype=torch.float32,group=exp,"
    "comm_func=all_to_all', 'duration=1.0,timestamp=96.0,input__shape=[8],"
    "input__dtype=torch.int64,group=exp,comm_func=allgather'])",
    "rank:0:backward_step(stage_id=0,batch_id=0,mg_state=warmup,duration=20.0,description=None,"
    "group_kind=None,input__shape=None,input__dtype=None,timestamp=130.0,sub_operations=["
    "'duration=3.0,timestamp=120.0,input__shape=[500, 100],input__dtype=torch.bfloat16,"
    "group=exp,comm_func=all_to_all'])",
]


def test_replay_by_hand(tmp_path) -> None:
    trace = tmp_path / "t.txt"
    trace.write_text("\n".join(LINES) + "\n")
    prof = HardwareProfile("slow", 1e9, link_bandwidth=1e6, link_latency=1e-3)
    r = replay_trace(trace, prof, ep_size=2)
    # iteration 90 .. 130 ms; all_to_alls: 1000 x 100 fp32 and 500 x 100 bf16, half leaves the rank
    assert r.iteration_ms == pytest.approx(40.0)
    assert r.a2a_measured_ms == pytest.approx(5.0) and r.a2a_calls == 2 and r.skipped == 0
    assert r.a2a_predicted_ms == pytest.approx((1e-3 + 200_000 / 1e6 + 1e-3 + 50_000 / 1e6) * 1e3)
    assert r.replayed_ms == pytest.approx(40.0 - 5.0 + r.a2a_predicted_ms)
    with pytest.raises(ValueError, match="ep_size must be"):
        replay_trace(trace, prof, ep_size=1)
    with pytest.raises(ValueError, match="no operation of rank 3"):
        replay_trace(trace, prof, ep_size=2, rank=3)


def test_replay_cli_on_the_fixture(capsys) -> None:
    fixture = Path(__file__).resolve().parents[1] / "data" / "cmd_trace_pp4_ep2_rank0.txt"
    argv = ["simulate", "--replay", str(fixture), "--profile", "cpu"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "MoE a2a predicted ms" in out and "128" in out
