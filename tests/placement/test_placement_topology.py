"""The optional topology of a ``HardwareProfile``: nodes of ``ranks_per_node`` ranks with an
intra-node and an inter-node link (``pair_link``, ``link_seconds``), its validation, its JSON
round-trip and the node presets."""

from __future__ import annotations

import json
import math
import re

import pytest

from mixmoe.placement.profile import HardwareProfile, link_seconds, pair_link
from mixmoe.placement.profile_io import (
    PRESETS,
    describe,
    load_profile,
    profile_record,
    save_profile,
)

ONE_LINK = HardwareProfile("one", 1e12, 2e9, 1e-5)
NODES = HardwareProfile(
    "nodes", 1e12, 2e9, 1e-5, ranks_per_node=4, inter_node_bandwidth=5e8, inter_node_latency=3e-5
)


def test_one_link_profile_prices_every_pair_alike() -> None:
    assert ONE_LINK.ranks_per_node is None and ONE_LINK.node_of(1000) == 0
    for a, b in [(0, 1), (3, 4), (0, 255)]:
        assert pair_link(ONE_LINK, a, b) == (2e9, 1e-5)
        assert link_seconds(ONE_LINK, a, b, 4_000) == 1e-5 + 4_000 / 2e9
    assert link_seconds(ONE_LINK, 2, 2, 4_000) == 0.0  # a rank does not send to itself
    assert link_seconds(ONE_LINK, 0, 1, 0) == 0.0  # nothing moves


