"""``--world-size N`` for the layer benchmark: torchrun's group when launched by torchrun,
otherwise N gloo processes spawned here (CPU)."""

from __future__ import annotations

import os

from mixmoe.bench.layer import LayerBenchConfig, StrategyResult, run_rank


def _rank_main(comm, cfg: LayerBenchConfig) -> list[StrategyResult]:
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    return run_rank(cfg, comm)


def run_distributed(cfg: LayerBenchConfig) -> list[StrategyResult] | None:
    """The synchronised results on the rank that reports (rank 0, or this process when it
    spawned the ranks); None on the other torchrun ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        from mixmoe.comm import init_distributed

        comm = init_distributed("auto")
        if comm.world_size != cfg.world_size:
            raise ValueError(
                f"--world-size {cfg.world_size} but torchrun launched {comm.world_size} ranks"
            )
        results = run_rank(cfg, comm)
        return results if comm.rank == 0 else None
    if cfg.device != "cpu":
        raise ValueError("spawning ranks is for --device cpu; launch GPU runs with torchrun")
    from mixmoe.bench.spawn import spawn_gloo

    return spawn_gloo(_rank_main, cfg.world_size, cfg, threads=cfg.threads or 1, timeout_s=3600)[0]
