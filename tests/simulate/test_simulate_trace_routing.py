"""``mixmoe simulate --routing trace:PATH``: the count matrices rebuilt from the layer's own traces.

A 2-rank gloo ``bench layer`` run with a skewed routing writes both its traces (``--trace``) and
its counts file (``--save-counts``); every count exchange in the traces must give exactly the
matrix the counts file holds, so the simulator predicts exactly what ``counts:FILE`` predicts.
"""

from __future__ import annotations

import json

import pytest

from mixmoe import cli
from mixmoe.formats.cmd_trace import CmdOp, SubOp
from mixmoe.formats.counts import read_counts
from mixmoe.formats.traces import read_traces, trace_count_steps, trace_paths
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.profile import HardwareProfile
from mixmoe.simulate.layer import predict_layer
from mixmoe.simulate.replay import replay_strategies, token_calls_note
from mixmoe.simulate.routing import counts_source

pytestmark = pytest.mark.dist

D, F, T, E, W, K = 16, 32, 96, 2, 2, 2


def test_trace_counts_equal_saved_counts_and_predictions(tmp_path, capsys) -> None:
    traces, counts = tmp_path / "traces", tmp_path / "counts.json"
    argv = ["bench", "layer", "--world-size", str(W), "--routing", "hot:0.8"]
    argv += ["--model-dim", str(D), "--hidden-size", str(F), "--tokens", str(T)]
    argv += ["--num-local-experts", str(E), "--top-k", str(K), "--strategy", "a2a,mix"]
    argv += ["--steps", "1", "--warmup", "1", "--jsonl", "", "--trace", str(traces)]
    argv += ["--save-counts", str(counts)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert sorted(p.name for p in traces.iterdir()) == ["trace_rank0.txt", "trace_rank1.txt"]

    saved = read_counts(counts)["steps"]
    assert len(saved) == 1
    C = saved[0]
    # skewed: the hot expert (0, on rank 0) gets most rows of both ranks
    assert all(row[0] > max(row[1:]) for row in C) and sum(map(sum, C)) == W * T * K
    from_trace = counts_source(f"trace:{traces}", W, W * E, T, K)
    # 2 steps (1 warm-up + 1 timed) x 2 strategies, one count exchange each
    assert len(from_trace) == 4
    for C_WN in from_trace:
        assert C_WN.tolist() == C
    # one rank's file alone is not the group
    with pytest.raises(ValueError, match="W=1, N=4 but the simulated layer has W=2"):
        counts_source(f"trace:{traces / 'trace_rank0.txt'}", W, W * E, T, K)

    shape = LayerShape(D, F, E, W, bytes_per_element=4)
    profile = HardwareProfile("test", 2e9, link_bandwidth=1e9, link_latency=1e-5)
    want = predict_layer(counts_source(f"counts:{counts}", W, W * E, T, K)[0], shape, profile,
                         top_k=K)  # fmt: skip
    for C_WN in from_trace:
        assert predict_layer(C_WN, shape, profile, top_k=K) == want

    # the traces hold the backward token all-to-alls too (in backward_step, the forward's keys,
    # splits swapped). bench layer's input needs no gradient, so autograd never runs the
    # dispatch's backward: 3 token all-to-alls per layer step ran and are recorded, and the
    # replay says the cost model prices 4
    ops = read_traces([traces / "trace_rank0.txt"])[0]
    for fwd, bwd in zip(ops[0::3], ops[1::3], strict=True):
        assert (fwd.name, bwd.name) == ("forward_step", "backward_step")
        f = {s.name: s for s in fwd.sub_ops}
        b = {s.name: s for s in bwd.sub_ops if s.comm_func == "all_to_all"}
        assert sorted(b) == ["moe.return.backward"]
        sub = b["moe.return.backward"]
        assert (sub.group, sub.kind, sub.dtype) == ("exp", "comm", "torch.float32")
        assert (sub.in_splits, sub.out_splits) == (f["moe.return"].out_splits,
                                                   f["moe.return"].in_splits)  # fmt: skip
        assert sub.shape == (sum(sub.in_splits), D) and sub.duration_ms >= 0
    (r,) = replay_strategies(traces / "trace_rank0.txt", from_trace, shape, profile, top_k=K,
                             strategies=("a2a",))  # fmt: skip
    assert (r.layer_steps, r.token_calls) == (4, 12)
    assert "holds 12 MoE token all-to-alls for 4 layer steps" in token_calls_note(r)

    # the CLI takes the same source and prints the same table as counts:FILE
    tables = []
    for routing in (f"trace:{traces}", f"counts:{counts}"):
        argv = ["simulate", "--routing", routing, "--world-size", str(W), "--experts-per-rank"]
        argv += [str(E), "--model-dim", str(D), "--hidden-size", str(F), "--tokens", str(T)]
        argv += ["--dtype", "fp32", "--profile", "cpu"]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        rows = [line.split() for line in out[1:-1] if not line.startswith("--")]
        tables.append([[c for c in row if c != routing] for row in rows])
    assert tables[0] == tables[1]


def _op(rank: int, counts: list[tuple[int, ...]]) -> CmdOp:
    subs = tuple(
        SubOp(name="moe.count_exchange", comm_func="allgather", group="exp", counts=c)
        for c in counts
    )
    return CmdOp(rank=rank, name="forward_step", sub_ops=subs)


def test_trace_count_steps_pairs_ranks_and_refuses_mismatches(tmp_path, capsys) -> None:
    by_rank = {1: [_op(1, [(0, 5), (1, 4)])], 0: [_op(0, [(3, 2)]), _op(0, [(2, 3)])]}
    assert trace_count_steps(by_rank) == [[[3, 2], [0, 5]], [[2, 3], [1, 4]]]
    with pytest.raises(ValueError, match="different numbers of count exchanges"):
        trace_count_steps({0: [_op(0, [(3, 2)])], 1: [_op(1, [(0, 5), (1, 4)])]})
    with pytest.raises(ValueError, match=r"different expert counts N \[2, 3\]"):
        trace_count_steps({0: [_op(0, [(3, 2)])], 1: [_op(1, [(0, 5, 1)])]})
    with pytest.raises(ValueError, match="no count exchange carries per-expert counts"):
        trace_count_steps({0: [CmdOp(rank=0, name="forward_step")]})
    # traces of another producer (no counts key) are refused with the fix
    from pathlib import Path

    legacy = Path(__file__).resolve().parents[1] / "data" / "cmd_trace_pp4_ep2_rank0.txt"
    with pytest.raises(ValueError, match="counts file"):
        trace_count_steps(read_traces(trace_paths(legacy)))
    with pytest.raises(FileNotFoundError, match="no \\*.txt or \\*.json"):
        trace_paths(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trace_paths(tmp_path / "nope.txt")
    # the simulate CLI reports a bad trace as one error line
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": []}))
    assert cli.main(["simulate", "--routing", f"trace:{tmp_path}", "--world-size", "2"]) == 2
    assert "mixmoe: error: " in capsys.readouterr().err
