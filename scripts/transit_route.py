"""What sending a replica's far copy through its owner's node peers would change for ``mix``, by
the cost model: a relay route that is priced here, not built.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/transit_route.py \
        [--cases seeds-E32:64:hotrank:0.5,seeds:64:zipf:1.2] [--rule no-near|always|owner:F] \
        [--profile NAME]

Legend: W ranks, per_node ranks a node, P = per_node - 1 node peers of the owner. A case is
shape[-E<experts a rank>]:W:workload (``bench balance``'s shapes and workloads, its seed).

Under a topology the relay (``placement/relay.py``) sends each replicated expert's far holders
one copy across nodes, out of the owner's inter-node link. A hot rank whose experts all have
far holders sends one copy per expert over that one link. With the seeds' shape at 32 experts
a rank (hotrank:0.5, W = 64, ``h100-nvlink-ib``), that is 12.3 ms of the hot rank's 12.4 ms. The
*transit* route priced here instead (``transit_messages``), for R far holders:
- round 0: the owner sends chunk p of the relay's far scatter (R chunks) to a node peer
  (intra-node link) instead of to far holder p;
- round 1: that peer sends it on to far holder p. One copy still crosses in all, but spread
  over up to P links;
- then the far side's exchange and all-gather, one round later than the relay's.

In copies (sent + received, on the relay's 2**-24 grid; the tests count them from the
messages):
- the owner's far copy moves to the intra-node link;
- a peer that carries n of the R chunks gains 2 * grid(n, R), of which grid(n, R) crosses
  nodes;
- the far side takes one round more.

Which experts take it (``--rule``):
- ``no-near``: the experts with far holders and no holder in the owner's node;
- ``always``: every expert with far holders;
- ``owner:F`` (default ``owner:0.25``): ``no-near``'s experts of the owners whose experts
  receive at least a fraction F of all the step's rows (``heavy_owners``: a set fixed by the
  counts before the plan, so that every rank derives the same route).

Each case is planned twice and each plan is priced by its own route:
- by the planner as built (the relay);
- by the Python planner with the relay's pricing (``relay_degrees``, ``relay_inter_copies``)
  swapped for the transit's. The compiled planner prices only the built route.

Printed: a Markdown row per case (both steps, their % of force-balanced, the change), then the
averages (each case capped at 100%, as ``bench balance``). An estimate of what building the
route would give, to decide whether to build it: the layer does not execute this route.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
from collections.abc import Iterator, Sequence

import torch

from mixmoe.gating.imbalance import check_workload
from mixmoe.placement import balance, cost_model, range_state, relay
from mixmoe.placement.native_lib import ENV_OFF
from mixmoe.placement.profile_io import load_profile
from mixmoe.simulate.workloads import (
    BalanceConfig,
    balanced_step_s,
    first_step_mix,
    layer_shape,
    shape_spec,
)

CASES = (
    "seeds-E32:64:hotrank:0.5,seeds-E32:64:hotset:8:0.5,seeds-E32:64:zipf:2.0,"
    "seeds:64:zipf:1.2,seeds:64:hotset:8:0.5,deepseek:64:zipf:1.2"
)
RULES = ("no-near", "always", "owner:F")
PRICING = ("relay_degrees", "relay_inter_copies")  # the names swapped in each module below
# the modules whose imported names are swapped (relay's own stay: the transit's pricing reads them)
_USERS = (range_state, cost_model, balance)


def parse_rule(text: str) -> tuple[bool, float | None]:
    """``--rule`` as (whether an expert with a near holder takes the transit too, the owners'
    share of the rows F or None: every owner)."""
    if text in ("no-near", "always"):
        return text == "always", None
    kind, _, share = text.partition(":")
    try:
        F = float(share)
    except ValueError:
        F = -1.0
    if kind != "owner" or not 0.0 < F <= 1.0:
        raise ValueError(f"rule {text!r} is not one of no-near, always, owner:F (0 < F <= 1)")
    return False, F


def heavy_owners(C_WN: torch.Tensor, E: int, share: float) -> frozenset[int]:
    """The ranks whose E experts receive at least ``share`` of C's rows."""
    rows_W = C_WN.sum(0).view(-1, E).sum(1)  # rows routed to each rank's experts
    return frozenset(torch.nonzero(rows_W >= share * float(rows_W.sum())).flatten().tolist())


