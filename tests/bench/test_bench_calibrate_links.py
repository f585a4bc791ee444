"""The link sweeps of ``mixmoe calibrate`` without ranks: who sends to whom in each sweep, which
sweeps W and R call for, the fit of each link into the profile, and the errors for bad R (the
sweeps on real gloo ranks: tests/distributed/test_calibrate_links_ranks.py)."""

from __future__ import annotations

import itertools

import pytest

from mixmoe import cli
from mixmoe.bench.calibrate import CalibrateConfig
from mixmoe.bench.calibrate_links import (
    exchange_splits,
    fit_link,
    link_sweeps,
    links_profile,
)
from mixmoe.commands.calibrate import config_from_args, torchrun_ranks_per_node
from mixmoe.placement.profile import HardwareProfile, pair_link
from mixmoe.placement.profile_io import load_profile, profile_record, save_profile

GRID = [(4, 2), (6, 2), (6, 3), (8, 4), (8, 2), (12, 4)]  # (W, R) with 2 <= R < W, R | W
INTRA, INTER = (3e9, 4e-5), (4e8, 9e-5)  # (bandwidth, latency): a fast and a slow link


def _error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixmoe: error: "), err
    return err[0]


@pytest.mark.parametrize("W,R", GRID)
def test_intra_and_inter_sweeps_reach_exactly_the_pairs_of_that_link(W, R) -> None:
    # the oracle: the placement profile's own notion of a pair's link (rank r on node r // R)
    nodes = HardwareProfile(
        "nodes", 1e12, INTRA[0], INTRA[1], ranks_per_node=R,
        inter_node_bandwidth=INTER[0], inter_node_latency=INTER[1],
    )  # fmt: skip
    nbytes = 48_000
    splits = {}
    for link, rank in itertools.product(("intra", "inter"), range(W)):
        s, on_link = exchange_splits(rank, W, R, link, nbytes)
        splits[link, rank] = s
        want = {q for q in range(W) if q != rank and pair_link(nodes, rank, q) == {
            "intra": INTRA, "inter": INTER}[link]}  # fmt: skip
        assert {q for q in range(W) if s[q]} == want, (link, rank, s)
        assert len(set(s[q] for q in want)) == 1  # the same share to every peer
        assert on_link == 4 * sum(s) and abs(on_link - nbytes) < 4 * len(want)
    for link, a, b in itertools.product(("intra", "inter"), range(W), range(W)):
        assert splits[link, a][b] == splits[link, b][a]  # symmetric: send splits = recv splits


def test_one_link_sweep_keeps_its_splits() -> None:
    # every rank, itself included, S / W each; the bytes on the link leave out its own share
    assert exchange_splits(1, 4, None, "all", 4096) == ([256] * 4, 3 * 1024)
    assert exchange_splits(0, 2, None, "all", 4) == ([1, 1], 4)  # at least one element per rank
    assert exchange_splits(0, 4, 2, "intra", 4) == ([0, 1, 0, 0], 4)
    with pytest.raises(ValueError, match="needs 2 <= ranks_per_node < 4"):
        exchange_splits(0, 4, 4, "inter", 4096)
    with pytest.raises(ValueError, match="not one of"):
        exchange_splits(0, 4, 2, "nvlink", 4096)


def test_which_links_are_measured() -> None:
    assert link_sweeps(8, 4)[0] == ("intra", "inter")
    sweeps, what = link_sweeps(8, 4)
    assert "2 nodes of 4 ranks" in what and "measured apart" in what
    assert link_sweeps(8, None)[0] == ("all",)
    sweeps, what = link_sweeps(4, 4)  # one node: one link, and it says so
    assert sweeps == ("all",) and "one node" in what and "one link" in what
    sweeps, what = link_sweeps(4, 8)
    assert sweeps == ("all",) and "one node (8 ranks per node >= 4 ranks)" in what
    sweeps, what = link_sweeps(4, 1)  # every pair crosses nodes: one link, the inter-node one
    assert sweeps == ("all",) and "inter-node" in what and "one-link model" in what


@pytest.mark.parametrize(
    "W,R,error,match",
    [
        (4, 3, ValueError, r"ranks_per_node=3 does not divide world_size 4.*give one of \[1, 2, 4\]"),
        (6, 4, ValueError, r"does not divide world_size 6.*\[1, 2, 3, 6\]"),
        (1, 2, ValueError, "one rank has no link to measure; drop --ranks-per-node"),
        (4, 0, ValueError, "ranks_per_node must be >= 1"),
        (4, True, TypeError, "ranks_per_node must be an int"),
        (4, 2.0, TypeError, "ranks_per_node must be an int"),
    ],
)  # fmt: skip
def test_bad_ranks_per_node(W, R, error, match) -> None:
    with pytest.raises(error, match=match):
        CalibrateConfig(world_size=W, ranks_per_node=R)
    with pytest.raises(error, match=match):
        link_sweeps(W, R)


