"""``mixmoe calibrate``: measure this machine's hardware profile and write it as JSON.

The JSON (``mixmoe.placement.profile_io``) is what every ``--profile`` flag and
``parallelize_moe(profile=load_profile(path))`` accept. Prints the sweeps and the fitted profile;
the engine is ``mixmoe.bench.calibrate``. Under torchrun (NCCL on GPUs) the all_to_all sweep runs
on the launched group, otherwise on ``--world-size`` spawned gloo CPU ranks. ``--world-size 1``
(or torchrun with one process) calibrates one device in this process, without a process group:
the link figures come from the ``--links`` preset and are printed and stored as NOT measured.
``--ranks-per-node R`` (under torchrun: its ``LOCAL_WORLD_SIZE`` when not given) measures the
intra-node and the inter-node link apart when the ranks span several nodes of several ranks.
"""

from __future__ import annotations

import argparse
import os
import platform

from mixmoe.bench.calibrate import CalibrateConfig, calibrate
from mixmoe.placement.profile_io import profile_record, save_profile
from mixmoe.report.text_table import render_table

__all__ = ["add_arguments", "config_from_args", "run"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of integers, e.g. 64,256,1024"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = CalibrateConfig()
    p.add_argument("--model-dim", type=int, default=d.model_dim, help="D of the GEMM sweep")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size, help="F of the GEMM sweep")
    p.add_argument("--experts", type=int, default=d.experts, help="experts in the GEMM sweep")
    p.add_argument(
        "--rows", type=_ints, default=d.rows, help="rows per expert of the GEMM sweep (comma list)"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help=f"ranks of the all_to_all sweep (default: torchrun's, else {d.world_size}); 1: one "
        "device, link figures from --links (not measured)",
    )
    p.add_argument(
        "--links",
        default="",
        help="--world-size 1: the preset whose link figures (and replica_fixed_s) the profile "
        "takes, NOT measured (default: gpu on cuda, cpu on cpu)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="R ranks per node (rank r on node r // R): with 2 <= R < world size the intra-node "
        "and inter-node links are measured apart and the profile gets the topology; R >= world "
        "size (one node) or 1: one link. Default: torchrun's LOCAL_WORLD_SIZE under torchrun, "
        "else one link (spawned gloo ranks: R groups them into simulated nodes)",
    )
    p.add_argument(
        "--a2a-bytes",
        type=_ints,
        default=d.a2a_bytes,
        help="bytes each rank sends per all_to_all (comma list)",
    )
    p.add_argument(
        "--layer-tokens",
        type=_ints,
        default=d.layer_tokens,
        help="tokens per rank of the layer runs the fixed costs are fitted to (comma list; '' "
        "skips the fit: fixed costs 0.0)",
    )
    p.add_argument(
        "--processors",
        type=int,
        default=None,
        help="the ranks share this many cores (gloo ranks on a CPU host with fewer cores than "
        "ranks): fit the fixed costs under the processor sharing of simulate --processors "
        "(then predict with --processors too)",
    )
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed repeats (median)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed repeats first")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--device", default=d.device, help="cpu, or cuda under torchrun")
    p.add_argument("--name", default=d.name, help="the profile's name")
    p.add_argument("--out", default="runs/profile.json", help="write the profile JSON here")


def torchrun_ranks_per_node() -> int | None:
    """This rank's node size as torchrun launched it (``LOCAL_WORLD_SIZE``), or None outside
    torchrun. torchrun numbers ranks node by node, so rank r is on node r // R when every node
    runs R ranks (``agree_ranks_per_node`` checks that every rank read the same R)."""
    from mixmoe.comm.launch import under_torchrun

    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if under_torchrun() and local else None


def agree_ranks_per_node(comm, ranks_per_node: int, device: str) -> None:
    """Every rank of ``comm`` (a collective: all join): ``ValueError`` on every rank when the
    ranks read different node sizes (torchrun nodes of unequal ``--nproc-per-node``)."""
    import torch

    R = torch.tensor([ranks_per_node, -ranks_per_node], dtype=torch.float64, device=device)
    hi, neg_lo = comm.all_reduce_max(R).cpu().tolist()
    if hi != -neg_lo:
        raise ValueError(
            f"torchrun's nodes run different numbers of ranks ({int(-neg_lo)} to {int(hi)}); "
            "the topology needs equal nodes: give --ranks-per-node, or --ranks-per-node "
            f"{comm.world_size} for one link"
        )


