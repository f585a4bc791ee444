"""The link sweeps of ``mixmoe calibrate`` and their fit: one link for every pair of ranks, or,
given R ranks per node, the intra-node and the inter-node link measured apart.

Legend: W ranks, R ranks per node (rank r on node r // R, as ``torchrun --nproc-per-node R``
numbers them), S bytes a rank sends per exchange (a size of ``a2a_bytes``), P the peers a rank
sends to in one exchange.

Every point is one ``all_to_all_single`` on all W ranks (every rank joins every call, also
those that send nothing to some peers; the split sizes say who sends to whom), timed as the max
over ranks (all-reduced), the median over ``repeats`` after ``warmup``:

- ``all`` (one link): each rank sends S / W bytes to every rank, itself included; the bytes on
  the link are S (W-1)/W. This is the sweep of the one-link model.
- ``intra``: each rank sends S / (R-1) bytes to each other rank of its node and nothing across
  nodes (P = R-1): every node's link busy at once, as in a layer's exchange.
- ``inter``: each rank sends S / (W-R) bytes to each rank of the other nodes and nothing inside
  its node (P = W-R): every rank's inter-node link (one NIC per GPU) busy at once.

Each sweep is fitted as the cost model prices a transfer, ``latency + bytes / bandwidth``, to
(bytes on that link, seconds) by least squares (``fit_link``). Gloo ranks on one host have no
nodes: R groups consecutive ranks and both links run over loopback, so they measure about the
same; the mechanism and the profile's fields are what such a run shows.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mixmoe.bench.timing import median
from mixmoe.comm import Communicator
from mixmoe.placement.profile import HardwareProfile
from mixmoe.validation import check_int

__all__ = [
    "LINK_SWEEPS",
    "check_ranks_per_node",
    "exchange_splits",
    "fit_line",
    "fit_link",
    "link_sweeps",
    "links_profile",
    "sweep_links",
]

# the sweeps a calibration may run (see the module doc)
LINK_SWEEPS = ("all", "intra", "inter")
FP32_BYTES = 4  # the sweeps move fp32 elements


def check_ranks_per_node(world_size: int, ranks_per_node: int | None) -> None:
    """``ValueError`` naming the fix when R cannot split W ranks into nodes: R < 1, one rank
    (no link at all), or R < W not dividing W. R >= W is accepted (one node)."""
    if ranks_per_node is None:
        return
    check_int("ranks_per_node", ranks_per_node, 1)
    W, R = world_size, ranks_per_node
    if W == 1:
        raise ValueError(
            f"ranks_per_node={R} with world_size 1: one rank has no link to measure; drop "
            "--ranks-per-node (or calibrate on several ranks)"
        )
    if R < W and W % R:
        divisors = [d for d in range(1, W + 1) if W % d == 0]
        raise ValueError(
            f"ranks_per_node={R} does not divide world_size {W}: nodes hold R consecutive ranks "
            f"each (rank r on node r // R); give one of {divisors}"
        )


def link_sweeps(world_size: int, ranks_per_node: int | None) -> tuple[tuple[str, ...], str]:
    """(the sweeps to run, one sentence saying what is measured) for W ranks and R ranks per node
    (checked by ``check_ranks_per_node``). Two links only when there are several nodes of
    several ranks (2 <= R < W); otherwise one link, and the sentence says why."""
    check_ranks_per_node(world_size, ranks_per_node)
    W, R = world_size, ranks_per_node
    if R is None:
        return ("all",), f"one link for every pair of the {W} ranks (no ranks per node given)"
    if R >= W:
        return ("all",), (
            f"one node ({R} ranks per node >= {W} ranks): every pair is intra-node, so one "
            "link is measured, stored as the one-link model"
        )
    if R == 1:
        return ("all",), (
            f"one rank per node: every pair of the {W} ranks crosses nodes, so one link (the "
            "inter-node one) is measured, stored as the one-link model"
        )
    return ("intra", "inter"), (
        f"{W // R} nodes of {R} ranks: the intra-node link (each rank to the other {R - 1} of "
        f"its node) and the inter-node link (each rank to the {W - R} ranks of other nodes) "
        "measured apart"
    )


def exchange_splits(
    rank: int, world_size: int, ranks_per_node: int | None, link: str, nbytes: int
) -> tuple[list[int], int]:
    """(fp32 elements ``rank`` sends to each of the W ranks, bytes it sends over ``link`` to
    other ranks) for one exchange of about ``nbytes`` bytes per rank (at least one element per
    peer). The splits are symmetric (rank a sends to b exactly what b sends to a), so they are
    the receive splits too."""
    if link not in LINK_SWEEPS:
        raise ValueError(f"link {link!r} is not one of {LINK_SWEEPS}")
    W, R = world_size, ranks_per_node
    if link == "all":  # everyone, itself included: the one-link sweep as it always was
        per = max(1, nbytes // (FP32_BYTES * W))
        return [per] * W, FP32_BYTES * per * (W - 1)
    if R is None or not 2 <= R < W:
        raise ValueError(f"link {link!r} needs 2 <= ranks_per_node < {W}, got {R}")
    node = rank // R
    if link == "intra":  # the other ranks of this node: [node * R, node * R + R) less itself
        peers = [q for q in range(node * R, node * R + R) if q != rank]
    else:  # every rank whose node differs from this rank's
        peers = [q for q in range(W) if q // R != node]
    per = max(1, nbytes // (FP32_BYTES * len(peers)))
    splits = [0] * W
    for q in peers:
        splits[q] = per
    return splits, FP32_BYTES * per * len(peers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sweep_links(
    comm: Communicator, cfg, links: tuple[str, ...], ranks_per_node: int | None = None
) -> dict[str, list[dict[str, float]]]:
    """Every rank (``cfg`` a ``CalibrateConfig``: ``a2a_bytes``, ``warmup``, ``repeats``,
    ``device``): {link: one record per size of ``cfg.a2a_bytes``}: bytes_per_rank (sent by a
    rank, to itself included), bytes_to_others (on that link), peers (other ranks reached),
    s (median seconds of the slowest rank). The links' calls alternate repeat by repeat, so a
    change of load on a shared machine reaches every link alike. Every rank returns the same."""
    W, rank = comm.world_size, comm.rank
    device = torch.device(cfg.device)
    out: dict[str, list[dict[str, float]]] = {link: [] for link in links}
    for nbytes in cfg.a2a_bytes:
        plans = {link: exchange_splits(rank, W, ranks_per_node, link, nbytes) for link in links}
        bufs = {}
        for link, (splits, _) in plans.items():
            x = torch.randn(sum(splits), device=device)
            bufs[link] = (x, torch.empty_like(x))
        times: dict[str, list[float]] = {link: [] for link in links}
        for i in range(cfg.warmup + cfg.repeats):
            for link in links:
                splits = plans[link][0]
                x, y = bufs[link]
                comm.barrier()
                _sync(device)
                t0 = time.perf_counter()
                comm.all_to_all(y, x, splits, splits)
                _sync(device)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                if i >= cfg.warmup:
                    times[link].append(float(comm.all_reduce_max(dt)))
        for link, (splits, on_link) in plans.items():
            out[link].append(
                {
                    "bytes_per_rank": FP32_BYTES * sum(splits),
                    "bytes_to_others": on_link,
                    # other ranks this rank sends to (the same count on every rank)
                    "peers": sum(1 for q, n in enumerate(splits) if n and q != rank),
                    "s": median(times[link]),
                }
            )
    return out


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y against x (at least two distinct x)."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx == 0:
        raise ValueError(f"a line fit needs at least two distinct sizes, got {x}")
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx
    return my - slope * mx, slope


def fit_link(points: list[dict[str, float]]) -> tuple[float, float, dict[str, Any]]:
    """(latency s, bandwidth bytes/s, the fit's record) of one sweep (records of ``sweep_links``):
    the intercept and 1 / slope of a least-squares line of seconds against bytes_to_others; the
    latency floored at the fastest point / 2 when the intercept comes out below it (negative on
    a noisy machine). No positive slope (too noisy): latency = the fastest point, bandwidth from
    the largest size. The record says which method gave the figures."""
    sent = [p["bytes_to_others"] for p in points]
    secs = [p["s"] for p in points]
    lat, slope = fit_line(sent, secs)
    method = "least-squares intercept and slope"
    if slope <= 0:  # noisy: latency = the fastest call, bandwidth from the largest size
        i = max(range(len(sent)), key=sent.__getitem__)
        lat = min(secs)
        slope = max(secs[i] - lat, secs[i] / 2) / sent[i]
        method = "fallback: latency = fastest call, bandwidth at the largest size"
    floor = min(secs) / 2
    record = {"intercept_s": lat, "bandwidth": 1.0 / slope, "latency_floor_s": floor}
    return max(lat, floor), 1.0 / slope, {**record, "method": method}


def links_profile(
    name: str,
    gemm_flops: float,
    sweeps: dict[str, list[dict[str, float]]],
    world_size: int,
    ranks_per_node: int | None,
) -> tuple[HardwareProfile, dict[str, Any]]:
    """(the profile with the fitted links, the measurements' link entries) from the sweeps
    ``link_sweeps(world_size, ranks_per_node)`` names, each fitted by ``fit_link``.

    One link (sweep ``all``): ``link_bandwidth`` / ``link_latency``, no topology; entries
    ``all_to_all`` (the points) and ``a2a_fit``. Two links (``intra``, ``inter``): the intra-node
    fit is ``link_*``, the inter-node fit ``inter_node_*`` and ``ranks_per_node`` R; entries
    ``intra_node`` / ``inter_node`` (points) and ``intra_node_fit`` / ``inter_node_fit``. Both
    add ``topology``: {ranks_per_node (as given), world_size, sweeps, measured (one sentence)}.
    ``ValueError`` when the sweeps are not the ones W and R call for."""
    names, what = link_sweeps(world_size, ranks_per_node)
    if tuple(sweeps) != names:
        raise ValueError(
            f"sweeps {list(sweeps)} do not match world_size {world_size}, ranks_per_node "
            f"{ranks_per_node} (expected {list(names)})"
        )
    topology = {
        "ranks_per_node": ranks_per_node,
        "world_size": world_size,
        "sweeps": list(names),
        "measured": what,
    }
    if names == ("all",):
        latency, bandwidth, fit = fit_link(sweeps["all"])
        profile = HardwareProfile(name, gemm_flops, bandwidth, latency)
        return profile, {"all_to_all": sweeps["all"], "a2a_fit": fit, "topology": topology}
    lat_in, bw_in, fit_in = fit_link(sweeps["intra"])
    lat_out, bw_out, fit_out = fit_link(sweeps["inter"])
    profile = HardwareProfile(
        name,
        gemm_flops,
        bw_in,  # link_*: the intra-node link (HardwareProfile's topology convention)
        lat_in,
        ranks_per_node=ranks_per_node,
        inter_node_bandwidth=bw_out,
        inter_node_latency=lat_out,
    )
    entries = {
        "intra_node": sweeps["intra"],
        "intra_node_fit": fit_in,
        "inter_node": sweeps["inter"],
        "inter_node_fit": fit_out,
        "topology": topology,
    }
    return profile, entries
