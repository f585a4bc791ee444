"""CMD trace replay under another profile (``mixmoe.simulate.replay``), by hand arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixmoe import cli
from mixmoe.placement import HardwareProfile
from mixmoe.placement.cost_model import LayerShape
from mixmoe.simulate.replay import replay_strategies, replay_trace, token_calls_note
from mixmoe.simulate.routing import counts_source

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


# --------------------------------------------------------------------------- another strategy

DATA = Path(__file__).resolve().parents[1] / "data"
# 1 ms per row of GEMM (12 FLOP per row at D = F = 1, two GEMMs, fwd + bwd), 1 ms per remote row
# on the wire (2 x 4 bytes per row), 0.25 ms latency (4 token collectives: 1 ms; 2 replica: 0.5
# ms), an expert's parameters (16 bytes) 2 ms
HAND = HardwareProfile("hand", 12e3, link_bandwidth=8e3, link_latency=0.25e-3)
HAND_SHAPE = LayerShape(1, 1, 1, 2, bytes_per_element=4)


def _by_hand(rank: int) -> dict[str, tuple[float, float, int]]:
    """(predicted collective ms, of which wait ms, replicas) per strategy for the fixture's two
    layer steps, C0 = [[3, 1], [5, 1]] and C1 = [[2, 2], [2, 2]] (expert g on rank g)."""
    # C0, a2a: rows (8, 2), remote (6, 6): token 1 + 6 = 7 ms, totals (15, 9), step 15
    # C0, shadow: both experts shadowed (FasterMoE's rule: 3 ms per row computed or sent, 2 ms
    #   per model: max 8 rows x 3 = 24 -> 7 x 3 + 2 = 23 -> 6 x 3 + 4 = 22); rows (4, 6), nothing
    #   remote, replica phase 0.5 + 2 x 2 = 4.5 ms, totals (8.5, 10.5), step 10.5
    # C0, mix: expert 0 on rank 1; rows (3, 7), remote (1, 1): token 1 + 1 = 2 ms hidden under the
    #   local rows (3, 6 ms), replica 0.5 + 2 = 2.5 ms, totals (5.5, 9.5), step 9.5
    # C1, a2a and shadow (no replica pays): rows (4, 4), remote (4, 4): token 5, totals 9, step 9
    # C1, mix: no replica; token 5 - 2 ms of local rows hidden = 3, totals 7, step 7
    compute = {"a2a": ((8, 2), (4, 4)), "shadow": ((4, 6), (4, 4)), "mix": ((3, 7), (4, 4))}
    exposed = {"a2a": ((7, 7), (5, 5)), "shadow": ((4.5, 4.5), (5, 5)), "mix": ((2.5, 2.5), (3, 3))}
    step = {"a2a": (15, 9), "shadow": (10.5, 9), "mix": (9.5, 7)}
    replicas = {"a2a": 0, "shadow": 2, "mix": 1}
    return {
        s: (
            sum(step[s][i] - compute[s][i][rank] for i in range(2)),
            sum(step[s][i] - compute[s][i][rank] - exposed[s][i][rank] for i in range(2)),
            replicas[s],
        )
        for s in step
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_replay_strategies_by_hand(rank: int) -> None:
    trace, counts = DATA / "replay_strategy_trace.txt", DATA / "replay_strategy_counts.json"
    # the fixture's own count exchanges and its counts file give the same two matrices
    from_trace = counts_source(f"trace:{trace}", 2, 2, 1, 1)
    from_file = counts_source(f"counts:{counts}", 2, 2, 1, 1)
    assert [C.tolist() for C in from_trace] == [C.tolist() for C in from_file]
    assert [C.tolist() for C in from_file] == [[[3, 1], [5, 1]], [[2, 2], [2, 2]]]
    # measured on each rank: iteration 0 .. 52 ms; MoE all-to-alls 1 + 2 + 1.5 + 2.5 + 4 x 1
    for C in (from_trace, from_file):
        got = replay_strategies(trace, C, HAND_SHAPE, HAND, top_k=1, rank=rank)
        want = _by_hand(rank)
        assert [r.strategy for r in got] == ["a2a", "shadow", "mix"]
        for r in got:
            collective, wait, replicas = want[r.strategy]
            assert (r.rank, r.layer_steps, r.a2a_calls, r.token_calls) == (rank, 2, 8, 8)
            assert r.iteration_ms == pytest.approx(52.0)
            assert r.a2a_measured_ms == pytest.approx(11.0)
            assert r.collective_ms == pytest.approx(collective)
            assert r.wait_ms == pytest.approx(wait)
            assert r.replicas == replicas
            assert r.replayed_ms == pytest.approx(52.0 - 11.0 + collective)
            assert token_calls_note(r) == ""
    # rank 0: a2a 53, shadow 52.5, mix 50.5; rank 1: a2a 59, shadow 50.5, mix 46.5
    replayed = {r.strategy: r.replayed_ms for r in got}
    expected = [(53.0, 52.5, 50.5), (59.0, 50.5, 46.5)][rank]
    assert [replayed[s] for s in ("a2a", "shadow", "mix")] == pytest.approx(expected)


def test_replay_strategies_pairs_counts_and_refuses_what_it_cannot_replay(tmp_path) -> None:
    trace = DATA / "replay_strategy_trace.txt"
    C0, C1 = counts_source(f"counts:{DATA / 'replay_strategy_counts.json'}", 2, 2, 1, 1)
    # one matrix serves every layer step: C0 twice
    one = replay_strategies(trace, [C0], HAND_SHAPE, HAND, top_k=1, strategies=("a2a",))[0]
    assert one.collective_ms == pytest.approx(2 * (15 - 8))
    with pytest.raises(ValueError, match="ran 2 MoE layer steps but the routing source holds 3"):
        replay_strategies(trace, [C0, C1, C0], HAND_SHAPE, HAND, top_k=1)
    # a trace without count exchanges has no layer steps to re-predict
    legacy = tmp_path / "t.txt"
    legacy.write_text("\n".join(LINES[1:]) + "\n")
    with pytest.raises(ValueError, match="no MoE count exchange"):
        replay_strategies(legacy, [C0], HAND_SHAPE, HAND, top_k=1)
    # mixmoe's own traces time the forward all-to-alls only: the result says so
    fwd_only = tmp_path / "fwd.txt"
    fwd_only.write_text(
        "".join(line for line in trace.read_text().splitlines(True) if "backward" not in line)
    )
    r = replay_strategies(fwd_only, [C0, C1], HAND_SHAPE, HAND, top_k=1, strategies=("mix",))[0]
    assert (r.token_calls, r.a2a_measured_ms) == (4, pytest.approx(5.0))
    assert "holds 4 MoE token all-to-alls for 2 layer steps" in token_calls_note(r)


def test_replay_strategy_cli(capsys) -> None:
    trace = DATA / "replay_strategy_trace.txt"
    argv = ["simulate", "--replay", str(trace), "--replay-strategy", "a2a,shadow,mix"]
    argv += ["--routing", f"trace:{trace}", "--trace-rank", "1", "--world-size", "2"]
    argv += ["--experts-per-rank", "1", "--model-dim", "1", "--hidden-size", "1"]
    argv += ["--top-k", "1", "--dtype", "fp32", "--profile", "cpu"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 MoE layer steps" in out and "assumed: replayed = iteration" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:4] in ("a2a ",
            "shad", "mix ")}  # fmt: skip
    assert set(rows) == {"a2a", "shadow", "mix"} and rows["a2a"][1] == "52.000"
    # one routing source only, and the layer shape must match the counts
    assert cli.main([*argv[:5], "--routing", "uniform,hot:0.5"]) == 2
    assert "needs one --routing source" in capsys.readouterr().err
    assert cli.main([*argv, "--world-size", "4"]) == 2
    assert "W=2, N=2 but the simulated layer has W=4" in capsys.readouterr().err