def _transit_holders(
    owner: int,
    holders: Sequence[int],
    distance: relay.Distance | None,
    near_ok: bool,
    owners: frozenset[int] | None,
) -> tuple[list[tuple[int, int]], list[int], list[list[int]]] | None:
    """(each node peer with the far chunks it carries, the near holders, the far nodes' holders),
    or None where the expert keeps the relay's route (no topology, no far holder, a near holder
    unless ``near_ok``, an owner outside ``owners``). The far copy is cut in R chunks as the
    relay's far scatter cuts it; chunk p goes through peer (s + p) mod P, s the far holders'
    rank sum (a rotation so that an owner's experts load its P peers alike: the route's builder
    would take it from the expert id, which the pricing's arguments lack)."""
    per_node = getattr(distance, "ranks_per_node", None)
    if per_node is None or per_node < 2 or not holders:
        return None
    if owners is not None and owner not in owners:
        return None
    near, groups = relay.holder_groups(owner, holders, distance)
    if not groups or (near and not near_ok):
        return None
    home = owner // per_node * per_node
    peers = [r for r in range(home, home + per_node) if r != owner]
    far = [h for grp in groups for h in grp]
    P, R, s = len(peers), len(far), sum(far)
    counts = [sum(1 for p in range(R) if (s + p) % P == q) for q in range(P)]
    return [(r, n) for r, n in zip(peers, counts, strict=True) if n], near, groups


def _rounds(near: list[int], groups: list[list[int]]) -> int:
    """The transit route's rounds: the near scatter (+ all-gather), and the far side's one round
    later than the relay's (scatter, exchange when 2+ far nodes, all-gather inside them)."""
    k, R, L = len(near), sum(map(len, groups)), len(groups)
    near_rounds = (1 + (k >= 2)) if k else 0
    far_rounds = 1 + (R >= 2) + (L >= 2 and any(len(grp) >= 2 for grp in groups))
    return max(near_rounds, far_rounds + 1)


def transit_degrees(near_ok: bool, owners: frozenset[int] | None = None):
    """``relay_degrees`` under the transit route (module doc): ({rank: copies}, rounds)."""

    def degrees(owner, holders, distance=None):
        out, rounds = relay.relay_degrees(owner, holders, distance)
        route = _transit_holders(owner, holders, distance, near_ok, owners)
        if route is None:
            return out, rounds
        carried, near, groups = route
        R = sum(map(len, groups))
        for r, n in carried:  # n chunks of R received inside the node, sent across
            out[r] = out.get(r, 0.0) + 2 * relay._grid(n, R)
        return out, _rounds(near, groups)  # the owner's far copy now goes inside: same count

    return degrees


def transit_inter(near_ok: bool, owners: frozenset[int] | None = None):
    """``relay_inter_copies`` under the transit route: the owner's crossing copy moved to the
    peers that carry it, n chunks of R each."""

    def inter(owner, holders, distance):
        out = relay.relay_inter_copies(owner, holders, distance)
        route = _transit_holders(owner, holders, distance, near_ok, owners)
        if route is None:
            return out
        carried, _, groups = route
        R = sum(map(len, groups))
        out.pop(owner, None)
        for r, n in carried:
            out[r] = out.get(r, 0.0) + relay._grid(n, R)
        return out

    return inter


def transit_messages(
    owner: int, holders: Sequence[int], distance: relay.Distance, near_ok: bool = False
) -> tuple[tuple[relay.Message, ...], ...]:
    """The route the pricing above counts, as ``relay.relay_messages`` gives the relay's: round
    k's (sender, receiver, chunk j, chunks n), sorted. The relay's far scatter (owner -> far
    holder p, chunk p of R) becomes owner -> peer, then peer -> far holder p one round later;
    the far side's later rounds move one round later too; the near side's stay."""
    rounds = relay.relay_messages(owner, holders, distance)
    route = _transit_holders(owner, holders, distance, near_ok, None)
    if route is None:
        return rounds
    _, near, groups = route
    far = [h for grp in groups for h in grp]
    per_node = distance.ranks_per_node  # type: ignore[attr-defined]
    home = owner // per_node * per_node
    peers = [r for r in range(home, home + per_node) if r != owner]
    s = sum(far)
    out: list[list[relay.Message]] = [[] for _ in range(len(rounds) + 1)]
    for k, messages in enumerate(rounds):
        for m in messages:
            sender, receiver, j, n = m
            if receiver not in far:  # the near side: as the relay
                out[k].append(m)
            elif k == 0:  # the far scatter, through a peer
                peer = peers[(s + far.index(receiver)) % len(peers)]
                out[0].append((owner, peer, j, n))
                out[1].append((peer, receiver, j, n))
            else:
                out[k + 1].append(m)
    return tuple(tuple(sorted(rnd)) for rnd in out if rnd)


