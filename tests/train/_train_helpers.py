"""Workers for the training tests (module level: ``spawn_gloo`` pickles them)."""

from __future__ import annotations

from mixmoe.placement.profile import HardwareProfile
from mixmoe.train.loop import TrainConfig, train

# compute-starved profile: the cost model replicates hot experts, so mix runs its replica path
REPLICATE = HardwareProfile(
    "test-replicate", gemm_flops=1e6, link_bandwidth=1e12, link_latency=1e-9
)


def tiny(**kw) -> TrainConfig:
    """float64, a small global batch and sequence, no progress line."""
    base = {
        "preset": "tiny",
        "num_experts": 4,
        "top_k": 2,
        "batch_size": 4,
        "seq_len": 32,
        "dtype": "float64",
        "lr": 3e-3,
        "clip": 0.5,
        "progress": False,
        "router_skew": 2.0,
        "profile": REPLICATE,
    }
    return TrainConfig(**{**base, **kw})


def run_many(comm, configs: list[TrainConfig]) -> list:
    return [train(c, comm) for c in configs]


def error_of(comm, config: TrainConfig) -> str:
    try:
        train(config, comm)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def checkpoint_jobs(
    comm, configs: list[TrainConfig], failing: TrainConfig, split: tuple[str, ...]
) -> dict:
    """Train every config in turn, then the one that must fail (its ValueError text), then read
    ``split[rank]`` (a good file on one rank, a corrupt one on the other): every rank must
    raise, none may wait."""
    from mixmoe.train.checkpoint import read_checkpoint

    out = {"results": run_many(comm, configs), "error": error_of(comm, failing)}
    try:
        read_checkpoint(split[comm.rank], failing.model_spec(comm.world_size), comm)
        out["split_error"] = "no error"
    except ValueError as e:
        out["split_error"] = f"ValueError: {e}"
    return out


def train_crashing_in_save(comm, config: TrainConfig, crash_rank: int, crash_at: int) -> str:
    """Train ``config``; the ``crash_at``-th sharded save fails on ``crash_rank`` right after
    that rank wrote its shard file (the others' files and DCP's metadata may exist). Returns
    the error every rank saw."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystemWriter.write_data
    calls = [0]

    def write_data(self, plan, planner):
        calls[0] += 1
        fut = real(self, plan, planner)
        if comm.rank == crash_rank and calls[0] == crash_at:
            fut.wait()
            raise RuntimeError("simulated crash after this rank's shards were written")
        return fut

    fs.FileSystemWriter.write_data = write_data
    try:
        train(config, comm)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    finally:
        fs.FileSystemWriter.write_data = real
    return "no error"
