"""``mixmoe calibrate --ranks-per-node`` on 4 gloo ranks in 2 simulated nodes of 2: both links
measured apart, written to the profile, loaded back equal and accepted by the planner; and, with
a slow inter-node link planted around the real all_to_all, each fit finds its own link."""

from __future__ import annotations

import time

import pytest
import torch

from mixmoe import cli
from mixmoe.bench.calibrate import CalibrateConfig, calibrate
from mixmoe.comm.launch import spawn_gloo
from mixmoe.commands.calibrate import agree_ranks_per_node
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.planner import plan_mix
from mixmoe.placement.profile_io import (
    load_profile,
    profile_record,
    read_profile_record,
    save_profile,
)

pytestmark = pytest.mark.dist

TINY = ["--model-dim", "32", "--hidden-size", "64", "--experts", "2", "--rows", "32,128",
        "--a2a-bytes", "4096,65536,262144", "--repeats", "2", "--warmup", "1",
        "--layer-tokens", ""]  # fmt: skip
# the planted inter-node link: far slower than gloo's loopback, so the fit must see it
SLOW_BANDWIDTH, SLOW_LATENCY = 20e6, 20e-3


def test_calibrate_four_ranks_two_nodes_writes_both_links(tmp_path, capsys) -> None:
    out = tmp_path / "nodes.json"
    argv = ["calibrate", *TINY, "--world-size", "4", "--ranks-per-node", "2", "--name", "nodes",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "links: 2 nodes of 2 ranks" in text
    assert "intra-node all_to_all_single on 4 ranks" in text
    assert "inter-node all_to_all_single on 4 ranks" in text
    assert "both links are loopback, so they measure about the same" in text
    assert "ranks_per_node = 2, inter_node_bandwidth = " in text
    prof = load_profile(out)
    rec = read_profile_record(out)
    assert rec["measured"] is True and "ESTIMATE" not in rec["source"]
    assert "measured apart" in rec["source"]
    assert rec["ranks_per_node"] == 2 and prof.ranks_per_node == 2
    m = rec["measurements"]
    assert [p["peers"] for p in m["intra_node"]] == [1, 1, 1]  # the other rank of the node
    assert [p["peers"] for p in m["inter_node"]] == [2, 2, 2]  # both ranks of the other node
    assert (prof.link_bandwidth, prof.inter_node_bandwidth) == (
        m["intra_node_fit"]["bandwidth"], m["inter_node_fit"]["bandwidth"]
    )  # fmt: skip
    # loads back equal: what was written is the profile the numbers say
    again = type(prof)(
        "nodes", rec["gemm_flops"], rec["link_bandwidth"], rec["link_latency"],
        ranks_per_node=2, inter_node_bandwidth=rec["inter_node_bandwidth"],
        inter_node_latency=rec["inter_node_latency"],
    )  # fmt: skip
    assert prof == again
    # the planner takes it: a valid plan, never predicted worse than a2a
    shape = LayerShape(model_dim=32, hidden_dim=64, experts_per_rank=2, world_size=4,
                       bytes_per_element=4)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    counts_WN = torch.randint(0, 400, (4, 8), generator=gen)
    counts_WN[:, 0] += 3000  # a hot expert on rank 0: something to plan
    plan = plan_mix(counts_WN.tolist(), shape, prof, max_replicas=4)
    plan.check_shares(counts_WN.tolist(), 2, 64)
    assert plan.prediction.step_s <= plan.baseline.step_s


class SlowInterNode:
    """A communicator whose all_to_all, after the real one, sleeps as long as this rank's bytes
    to the other node take on a planted slow link (latency + bytes / bandwidth; nothing when no
    byte crosses nodes): two nodes of ``R`` ranks whose inter-node link the fit must find."""

    def __init__(self, comm, R: int) -> None:
        self.comm, self.R = comm, R
        self.rank, self.world_size = comm.rank, comm.world_size
        self.backend, self.group = comm.backend, comm.group

    def all_to_all(self, out_RC, in_RC, out_splits, in_splits, async_op=False):
        work = self.comm.all_to_all(out_RC, in_RC, out_splits, in_splits, async_op)
        node = self.rank // self.R
        crossing = sum(n for q, n in enumerate(in_splits) if q // self.R != node)
        if crossing:
            time.sleep(SLOW_LATENCY + crossing * in_RC.element_size() / SLOW_BANDWIDTH)
        return work

    def __getattr__(self, name):
        return getattr(self.comm, name)


def _calibrate_slow(comm, cfg: CalibrateConfig):
    agree_ranks_per_node(comm, 2, "cpu")  # equal node sizes: nothing to say
    try:  # torchrun nodes of unequal sizes: every rank (all join the check) refuses
        agree_ranks_per_node(comm, 2 if comm.rank < 2 else 4, "cpu")
        unequal = ""
    except ValueError as exc:
        unequal = str(exc)
    profile, m = calibrate(cfg, SlowInterNode(comm, cfg.ranks_per_node))
    return profile, m, unequal


def test_each_link_fit_finds_its_own_link(tmp_path) -> None:
    cfg = CalibrateConfig(
        model_dim=16, hidden_size=32, experts=2, rows=(16, 64), world_size=4, ranks_per_node=2,
        a2a_bytes=(4096, 262144, 1 << 20), layer_tokens=(), repeats=3, warmup=1,
    )  # fmt: skip
    results = spawn_gloo(_calibrate_slow, 4, cfg, timeout_s=240)
    assert all("different numbers of ranks (2 to 4)" in r[2] for r in results), results
    profile, m, _ = results[0]
    assert profile.ranks_per_node == 2
    # the inter-node fit recovers the planted link (gloo's own time is small beside it) ...
    assert 0.5 * SLOW_BANDWIDTH <= profile.inter_node_bandwidth <= 2 * SLOW_BANDWIDTH, m
    assert 0.75 * SLOW_LATENCY <= profile.inter_node_latency <= 2 * SLOW_LATENCY, m
    # ... and the intra-node fit never saw it
    assert profile.link_bandwidth >= 3 * profile.inter_node_bandwidth, m
    assert profile.link_latency < profile.inter_node_latency, m
    # the measured profile survives its file: the same profile comes back
    record = profile_record(profile, source="test", measured=True, measurements=m)
    assert load_profile(save_profile(tmp_path / "slow.json", record)) == profile