def test_bad_ranks_per_node_on_the_command_line(capsys) -> None:
    err = _error(capsys, ["calibrate", "--world-size", "4", "--ranks-per-node", "3"])
    assert "ranks_per_node=3 does not divide world_size 4" in err
    err = _error(capsys, ["calibrate", "--world-size", "1", "--ranks-per-node", "2"])
    assert "one rank has no link" in err


def _points(bandwidth: float, latency: float, sizes=(4096, 65536, 1 << 20)) -> list[dict]:
    """A sweep that lies exactly on latency + bytes / bandwidth."""
    return [
        {"bytes_per_rank": n, "bytes_to_others": n, "peers": 1, "s": latency + n / bandwidth}
        for n in sizes
    ]


def test_each_link_is_fitted_from_its_own_sweep_into_its_own_fields(tmp_path) -> None:
    sweeps = {"intra": _points(*INTRA), "inter": _points(*INTER)}
    profile, entries = links_profile("two", 1e11, sweeps, 8, 4)
    assert profile.ranks_per_node == 4 and profile.gemm_flops == 1e11
    assert profile.link_bandwidth == pytest.approx(INTRA[0], rel=1e-9)
    assert profile.link_latency == pytest.approx(INTRA[1], rel=1e-9)
    assert profile.inter_node_bandwidth == pytest.approx(INTER[0], rel=1e-9)
    assert profile.inter_node_latency == pytest.approx(INTER[1], rel=1e-9)
    assert pair_link(profile, 0, 3) == (profile.link_bandwidth, profile.link_latency)
    assert pair_link(profile, 3, 4) == (profile.inter_node_bandwidth, profile.inter_node_latency)
    assert entries["intra_node"] is sweeps["intra"] and entries["inter_node"] is sweeps["inter"]
    assert entries["inter_node_fit"]["method"] == "least-squares intercept and slope"
    assert entries["topology"]["sweeps"] == ["intra", "inter"]
    # the JSON keeps the topology and loads back equal
    path = save_profile(tmp_path / "p.json", profile_record(profile, source="t", measured=True))
    assert load_profile(path) == profile


def test_one_link_fit_is_the_one_link_model() -> None:
    profile, entries = links_profile("one", 1e11, {"all": _points(*INTER)}, 4, 4)
    assert profile.ranks_per_node is None and profile.inter_node_bandwidth is None
    assert profile.link_bandwidth == pytest.approx(INTER[0], rel=1e-9)
    assert set(entries) == {"all_to_all", "a2a_fit", "topology"}
    assert "one node" in entries["topology"]["measured"]
    with pytest.raises(ValueError, match=r"expected \['intra', 'inter'\]"):
        links_profile("x", 1e11, {"all": _points(*INTER)}, 8, 4)


def test_fit_link_floors_the_latency_and_falls_back_when_noisy() -> None:
    # a negative intercept is floored at the fastest point / 2
    pts = [{"bytes_to_others": n, "s": n / 1e9} for n in (1000, 2000)]
    lat, bw, rec = fit_link(pts)
    assert bw == pytest.approx(1e9) and lat == pytest.approx(0.5e-6) and rec["intercept_s"] < lat
    # time falling with size (noise): latency the fastest call, bandwidth from the largest size
    pts = [{"bytes_to_others": 1000, "s": 3e-3}, {"bytes_to_others": 10**6, "s": 2e-3}]
    lat, bw, rec = fit_link(pts)
    assert lat == 2e-3 and bw == pytest.approx(10**6 / 1e-3) and rec["method"].startswith("fall")


def test_torchrun_node_size_is_the_default(monkeypatch) -> None:
    for k, v in {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    assert torchrun_ranks_per_node() == 8
    parser = cli.build_parser()
    cfg = config_from_args(parser.parse_args(["calibrate"]))
    assert (cfg.world_size, cfg.ranks_per_node) == (16, 8)
    cfg = config_from_args(parser.parse_args(["calibrate", "--ranks-per-node", "4"]))
    assert cfg.ranks_per_node == 4  # the flag wins
    monkeypatch.delenv("RANK")
    assert torchrun_ranks_per_node() is None  # not under torchrun: one link unless given


def test_one_node_run_prints_one_link_and_why(capsys) -> None:
    from mixmoe.commands.calibrate import _print_links

    _, entries = links_profile("one", 1e11, {"all": _points(*INTRA)}, 4, 4)
    _print_links(entries, 4, spawned=True)
    text = capsys.readouterr().out
    assert "all_to_all_single on 4 ranks" in text and "intra-node all_to_all" not in text
    assert "(ranks per node 4: one node (4 ranks per node >= 4 ranks)" in text