@contextlib.contextmanager
def transit_pricing(near_ok: bool, owners: frozenset[int] | None = None) -> Iterator[None]:
    """The Python planner and pricing with the transit route's copies (the compiled planner off:
    it prices the relay's), restored on exit."""
    swapped = {
        "relay_degrees": transit_degrees(near_ok, owners),
        "relay_inter_copies": transit_inter(near_ok, owners),
    }
    saved = [(m, name, getattr(m, name)) for m in _USERS for name in PRICING
             if hasattr(m, name)]  # fmt: skip
    native = os.environ.get(ENV_OFF)
    try:
        for m, name, _ in saved:
            setattr(m, name, swapped[name])
        os.environ[ENV_OFF] = "0"
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
        if native is None:
            os.environ.pop(ENV_OFF, None)
        else:
            os.environ[ENV_OFF] = native


def parse_shape(name: str):
    """``bench balance``'s shape, or shape-E<k>: its experts per rank set to k."""
    base, sep, per_rank = name.partition("-E")
    spec = shape_spec(base)
    if not sep:
        return spec
    if not per_rank.isdigit() or int(per_rank) < 1:
        raise ValueError(f"shape {name!r}: -E takes experts per rank >= 1, e.g. seeds-E32")
    E = int(per_rank)
    return dataclasses.replace(spec, name=name, experts_per_rank=E, experts=None)


def case_steps(cfg: BalanceConfig, spec, world_size: int, workload: str, rule: str):
    """(force-balanced, relay, transit) predicted steps (s) of the case's first step, the
    transit under ``rule`` (``parse_rule``)."""
    near_ok, share = parse_rule(rule)
    layer, profile, C_WN, mix = first_step_mix(cfg, spec, world_size, workload)
    built = mix(profile).prediction.step_s
    owners = None if share is None else heavy_owners(C_WN, layer.experts_per_rank, share)
    with transit_pricing(near_ok, owners):
        transit = mix(profile).prediction.step_s
    return balanced_step_s(cfg, spec, world_size), built, transit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="shape[-E<k>]:W:workload, comma-separated")
    ap.add_argument("--rule", default="owner:0.25", help=" | ".join(RULES))
    ap.add_argument("--profile", default="h100-nvlink-ib", help="a profile with nodes")
    args = ap.parse_args(argv)
    try:
        parse_rule(args.rule)
        cfg = BalanceConfig(profile=args.profile)
        if getattr(load_profile(args.profile), "ranks_per_node", None) is None:
            raise ValueError(f"profile {args.profile!r} has no nodes; use e.g. h100-nvlink-ib")
        cases = []
        for case in args.cases.split(","):
            parts = case.split(":", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                raise ValueError(f"case {case!r} is not shape:W:workload (W an int)")
            spec, world, workload = parse_shape(parts[0]), int(parts[1]), parts[2]
            check_workload(workload, world, spec.top_k, layer_shape(spec, world).num_experts)
            cases.append((spec, world, workload))
    except ValueError as e:
        ap.error(str(e))
    print("| shape | W | workload | relay ms | % | transit ms | % | change |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    pct = {"relay": [], "transit": []}
    for spec, world, workload in cases:
        ideal, built, transit = case_steps(cfg, spec, world, workload, args.rule)
        pct["relay"].append(min(1.0, ideal / built))
        pct["transit"].append(min(1.0, ideal / transit))
        print(f"| {spec.name} | {world} | {workload} | {1e3 * built:.3f} | "
              f"{100 * ideal / built:.1f} | {1e3 * transit:.3f} | {100 * ideal / transit:.1f} | "
              f"{100 * (transit / built - 1):+.1f}% |", flush=True)  # fmt: skip
    for name, xs in pct.items():
        print(f"{name}: {100 * statistics.mean(xs):.1f}% of force-balanced on average, worst "
              f"{100 * min(xs):.1f}% (rule {args.rule})")  # fmt: skip


if __name__ == "__main__":
    main()
