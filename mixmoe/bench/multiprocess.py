"""``--world-size N`` for the layer benchmark: torchrun's group when launched by torchrun,
otherwise N gloo processes spawned here (CPU)."""

from __future__ import annotations

from mixmoe.bench.layer import LayerBenchConfig, StrategyResult, run_rank
from mixmoe.comm import Communicator
from mixmoe.comm.launch import run_on_ranks


def _rank_main(comm: Communicator, cfg: LayerBenchConfig) -> list[StrategyResult]:
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    return run_rank(cfg, comm)


def run_distributed(cfg: LayerBenchConfig) -> list[StrategyResult] | None:
    """The synchronised results on the rank that reports (rank 0, or this process when it
    spawned the ranks); None on the other torchrun ranks."""
    return run_on_ranks(
        _rank_main,
        cfg.world_size,
        cfg,
        device=cfg.device,
        threads=cfg.threads or 1,
        command="mixmoe bench layer",
    )
