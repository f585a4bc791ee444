"""Ranks sharing processors (``predict_layer(..., processors=P)``): processor-sharing aggregation
of the cost model's per-rank seconds, by hand and against the stored W=4 measurements."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixmoe import cli
from mixmoe.placement import HardwareProfile, LayerShape
from mixmoe.simulate.layer import predict_layer, processor_sharing_s
from mixmoe.simulate.validation import compare, read_records, summarize

DATA = Path(__file__).resolve().parents[1] / "data" / "simulator_validation.jsonl"
# the hand example of test_simulate_layer: a2a totals (27, 16) s, shadow (26.5, 25.5), mix (17, 14)
SHAPE = LayerShape(model_dim=4, hidden_dim=8, experts_per_rank=1, world_size=2, bytes_per_element=4)
UNIT = HardwareProfile("unit", gemm_flops=384.0, link_bandwidth=32.0, link_latency=0.5)
C = [[10, 3], [6, 2]]


def _w(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_processor_sharing_by_hand() -> None:
    # 4 jobs on 2 processors: all four at half a processor until the three light ones finish
    # (2 s), then the heavy one alone at a full processor (4 s more)
    assert processor_sharing_s(_w(1, 5, 1, 1), 2) == pytest.approx(6.0)
    assert processor_sharing_s(_w(2, 2, 2, 2), 2) == pytest.approx(4.0)  # total / P
    assert processor_sharing_s(_w(0, 0, 0, 5), 2) == pytest.approx(5.0)  # the heavy one alone
    # 3 jobs: (1, 2, 6) on 2: 1/(2/3) = 1.5; then 2 jobs at full speed: 1 + 4 more -> 6.5
    assert processor_sharing_s(_w(6, 1, 2), 2) == pytest.approx(6.5)
    assert processor_sharing_s(_w(3, 7, 1), 1) == pytest.approx(11.0)  # one processor: the sum
    assert processor_sharing_s(_w(3, 7, 1), 3) == 7.0  # a processor each: the max, exactly


def test_predict_layer_with_shared_processors() -> None:
    plain = predict_layer(C, SHAPE, UNIT, top_k=2)
    # as many processors as ranks: the cost model's own max over ranks, exactly
    assert predict_layer(C, SHAPE, UNIT, top_k=2, processors=2) == plain
    assert predict_layer(C, SHAPE, UNIT, top_k=2, processors=8) == plain
    # one processor for two ranks: each rank's total at half a processor (the calibrated share),
    # one processor always busy: the mean of the totals (a2a 21.5, shadow 26); mix's overlap
    # hides nothing on the shared processor: its totals are a2a's (27, 16), not (17, 14)
    one = predict_layer(C, SHAPE, UNIT, top_k=2, processors=1)
    assert [one[s].step_s for s in plain] == pytest.approx([21.5, 26.0, 21.5])
    assert [one[s].hot for s in plain] == [plain[s].hot for s in plain]  # the plans stay
    assert plain["mix"].hidden_W == (10.0, 2.0) and one["mix"].hidden_W == (0.0, 0.0)
    assert one["mix"].exposed_W == one["a2a"].exposed_W == (11.0, 11.0)
    a2a_fwd = (16 / 3 + 5.5, 5 / 3 + 5.5)
    assert one["a2a"].fwd_s == pytest.approx(sum(a2a_fwd) / 2)
    with pytest.raises(ValueError, match="not both"):
        predict_layer(C, SHAPE, UNIT, top_k=2, processors=1, shared=True)
    with pytest.raises(ValueError, match="processors must be an int >= 1"):
        predict_layer(C, SHAPE, UNIT, top_k=2, processors=0)


def test_processor_sharing_against_the_stored_w4_measurements(capsys) -> None:
    """The README's figures: on the 2-core VM the stored W=4 runs (4 ranks, 2 cores) are
    predicted within a 7.1% median step error under processor sharing (P = 2, the VM's cores,
    no fitted parameter; mix's overlap not priced on the shared cores) against 43.0% under the
    max over ranks; W=2 is unchanged (P >= W). The stored records keep no calibration runs:
    their profiles (fitted under the max) are used as stored."""
    s = summarize(compare(read_records(DATA), processors=2))
    w2, w4 = s["ps_by_world"][2], s["ps_by_world"][4]
    assert w2["step"] == w2["step_max"] and w2["ratio"] == w2["ratio_max"]
    assert w4["step"] == pytest.approx(0.071, abs=5e-4)
    assert w4["step_max"] == pytest.approx(0.430, abs=5e-4)
    assert w4["ratio"] == pytest.approx(7.6, abs=0.05)
    assert s["ps_step_error_median"] == pytest.approx(0.064, abs=5e-4)
    assert s["ps_within_10pct"] == 31 and s["cases"] == 48 and s["ps_refit_cases"] == 0
    assert cli.main(["simulate", "--validate", str(DATA), "--processors", "2"]) == 0
    out = capsys.readouterr().out
    assert "processor sharing (2 cores): step error median 6.4%, 31/48 within 10%" in out
    assert "W=4: step error median 7.1% (max over ranks 43.0%)" in out