def config_from_args(args: argparse.Namespace) -> CalibrateConfig:
    from mixmoe.comm.launch import under_torchrun

    world = args.world_size
    if world is None:
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else CalibrateConfig.world_size
    per_node = args.ranks_per_node
    if per_node is None and world > 1:
        per_node = torchrun_ranks_per_node()  # None outside torchrun: one link
    return CalibrateConfig(
        model_dim=args.model_dim,
        hidden_size=args.hidden_size,
        experts=args.experts,
        rows=args.rows,
        world_size=world,
        links=args.links,
        processors=args.processors,
        ranks_per_node=per_node,
        a2a_bytes=args.a2a_bytes,
        layer_tokens=args.layer_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        device=args.device,
        name=args.name,
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    import torch

    torch.set_num_threads(cfg.threads)
    comm = None
    from mixmoe.comm.launch import under_torchrun

    if under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:  # its group
        from mixmoe.comm import init_distributed

        comm = init_distributed("auto")
        if args.ranks_per_node is None and cfg.ranks_per_node is not None:  # detected per rank
            agree_ranks_per_node(comm, cfg.ranks_per_node, cfg.device)
    elif under_torchrun() and cfg.world_size != 1:
        raise ValueError(
            f"--world-size {cfg.world_size} but torchrun launched 1 rank; give --world-size 1"
        )
    # one rank (torchrun with one process included): no process group, the same code everywhere
    profile, measurements = calibrate(cfg, comm)
    if comm is not None and comm.rank != 0:
        return 0
    print(f"expert MLP (E={cfg.experts}, D={cfg.model_dim}, F={cfg.hidden_size}, {cfg.device})")
    print(
        render_table(
            ["rows/expert", "fwd ms", "bwd ms", "fwd GFLOP/s", "bwd GFLOP/s"],
            [
                [
                    p["rows_per_expert"],
                    f"{p['fwd_s'] * 1e3:.3f}",
                    f"{p['bwd_s'] * 1e3:.3f}",
                    f"{p['fwd_flops'] / 1e9:.1f}",
                    f"{p['bwd_flops'] / 1e9:.1f}",
                ]
                for p in measurements["gemm"]
            ],
        )
    )
    world = comm.world_size if comm is not None else cfg.world_size
    links = measurements.get("links")
    if links is not None:
        print(
            f"\nall_to_all: NOT MEASURED (one rank has no link); link_bandwidth, link_latency and "
            f"replica_fixed_s from preset {links['preset']!r}: {links['source']}"
        )
    else:
        _print_links(measurements, world, spawned=comm is None)
    fit = measurements["fixed_costs"]
    if "runs" in fit:
        print(f"\nlayer runs for the fixed costs ({fit['method']})")
        print(
            render_table(
                ["strategy", "routing", "tokens", "replicas", "measured ms", "base ms", "fit ms"],
                [
                    [
                        r["strategy"],
                        r["routing"],
                        r["tokens"],
                        r["replicas"],
                        f"{r['step_s'] * 1e3:.2f}",
                        f"{r['predicted_base_s'] * 1e3:.2f}",
                        f"{r['predicted_s'] * 1e3:.2f}",
                    ]
                    for r in fit["runs"]
                ],
            )
        )
    source = (
        f"measured by `mixmoe calibrate` on {platform.node() or 'this host'} ({cfg.device}, "
        f"{world} ranks, {cfg.threads} thread(s) per rank, torch {torch.__version__})"
    )
    if links is not None:
        source += (
            f"; link_bandwidth, link_latency, replica_fixed_s NOT measured: preset "
            f"{links['preset']!r}"
        )
    if profile.ranks_per_node is not None:
        source += f"; {measurements['topology']['measured']}"
    record = profile_record(profile, source=source, measured=True, measurements=measurements)
    record["config"] = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    out = save_profile(args.out, record)
    print(
        f"\nprofile {profile.name}: gemm_flops = {profile.gemm_flops / 1e9:.2f} GFLOP/s, "
        f"link_bandwidth = {profile.link_bandwidth / 1e9:.3f} GB/s, "
        f"link_latency = {profile.link_latency * 1e6:.1f} us, step_fixed = "
        f"{profile.step_fixed_s * 1e3:.3f} ms, row_overhead = {profile.row_overhead_s * 1e6:.3f} "
        f"us, replica_fixed = {profile.replica_fixed_s * 1e3:.3f} ms"
        + (
            f", ranks_per_node = {profile.ranks_per_node}, inter_node_bandwidth = "
            f"{profile.inter_node_bandwidth / 1e9:.3f} GB/s, inter_node_latency = "
            f"{profile.inter_node_latency * 1e6:.1f} us"
            if profile.ranks_per_node is not None
            else ""
        )
        + (
            f", shared_core_efficiency = {profile.shared_core_efficiency:.3f} "
            f"(predict with simulate --processors {cfg.processors})"
            if cfg.processors is not None and cfg.processors < world
            else ""
        )
        + f" -> {out}"
    )
    if links is not None:
        print(
            f"not measured (preset {links['preset']!r}): {', '.join(measurements['not_measured'])}"
        )
    return 0


def _print_links(measurements: dict, world: int, spawned: bool) -> None:
    topology = measurements["topology"]
    if "all_to_all" in measurements:
        print(f"\nall_to_all_single on {world} ranks")
        _print_sweep(measurements["all_to_all"])
        if topology["ranks_per_node"] is not None:
            print(f"(ranks per node {topology['ranks_per_node']}: {topology['measured']})")
        return
    print(f"\nlinks: {topology['measured']}")
    for key, title in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
        print(
            f"\n{title} all_to_all_single on {world} ranks ({measurements[key + '_fit']['method']})"
        )
        _print_sweep(measurements[key])
    if spawned:
        print(
            "\n(spawned gloo ranks share one host: the 'nodes' are groups of ranks and both links "
            "are loopback, so they measure about the same; on real nodes they differ)"
        )


def _print_sweep(points: list[dict]) -> None:
    print(
        render_table(
            ["bytes/rank", "to others", "ms", "GB/s"],
            [
                [
                    p["bytes_per_rank"],
                    p["bytes_to_others"],
                    f"{p['s'] * 1e3:.3f}",
                    f"{p['bytes_to_others'] / p['s'] / 1e9:.3f}",
                ]
                for p in points
            ],
        )
    )
