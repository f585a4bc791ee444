"""Where ``mixmoe train`` runs: one process, the ``torchrun`` group (detected from its
environment), or ``world_size`` gloo CPU processes spawned here (``spawn_gloo``)."""

from __future__ import annotations

import os

from mixmoe.train.loop import TrainConfig, TrainResult, train


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _rank_main(comm, config: TrainConfig) -> TrainResult:
    return train(config, comm)


def run_training(
    config: TrainConfig, world_size: int | None = None, threads: int = 1
) -> TrainResult | None:
    """The result on the reporting process (this one, or torchrun's rank 0); None on the other
    torchrun ranks."""
    if under_torchrun():
        from mixmoe.comm import init_distributed

        comm = init_distributed("auto")
        if world_size not in (None, comm.world_size):
            raise ValueError(
                f"--world-size {world_size} but torchrun launched {comm.world_size} ranks; "
                "leave --world-size out under torchrun"
            )
        result = train(config, comm)
        return result if comm.rank == 0 else None
    if world_size is None or world_size == 1:
        return train(config)
    if not config.device.startswith("cpu"):
        raise ValueError(
            "--world-size spawns gloo CPU processes; launch GPU runs with torchrun "
            "(torchrun --nproc-per-node N -m mixmoe train ...)"
        )
    from mixmoe.bench.spawn import spawn_gloo

    return spawn_gloo(_rank_main, world_size, config, threads=threads, timeout_s=24 * 3600)[0]
