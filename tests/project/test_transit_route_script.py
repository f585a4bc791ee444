"""``scripts/transit_route.py`` (what sending a replica's far copy through its owner's node peers
would change for ``mix``): its pricing of the route, that its relay plan is the one ``bench
balance`` reports, that it restores the planner, and one-line errors."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixmoe.placement import cost_model, range_state, relay
from mixmoe.simulate.workloads import BalanceConfig, case_records

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "transit_route", ROOT / "scripts/transit_route.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/transit_route.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_transit_moves_the_owners_crossing_copy_to_its_node_peers() -> None:
    tr = _script()
    nodes = relay.nodes_of(4)  # ranks 0-3 the owner's node
    far_only = [5, 6, 9]  # two far nodes, no near holder
    base, rounds = relay.relay_degrees(0, far_only, nodes)
    base_inter = relay.relay_inter_copies(0, far_only, nodes)
    got, got_rounds = tr.transit_degrees(False)(0, far_only, nodes)
    got_inter = tr.transit_inter(False)(0, far_only, nodes)
    third = relay._grid(1, 3)
    assert got_rounds == rounds + 1
    # the peers 1-3 each receive a third inside the node and send it across
    assert {r: got[r] for r in (1, 2, 3)} == {1: 2 * third, 2: 2 * third, 3: 2 * third}
    assert {r: got[r] for r in base} == base  # the owner and far holders as before
    assert 0 not in got_inter  # the owner's copy no longer crosses
    assert {r: got_inter[r] for r in (1, 2, 3)} == {1: third, 2: third, 3: third}
    assert {r: got_inter[r] for r in far_only} == {r: base_inter[r] for r in far_only}
    # one copy still leaves the owner's node (the peers' thirds, on the 2**-24 grid)
    assert sum(got_inter[r] for r in (1, 2, 3)) == pytest.approx(base_inter[0], abs=1e-6)
    # a near holder (rank 2): no-near keeps the relay's route, always takes the transit
    with_near = [2, 5, 6, 9]
    assert tr.transit_degrees(False)(0, with_near, nodes) == relay.relay_degrees(
        0, with_near, nodes
    )
    always, _ = tr.transit_degrees(True)(0, with_near, nodes)
    assert always[1] == 2 * third and always[2] > relay.relay_degrees(0, with_near, nodes)[0][2]
    # one link: nothing to route through
    assert tr.transit_degrees(True)(0, far_only, None) == relay.relay_degrees(0, far_only)
    # an owner outside the rule's set keeps the relay's route
    assert tr.transit_degrees(False, frozenset({1}))(0, far_only, nodes) == (base, rounds)
    assert tr.transit_degrees(False, frozenset({0}))(0, far_only, nodes) == (got, got_rounds)


def _copies(rounds, distance) -> tuple[dict, dict, int]:
    """Each rank's copies sent + received (each floored to the relay's grid), those crossing
    nodes, from the messages; checks every sender holds what it sends (the piece, or the whole
    row to cut it from) before its round; returns the messages' ranks' holdings too."""
    sent, got, sent_x, got_x = {}, {}, {}, {}
    for messages in rounds:
        for a, b, _, n in messages:
            for d, r in ((sent, a), (got, b)):
                d.setdefault(r, {}).setdefault(n, 0)
                d[r][n] += 1
            if distance(a, b):
                for d, r in ((sent_x, a), (got_x, b)):
                    d.setdefault(r, {}).setdefault(n, 0)
                    d[r][n] += 1

    def total(*ds):
        out = {}
        for d in ds:
            for r, by_n in d.items():
                out[r] = out.get(r, 0.0) + sum(relay._grid(c, n) for n, c in by_n.items())
        return out

    return total(sent, got), total(sent_x, got_x), len(rounds)


def _holds_all(rounds, owner: int, holders) -> bool:
    """Every sender holds its piece (or the whole row) at its round; every holder ends with the
    whole row or all n chunks of one cut."""
    have = {owner: {(0, 1)}}
    for messages in rounds:
        for a, _, j, n in messages:
            if not have.get(a, set()) & {(j, n), (0, 1)}:
                return False
        for _, b, j, n in messages:
            have.setdefault(b, set()).add((j, n))
    for h in holders:
        pieces = have.get(h, set())
        if (0, 1) not in pieces and not any(
            all((j, n) in pieces for j in range(n)) for _, n in pieces
        ):
            return False
    return True


@pytest.mark.parametrize("per_node", [4, 8])
def test_the_pricing_counts_the_transit_route(per_node: int) -> None:
    """Random owners and holders: the transit route's messages are a valid route (every holder
    gets the whole row, every sender holds what it sends), and its copies per rank, crossing
    copies and rounds are what ``transit_degrees`` and ``transit_inter`` price."""
    tr = _script()
    rng = random.Random(per_node)
    nodes = relay.nodes_of(per_node)
    routed = 0
    for _ in range(200):
        W = per_node * rng.choice([2, 3, 5])
        owner = rng.randrange(W)
        holders = rng.sample([r for r in range(W) if r != owner], rng.randint(1, min(12, W - 1)))
        near_ok = rng.random() < 0.5
        rounds = tr.transit_messages(owner, holders, nodes, near_ok)
        assert _holds_all(rounds, owner, holders)
        copies, crossing, depth = _copies(rounds, nodes)
        degrees, priced_depth = tr.transit_degrees(near_ok)(owner, holders, nodes)
        inter = tr.transit_inter(near_ok)(owner, holders, nodes)
        assert depth == priced_depth
        assert set(copies) == set(degrees)
        for r, x in degrees.items():
            assert copies[r] == pytest.approx(x, abs=1e-6), r
        assert {r: x for r, x in crossing.items() if x} == pytest.approx(inter, abs=1e-6)
        routed += rounds != relay.relay_messages(owner, holders, nodes)
    assert routed >= 50


def test_heavy_owners_are_the_ranks_with_the_rows_share() -> None:
    tr = _script()
    # W = 4 ranks, N = 4 experts; rows to each expert: 10, 0, 2, 8 of 20
    C = torch.tensor([[5, 0, 1, 0], [5, 0, 1, 1], [0, 0, 0, 7], [0, 0, 0, 0]])
    assert tr.heavy_owners(C, 1, 0.4) == frozenset({0, 3})
    assert tr.heavy_owners(C, 1, 0.5) == frozenset({0})
    # with E = 2 (W = 2: rank 0 owns experts 0-1, rank 1 experts 2-3): 10 and 10 of 20
    assert tr.heavy_owners(C, 2, 0.5) == frozenset({0, 1})
    assert tr.parse_rule("owner:0.25") == (False, 0.25)
    assert tr.parse_rule("always") == (True, None)


def test_transit_pricing_is_restored_after_the_plan() -> None:
    tr = _script()
    before = (range_state.relay_degrees, cost_model.relay_inter_copies)
    native = os.environ.get("MIXMOE_NATIVE")
    with tr.transit_pricing(False):
        assert range_state.relay_degrees is not before[0]
        assert os.environ["MIXMOE_NATIVE"] == "0"
    assert (range_state.relay_degrees, cost_model.relay_inter_copies) == before
    assert os.environ.get("MIXMOE_NATIVE") == native


def test_owner_rule_routes_only_the_heavy_owners_experts() -> None:
    """Under owner:0.25 only the hot rank (half of all rows) takes the transit: its case gains
    as much as under no-near, a hot expert set (no owner near a quarter) keeps its plan."""
    proc = _run("--cases", "seeds-E32:64:hotrank:0.5,seeds-E32:64:hotset:8:0.5")  # the default
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hot, spread = ([c.strip() for c in line.strip("|").split("|")]
                   for line in proc.stdout.splitlines()[2:4])  # fmt: skip
    no_near = _run("--cases", "seeds-E32:64:hotrank:0.5", "--rule", "no-near")
    assert hot[5] == [c.strip() for c in no_near.stdout.splitlines()[2].strip("|").split("|")][5]
    assert float(hot[5]) < 0.7 * float(hot[3])
    assert spread[5] == spread[3] and spread[7] == "+0.0%"


def test_transit_route_starts_from_bench_balance_plan() -> None:
    proc = _run("--cases", "seeds-E32:64:hotrank:0.5", "--rule", "no-near")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == ["seeds-E32", "64", "hotrank:0.5"]
    built, built_pct, transit, transit_pct = map(float, cells[3:7])
    # the relay column is the plan bench balance reports under the same profile
    tr = _script()
    spec = tr.parse_shape("seeds-E32")
    cfg = BalanceConfig(shapes=(spec,), worlds=(64,), workloads=("hotrank:0.5",),
                        strategies=("mix",), repeats=1, cold=False,
                        profile="h100-nvlink-ib")  # fmt: skip
    (record,) = case_records(cfg, spec, 64, "hotrank:0.5")
    assert built == pytest.approx(record["step_ms"], abs=0.0006)
    assert built_pct == pytest.approx(100 * record["pct_balanced"], abs=0.06)
    # the hot rank's 32 far copies leave through its 7 peers' links: the step falls
    assert transit < 0.7 * built and transit_pct > built_pct
    assert lines[-1].startswith("transit:") and "rule no-near" in lines[-1]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--profile", "h100-ib"), "has no nodes"),
        (("--cases", "seeds:64"), "is not shape:W:workload"),
        (("--cases", "seeds-Ex:64:zipf:1.2"), "-E takes experts per rank"),
        (("--cases", "nope:64:zipf:1.2"), "unknown"),
        (("--rule", "sometimes"), "is not one of no-near, always, owner:F"),
        (("--rule", "owner:0"), "is not one of no-near, always, owner:F"),
    ],
)
def test_transit_route_refuses_bad_input(argv: tuple[str, ...], needle: str) -> None:
    proc = _run(*argv)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr
