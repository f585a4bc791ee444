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
