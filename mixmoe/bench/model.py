"""The model benchmark engine (``mixmoe bench model``, CLI in ``mixmoe.commands.bench_model``):
time whole training steps of GPT-2 / BERT / Transformer-XL per variant.

Variants: ``naive`` (the dense FFN model of the same dims, data-parallel) and one per MoE
strategy (``local`` on one rank; ``a2a``, ``shadow``, ``mix`` on several). Every step is THE
training step of ``mixmoe.train.loop.Trainer`` (forward, backward, gradient reduction, global
clipping, AdamW), on the same data, from the same seed. With several ranks a step's times are
the slowest rank's (synchronised).

Averages follow the legacy tool: the first steps are warm-up and are not averaged; the summary
is the mean of the last ``average_last`` steps (default: the last 60%, i.e. 60 of 100), which
is also what ``mixmoe report`` assumes for model logs. The log is docs/formats.md section 2
(``mixmoe.formats.model_log``); ``jsonl_records`` gives one record per (model, variant).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from mixmoe.bench.timing import median
from mixmoe.comm import Communicator
from mixmoe.config import STRATEGIES
from mixmoe.formats import model_log
from mixmoe.validation import check_int, check_str

BENCH_MODELS = ("gpt2", "bert", "transformer-xl")
NAIVE = "naive"


@dataclass(frozen=True)
class ModelBenchConfig:
    models: tuple[str, ...] = ("gpt2",)
    variants: tuple[str, ...] = (NAIVE, "local")
    preset: str = "tiny"
    num_local_experts: int = 2
    top_k: int = 2
    batch_size: int = 8
    seq_len: int | None = None
    steps: int = 100
    average_last: int | None = None
    world_size: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    lr: float = 1e-3
    threads: int = 0
    jsonl: str | None = None

    def __post_init__(self) -> None:
        check_str("jsonl", self.jsonl, none=True)
        if not self.models:
            raise ValueError(f"no model given; use one or more of {', '.join(BENCH_MODELS)}")
        for m in self.models:
            if m not in BENCH_MODELS:
                raise ValueError(
                    f"model {m!r} is not benchmarked; use one or more of {', '.join(BENCH_MODELS)}"
                )
        if not self.variants:
            raise ValueError("no variant given; use naive and/or a strategy")
        for v in self.variants:
            if v != NAIVE and v not in STRATEGIES:
                raise ValueError(
                    f"variant {v!r} is unknown; use naive or one of {', '.join(STRATEGIES)}"
                )
        if self.world_size > 1 and "local" in self.variants:
            raise ValueError("variant 'local' runs on one rank; use a2a, shadow or mix with >1")
        if self.world_size == 1 and set(self.variants) - {NAIVE, "local"}:
            raise ValueError(
                f"variants {list(self.variants)} need --world-size > 1; use naive and local "
                "on one rank"
            )
        for name, lo in (("steps", 1), ("world_size", 1), ("threads", 0)):
            check_int(name, getattr(self, name), lo)
        if self.average_last is not None:
            check_int("average_last", self.average_last, 1)
            if self.average_last > self.steps:
                raise ValueError(
                    f"average_last={self.average_last} exceeds steps={self.steps}; average at "
                    "most every step"
                )
        for model in self.models:  # the training configs' own checks, before any rank starts
            for variant in self.variants:
                from mixmoe.train.loop import check_world

                check_world(self.train_config(model, variant), self.world_size)

    @property
    def averaged(self) -> int:
        """Steps averaged: ``average_last``, or the last 60% (the legacy 60 of 100)."""
        return self.average_last or max(1, round(0.6 * self.steps))

    def train_config(self, model: str, variant: str):
        from mixmoe.train.loop import TrainConfig

        naive = variant == NAIVE
        return TrainConfig(
            model=model,
            preset=self.preset,
            num_local_experts=self.num_local_experts,
            top_k=self.top_k,
            seq_len=self.seq_len,
            strategy="local" if naive else variant,
            ep_size=1 if naive else None,
            batch_size=self.batch_size,
            max_steps=self.steps,
            lr=self.lr,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            progress=False,
            dense=naive,
        )


@dataclass
class VariantResult:
    model: str
    variant: str
    step_ms: list[float] = field(default_factory=list)
    fwd_ms: list[float] = field(default_factory=list)
    bwd_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens_per_step: int = 0


def run_rank(cfg: ModelBenchConfig, comm: Communicator | None = None) -> list[VariantResult]:
    """Every (model, variant) on this rank, one after the other; all ranks return the same
    synchronised results."""
    from mixmoe.train.loop import Trainer

    rank = 0 if comm is None else comm.rank
    results = []
    total = len(cfg.models) * len(cfg.variants) * cfg.steps
    done = 0
    for model in cfg.models:
        for variant in cfg.variants:
            trainer = Trainer(cfg.train_config(model, variant), comm)
            r = VariantResult(model, variant)
            r.tokens_per_step = cfg.batch_size * trainer.spec.seq_len
            for i in range(cfg.steps):
                rec = trainer.step(i)
                r.step_ms.append(rec.step_ms)
                r.fwd_ms.append(rec.fwd_ms)
                r.bwd_ms.append(rec.bwd_ms)
                r.losses.append(rec.loss)
                done += 1
                if rank == 0:
                    sys.stderr.write(f"\rbench model {model} {variant} [{done}/{total}]   ")
                    sys.stderr.flush()
            results.append(r)
            del trainer
    if rank == 0:
        sys.stderr.write("\n")
    return results


def _mean_last(values: list[float], n: int) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail)


def write_log(
    cfg: ModelBenchConfig, results: list[VariantResult], out: TextIO | None = None
) -> None:
    """The docs/formats.md section 2 log: per run its STEP lines and the summary line
    ``<variant> <model> <num_local_experts> [Summary] ...`` (mean of the averaged steps)."""
    out = out or sys.stdout
    for r in results:
        for i, (st, fw, bw) in enumerate(zip(r.step_ms, r.fwd_ms, r.bwd_ms, strict=True)):
            print(model_log.step_line(i, st, fw, bw), file=out)
        mean = round(_mean_last(r.step_ms, cfg.averaged), 3)
        print(model_log.summary_line(r.variant, r.model, cfg.num_local_experts, mean), file=out)
        print(file=out)


def summary_rows(cfg: ModelBenchConfig, results: list[VariantResult]) -> list[dict[str, Any]]:
    """Per (model, variant): mean and median of the averaged steps, tokens/s, and the ratio of
    the mean step time to ``naive``'s and to ``a2a``'s of the same model (None if absent)."""
    n = cfg.averaged
    means = {(r.model, r.variant): _mean_last(r.step_ms, n) for r in results}
    rows = []
    for r in results:
        mean = means[r.model, r.variant]
        naive, a2a = means.get((r.model, NAIVE)), means.get((r.model, "a2a"))
        rows.append(
            {
                "model": r.model,
                "variant": r.variant,
                "step_ms": mean,
                "median_ms": median(r.step_ms[-n:]),
                "fwd_ms": _mean_last(r.fwd_ms, n),
                "bwd_ms": _mean_last(r.bwd_ms, n),
                "tokens/s": r.tokens_per_step / (mean / 1e3),
                "vs_naive": None if naive is None else mean / naive,
                "vs_a2a": None if a2a is None else mean / a2a,
                "last_loss": r.losses[-1],
            }
        )
    return rows


def jsonl_records(cfg: ModelBenchConfig, results: list[VariantResult]) -> list[dict[str, Any]]:
    """One record per (model, variant): per-step times and losses (``averaged``: how many of
    the last steps the summary averages)."""
    return [
        {
            "model": r.model,
            "variant": r.variant,
            "averaged": cfg.averaged,
            "step_ms": r.step_ms,
            "fwd_ms": r.fwd_ms,
            "bwd_ms": r.bwd_ms,
            "loss": r.losses,
        }
        for r in results
    ]


def _rank_main(comm: Communicator, cfg: ModelBenchConfig) -> list[VariantResult]:
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    return run_rank(cfg, comm)


def run_distributed(cfg: ModelBenchConfig) -> list[VariantResult] | None:
    """``world_size`` ranks: torchrun's group when launched by torchrun (results on rank 0,
    None elsewhere), otherwise gloo processes spawned here (CPU)."""
    from mixmoe.comm.launch import run_on_ranks

    return run_on_ranks(
        _rank_main,
        cfg.world_size,
        cfg,
        device=cfg.device,
        threads=cfg.threads or 1,
        timeout_s=24 * 3600,
        command="mixmoe bench model",
    )
