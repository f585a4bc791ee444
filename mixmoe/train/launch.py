"""Where ``mixmoe train`` runs: one process, the ``torchrun`` group (detected from its
environment), or ``world_size`` gloo CPU processes spawned here (``spawn_gloo``)."""

from __future__ import annotations

import os

from mixmoe.comm import Communicator
from mixmoe.comm.launch import run_on_ranks, under_torchrun
from mixmoe.train.loop import TrainConfig, TrainResult, train


def _rank_main(comm: Communicator, config: TrainConfig) -> TrainResult:
    return train(config, comm)


def run_training(
    config: TrainConfig, world_size: int | None = None, threads: int = 1
) -> TrainResult | None:
    """The result on the reporting process (this one, or torchrun's rank 0); None on the other
    torchrun ranks."""
    if world_size is None:
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
    if world_size == 1 and not under_torchrun():
        return train(config)
    return run_on_ranks(
        _rank_main,
        world_size,
        config,
        device=config.device,
        threads=threads,
        timeout_s=24 * 3600,
        command="mixmoe train",
        pg_timeout_s=config.collective_timeout_s,
    )
