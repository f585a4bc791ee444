"""The count exchange (``ExpertParallelDispatcher.exchange_counts``) on 2 gloo ranks: it returns
the count matrix in rank order (stored by columns under ``mix``, row-major under ``a2a``) and
every rank's weights version, ranks whose weights versions differ (a rank that wrote its experts
in place more often) still run, and a fingerprint that changes after the first step's handshake
raises on every rank instead of planning differently."""

from __future__ import annotations

import pytest
import torch
from _cases import make_layer, rank_inputs
from test_strategies import REPLICATE

from mixmoe.parallel import parallelize_moe

pytestmark = pytest.mark.dist

CASE = {
    "num_experts": 4,
    "top_k": 2,
    "skew": "hot",
    "dtype": torch.float64,
    "seed": 21,
    "tokens": [40, 33],
}


def _worker(comm) -> dict:
    r = comm.rank
    layer = parallelize_moe(make_layer(CASE), comm, "mix", profile=REPLICATE)
    disp = layer.dispatcher
    counts = torch.tensor([3 + r, 0, 7 * r, 1], dtype=torch.int64)
    C, versions, sums = disp.exchange_counts(counts, 10 + 5 * r)
    assert sums is None  # on the CPU the planning thread sums C (on a device: the device)
    # mix's planner walks C's columns: stored by columns (StrategySpec.counts_by_column)
    assert C.t().is_contiguous() and not C.is_contiguous()
    a2a = parallelize_moe(make_layer(CASE), comm, "a2a").dispatcher
    C_a2a, _, _ = a2a.exchange_counts(counts, 10 + 5 * r)
    assert C_a2a.is_contiguous() and torch.equal(C_a2a, C)
    # versions travel as two 31-bit int32 words: exact above 2**31
    _, big, _ = disp.exchange_counts(counts, 2**40 + 2**31 + r)
    x, _ = rank_inputs(CASE, r)
    y_before, _ = layer(x)
    with torch.no_grad():  # in-place writes that leave the values: only rank 1's version moves
        for _ in range(r * 3):
            layer.experts.w1.mul_(1.0)
    y_after, aux = layer(x)
    disp.fingerprint += r  # ranks disagree from now on (the handshake is done)
    try:
        layer(x)
        error = "no error"
    except ValueError as err:
        error = str(err)
    return {
        "C": C,
        "versions": versions,
        "big": big,
        "y_before": y_before.detach(),
        "y_after": y_after.detach(),
        "replicas": aux.stats["replicas"],
        "stats": aux.stats,
        "error": error,
    }


def test_count_exchange_versions_and_fingerprints() -> None:
    from mixmoe.comm.launch import spawn_gloo

    out = spawn_gloo(_worker, 2, timeout_s=120)
    want_C = torch.tensor([[3, 0, 0, 1], [4, 0, 7, 1]], dtype=torch.int64)
    for r, got in enumerate(out):
        torch.testing.assert_close(got["C"], want_C, rtol=0, atol=0)
        assert got["versions"] == [10, 15], got["versions"]
        assert got["big"] == [2**40 + 2**31, 2**40 + 2**31 + 1], got["big"]
        assert got["replicas"] > 0  # the versions matter: they key the replica cache
        torch.testing.assert_close(got["y_after"], got["y_before"], rtol=0, atol=0)
        assert "fingerprints differ" in got["error"], (r, got["error"])
    # the step's stats are the group's (one plan): every routed row is computed on one rank, so
    # the mean over the 2 ranks is half of all rows (40 + 33 tokens, top-2)
    stats = out[0]["stats"]
    assert out[1]["stats"] == stats
    assert stats["mean_rows"] == (40 + 33) * 2 / 2, stats
    assert (40 + 33) * 2 / 2 <= stats["max_rows"] <= (40 + 33) * 2, stats
