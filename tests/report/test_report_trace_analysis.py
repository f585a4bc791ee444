"""``mixmoe analyze trace`` on the real 4-stage pipeline trace (rank 0, stage 0).

Expected figures were computed independently from the raw file with a regex + ``ast.literal_eval``
script (not mixmoe's parser) and checked by hand against the lines:
- iteration: first start = 3371168147.09 - 0.04, last end = 3371168865.96 -> 718.91 ms
- 16 forward (193.53 ms), 16 backward (301.06 ms), 16 get_batch (3.06 ms)
- pipeline p2p: send_forward 88.24 + recv_backward 128.11 = 216.35 ms if double counted; the 13
  steady send_forward/recv_backward pairs share duration and timestamp (87.34 ms) -> 129.01 ms
- finalize: dp 11.88 + ep-dp 40.05 + optimizer 31.79 = 83.72 ms
- host gaps: 718.91 - union(op intervals) 710.38 = 8.53 ms in 69 gaps, the largest 0.27 ms
- bubble: window 147.05 -> 781.98 = 634.93 ms, idle 634.93 - 193.53 - 301.06 = 140.34 ms;
  3 warm-up forwards on stage 0 -> P = 4, M = 16 -> ideal 3/19
- MoE comm: forward sub-ops 16.28 ms, backward 7.08 ms
- all-to-all pairs [2048, 4096] then [2924, 4096] -> load factor 2924/2048
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mixmoe.cli import main
from mixmoe.formats.cmd_trace import read_cmd_trace
from mixmoe.formats.traces import read_traces
from mixmoe.report.trace_summary import p2p_calls, summarize_rank
from mixmoe.tracing import write_chrome_trace

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "cmd_trace_pp4_ep2_rank0.txt"


@pytest.fixture(scope="module")
def ops():
    return read_cmd_trace(FIXTURE)


def test_reader_on_the_fixture(ops) -> None:
    assert len(ops) == 83
    assert sum(op.name == "forward_step" for op in ops) == 16
    assert sum(op.name == "backward_step" for op in ops) == 16
    fwd0 = ops[1]
    assert (fwd0.batch_id, fwd0.mg_state, fwd0.duration_ms) == (0, "warmup", 12.59)
    assert len(fwd0.sub_ops) == 6
    first = fwd0.sub_ops[0]
    assert (first.comm_func, first.group, first.shape, first.dtype) == (
        "allgather",
        "exp",
        (8,),
        "torch.int64",
    )
    assert dict(first.extra)["trace_src_func"] == "_gather_along_first_dim_expert_parallel"
    assert ops[80].description == "Regular DP gradient synchronization (non-expert parameters)"
    assert ops[81].name == "ep_dp_allreduce" and ops[81].shape == (1409286144,)


def test_phase_totals_count_fused_pairs_once(ops) -> None:
    s = summarize_rank(ops)
    assert s.span_ms == pytest.approx(718.91, abs=1e-6)
    assert s.phase_ms["forward"] == pytest.approx(193.53)
    assert s.phase_ms["backward"] == pytest.approx(301.06)
    assert s.phase_ms["data"] == pytest.approx(3.06)
    naive = sum(op.duration_ms for op in ops if op.name in ("send_forward", "recv_backward"))
    assert naive == pytest.approx(216.35)
    assert s.phase_ms["pipeline p2p"] == pytest.approx(129.01)
    assert s.fused_p2p_pairs == 13
    assert sum(len(c) == 1 for c in p2p_calls(ops)) == 3 + 3  # warm-up sends, cool-down recvs
    assert (s.phase_ms["dp allreduce"], s.phase_ms["ep-dp allreduce"]) == (11.88, 40.05)
    assert s.phase_ms["optimizer"] == 31.79
    assert s.finalize_ms == pytest.approx(83.72)
    assert s.phase_ms["other"] == 0.0 and s.unknown_ops == ()
    assert (s.gap_ms, s.gaps, s.largest_gap_ms) == (
        pytest.approx(8.53, abs=1e-6),
        69,
        pytest.approx(0.27, abs=1e-6),
    )
    # every millisecond of the span is in exactly one place
    assert sum(s.phase_ms.values()) + s.gap_ms == pytest.approx(s.span_ms, abs=1e-6)


def test_pipeline_bubble(ops) -> None:
    b = summarize_rank(ops).bubble
    assert (b.stages, b.microbatches) == (4, 16)
    assert b.ideal == pytest.approx(3 / 19)
    assert b.window_ms == pytest.approx(634.93, abs=1e-6)
    assert b.idle_ms == pytest.approx(140.34, abs=1e-6)
    assert b.measured == pytest.approx(140.34 / 634.93, abs=1e-8)
    forced = summarize_rank(ops, stages=8, microbatches=32).bubble
    assert forced.ideal == pytest.approx(7 / 39)


def test_moe_communication_and_collectives(ops) -> None:
    s = summarize_rank(ops)
    assert s.moe_comm_ms["forward"] == pytest.approx(16.28)
    assert s.moe_comm_ms["backward"] == pytest.approx(7.08)
    assert s.moe_comm_share("forward") == pytest.approx(16.28 / 193.53)
    stats = {(c.where, c.op, c.shape): c for c in s.collectives}
    a2a = stats[("forward", "all_to_all", (2048, 4096))]
    assert (a2a.calls, a2a.min_ms, a2a.max_ms) == (32, 0.13, 0.33)
    assert a2a.mean_ms == pytest.approx(6.62 / 32)
    assert a2a.bytes_per_call == 2048 * 4096 * 2
    dp = stats[("dp allreduce", "dp_allreduce", (290013184,))]
    assert dp.gbps == pytest.approx(290013184 * 4 / 11.88e-3 / 1e9)
    fused = stats[("pipeline p2p", "send_forward+recv_backward", (1024, 1, 4096))]
    assert (fused.calls, fused.max_ms) == (13, 56.04)
    assert fused.total_ms == pytest.approx(87.34)


def test_expert_load_from_shapes(ops) -> None:
    load = summarize_rank(ops).load
    assert load.source == "shapes" and load.calls == 32
    assert set(load.sent_rows) == {2048} and set(load.received_rows) == {2924}
    assert load.load_factor == pytest.approx(2924 / 2048)


def test_edge_cases_short_form_aliases_unknown_ops(tmp_path) -> None:
    lines = [
        "noise: rank 0 ready",
        "rank:0:get_batch(stage_id=0,batch_id=0,mg_state=None,duration=None,description=None,group_kind=None)",
        "rank:0:forward_step(stage_id=0,batch_id=0,mg_state=None,duration=4,description=None,group_kind=None,input__shape=None,input__dtype=None,timestamp=104,sub_operations=[])",
        "rank:0:warm_cache(stage_id=0,batch_id=0,mg_state=None,duration=1,description=a, b (c),group_kind=None,input__shape=None,input__dtype=None,timestamp=106,sub_operations=[])",
        "rank:0:exp_dp_allreduce(stage_id=0,batch_id=0,mg_state=finalize,duration=2,description=None,group_kind=ep_dp,input__shape=[10],input__dtype=torch.float32,timestamp=110,sub_operations=[])",
    ]
    path = tmp_path / "t.txt"
    path.write_text("\n".join(lines) + "\n")
    ops = read_cmd_trace(path)
    assert [op.name for op in ops] == ["get_batch", "forward_step", "warm_cache", "ep_dp_allreduce"]
    s = summarize_rank(ops)
    assert (s.ops, s.untimed_ops) == (4, 1)
    assert s.span_ms == 10.0  # 100 -> 110
    assert s.phase_ms["other"] == 1.0 and s.unknown_ops == ("warm_cache",)
    assert s.phase_ms["ep-dp allreduce"] == 2.0
    assert (s.gap_ms, s.gaps) == (3.0, 2)  # 104-105 and 106-108
    assert s.bubble is None and "no 1F1B phases" in s.bubble_note


def test_chrome_trace_of_the_fixture_analyses_the_same(ops, tmp_path) -> None:
    out = write_chrome_trace([FIXTURE], tmp_path / "fixture.json")
    from_json = read_traces([out])[0]
    a, b = summarize_rank(ops), summarize_rank(from_json)
    assert b.span_ms == pytest.approx(a.span_ms, abs=1e-6)
    for phase, ms in a.phase_ms.items():
        assert b.phase_ms[phase] == pytest.approx(ms, abs=1e-6)
    assert b.fused_p2p_pairs == 13 and b.load.load_factor == pytest.approx(2924 / 2048)
    with pytest.raises(ValueError, match="rank 0 appears in both"):
        read_traces([FIXTURE, out])


def test_cli_prints_the_figures_and_draws_a_timeline(tmp_path, capsys) -> None:
    png = tmp_path / "timeline.png"
    assert main(["analyze", "trace", str(FIXTURE), "--timeline", str(png)]) == 0
    text = capsys.readouterr().out
    assert "span 718.910 ms" in text
    assert "pipeline p2p       129.010" in text and "13 fused send+recv counted once" in text
    assert "P=4 stages, M=16 micro-batches; measured 22.10%" in text
    assert "(P-1)/(M+P-1) = 15.79%" in text
    assert "forward 16.280 ms = 8.41%; backward 7.080 ms = 2.35%" in text
    assert "carry 1.428x a balanced share" in text
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[1] > 2 * image.shape[0] > 100  # a wide timeline, actually drawn
    assert image[..., :3].std() > 0.05  # not a blank canvas