def test_nodes_split_intra_and_inter_node_pairs() -> None:
    assert [NODES.node_of(r) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert pair_link(NODES, 0, 3) == (2e9, 1e-5)  # same node: the intra-node link
    assert pair_link(NODES, 4, 7) == (2e9, 1e-5)
    assert pair_link(NODES, 3, 4) == (5e8, 3e-5)  # neighbours across a node boundary
    assert pair_link(NODES, 8, 1) == (5e8, 3e-5)
    assert link_seconds(NODES, 1, 2, 10**6) == 1e-5 + 10**6 / 2e9
    assert link_seconds(NODES, 1, 5, 10**6) == 3e-5 + 10**6 / 5e8
    # one rank per node: every pair crosses nodes
    solo = HardwareProfile(
        "solo", 1e12, 2e9, 1e-5, ranks_per_node=1, inter_node_bandwidth=1e9, inter_node_latency=2e-5
    )  # fmt: skip
    assert pair_link(solo, 0, 1) == (1e9, 2e-5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"ranks_per_node": 8}, ValueError, r"topology is partial: \['ranks_per_node'\] set"),
        ({"inter_node_bandwidth": 1e9, "inter_node_latency": 1e-5}, ValueError, "is partial"),
        ({"ranks_per_node": 0, "inter_node_bandwidth": 1e9, "inter_node_latency": 1e-5},
         ValueError, "ranks_per_node must be >= 1, got 0"),
        ({"ranks_per_node": 2.0, "inter_node_bandwidth": 1e9, "inter_node_latency": 1e-5},
         TypeError, "ranks_per_node must be an int or None"),
        ({"ranks_per_node": True, "inter_node_bandwidth": 1e9, "inter_node_latency": 1e-5},
         TypeError, "ranks_per_node must be an int or None"),
        ({"ranks_per_node": 8, "inter_node_bandwidth": -1.0, "inter_node_latency": 1e-5},
         ValueError, "inter_node_bandwidth must be positive and finite"),
        ({"ranks_per_node": 8, "inter_node_bandwidth": 1e9, "inter_node_latency": float("inf")},
         ValueError, "inter_node_latency must be positive and finite"),
        ({"ranks_per_node": 8, "inter_node_bandwidth": "fast", "inter_node_latency": 1e-5},
         TypeError, "inter_node_bandwidth must be a real number or None"),
    ],
)  # fmt: skip
def test_topology_validation(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        HardwareProfile("bad", 1e12, 2e9, 1e-5, **kwargs)


@pytest.mark.parametrize("bad", [(-1, 0, 8), (0, 1.5, 8), (0, 1, -8), (True, 1, 8)])
def test_link_arguments_are_checked(bad) -> None:
    src, dst, nbytes = bad
    with pytest.raises((TypeError, ValueError), match="must be"):
        link_seconds(NODES, src, dst, nbytes)


def test_json_round_trip_with_and_without_topology(tmp_path) -> None:
    path = save_profile(tmp_path / "n.json", profile_record(NODES, source="x", measured=False))
    assert load_profile(path) == NODES
    record = profile_record(ONE_LINK, source="x", measured=False)
    assert not {"ranks_per_node", "inter_node_bandwidth", "inter_node_latency"} & set(record)
    assert load_profile(save_profile(tmp_path / "o.json", record)) == ONE_LINK
    # a file written before the topology existed (no keys) and a hand-written one (8.0, ints)
    old = {"format": "mixmoe-hardware-profile", "version": 1, "name": "old",
           "gemm_flops": 1e12, "link_bandwidth": 2e9, "link_latency": 1e-5}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_profile(tmp_path / "old.json") == HardwareProfile("old", 1e12, 2e9, 1e-5)
    hand = {**old, "ranks_per_node": 4.0, "inter_node_bandwidth": 500000000,
            "inter_node_latency": 3e-5}  # fmt: skip
    (tmp_path / "hand.json").write_text(json.dumps(hand))
    assert load_profile(tmp_path / "hand.json").ranks_per_node == 4
    partial = {**old, "ranks_per_node": 8}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    with pytest.raises(ValueError, match=r"partial.json'.*topology is partial"):
        load_profile(tmp_path / "partial.json")


def test_node_presets_are_estimates_with_two_links() -> None:
    for name, ib in (("h100-nvlink-ib", "h100-ib"), ("a100-nvlink-ib", "a100-ib")):
        p = PRESETS[name].profile
        flat = PRESETS[name.replace("-ib", "")].profile
        source, measured = describe(name)
        assert not measured and source.startswith("ESTIMATE, not measured") and "8 ranks" in source
        assert p.ranks_per_node == 8 and p.gemm_flops == flat.gemm_flops
        # inside a node: the NVLink preset's link; between nodes: the InfiniBand preset's
        assert (p.link_bandwidth, p.link_latency) == (flat.link_bandwidth, flat.link_latency)
        assert pair_link(p, 7, 8) == (PRESETS[ib].profile.link_bandwidth,
                                      PRESETS[ib].profile.link_latency)  # fmt: skip


_NODES = re.compile(
    r"^ESTIMATE, not measured: (.+); gemm = (\S+) TFLOP/s peak x (\S+); (\d+) ranks per node; "
    r"intra-node link = (\S+) GB/s per direction x (\S+), latency (\S+) us; inter-node link = "
    r"(\S+) GB/s per direction x (\S+), latency (\S+) us per all-to-all \(typical NCCL launch "
    r"\+ sync\)$"
)
_PEAK_TFLOPS = {"H100 SXM": 989, "A100 SXM": 312}  # vendors' dense bf16 datasheet peaks


def test_node_presets_hold_the_figures_their_source_states() -> None:
    """Every preset with a topology is peak x efficiency and link x efficiency as its text
    states, its peak the vendor's, its NVLink half the bidirectional figure it names and its
    NIC's Gb/s over 8."""
    nodes = [(n, p) for n, p in PRESETS.items() if p.profile.ranks_per_node is not None]
    assert len(nodes) == 2
    for name, preset in nodes:
        what, peak, f_eff, R, intra, i_eff, i_lat, inter, x_eff, x_lat = _NODES.match(
            preset.source
        ).groups()
        p = preset.profile
        assert p.name == name and p.ranks_per_node == int(R)
        assert float(peak) == _PEAK_TFLOPS[next(g for g in _PEAK_TFLOPS if g in what)]
        assert math.isclose(p.gemm_flops, float(peak) * 1e12 * float(f_eff), rel_tol=1e-12)
        assert math.isclose(p.link_bandwidth, float(intra) * 1e9 * float(i_eff), rel_tol=1e-12)
        assert math.isclose(p.link_latency, float(i_lat) * 1e-6, rel_tol=1e-12)
        bw, lat = p.inter_node_bandwidth, p.inter_node_latency
        assert math.isclose(bw, float(inter) * 1e9 * float(x_eff), rel_tol=1e-12)
        assert math.isclose(lat, float(x_lat) * 1e-6, rel_tol=1e-12)
        nvlink = float(re.search(r"\((\d+) GB/s bidirectional\)", what).group(1))
        assert float(intra) == nvlink / 2
        assert float(inter) == float(re.search(r"(\d+) Gb/s InfiniBand", what).group(1)) / 8
