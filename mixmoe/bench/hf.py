"""Engine of ``mixmoe bench hf`` (CLI: ``mixmoe.commands.bench_hf``): a transformers MoE model's
training step under transformers' own expert parallelism, with transformers' ``all_to_all`` and
each mixmoe EP implementation (``mixmoe_a2a``, ``mixmoe_shadow``, ``mixmoe_mix``), uniform and
skewed routing.

Legend: W ranks, N experts, K top-k, B sequences per rank, S sequence length.

One random-init model (built from its config class, nothing downloaded) is saved to a temporary
directory; every rank loads it once per implementation with
``from_pretrained(path, distributed_config=DistributedConfig(ep_size=W, fsdp_size=W,
ep_implementation=NAME))`` (FSDP x EP, tp_size=1). The implementations' models are stepped in
turn (forward, backward, AdamW) on the same batches, so every ratio comes from one interleaved
run; a step's time is the slowest rank's. Before timing, the first step's losses of every
implementation must equal ``all_to_all``'s (a check, not a measurement).

Skewed routing adds a constant to the router's input (``skew_router``) that raises expert
``hot_expert``'s logit by ``hot_bias`` for every token and no other: with top-2 it takes about
half of all routed slots. The same hook serves the equivalence tests. With both routings, the
skewed records carry ``balance_bound`` = uniform ``all_to_all`` step / skewed ``all_to_all`` step:
the ratio that perfect balancing at zero cost would reach, and every record ``pct_balanced`` =
uniform ``all_to_all`` step / its step.

Launch: W gloo CPU processes are spawned here; under ``torchrun`` the launched group is used
(NCCL on GPU, by the same code).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from mixmoe.bench.timing import StageTimer, median
from mixmoe.comm import Communicator
from mixmoe.comm.launch import spawn_gloo, under_torchrun
from mixmoe.placement.profile_io import load_profile
from mixmoe.validation import (
    check_choice,
    check_device,
    check_float,
    check_int,
    check_str,
    torch_dtype,
)

FAMILIES = ("mixtral", "qwen2_moe")
IMPLEMENTATIONS = ("all_to_all", "mixmoe_a2a", "mixmoe_shadow", "mixmoe_mix")
# one device (``world_size=1``): transformers' experts implementations and mixmoe's
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", "mixmoe")
# batched_mm gathers a weight copy per routed slot: ~50x eager on CPU, so only when asked for
EXPERTS_DEFAULT = ("eager", "grouped_mm", "mixmoe")
ROUTINGS = ("uniform", "skewed")
BASELINE = "all_to_all"
EXPERTS_BASELINE = "eager"
# float32: implementations sum the same products in different orders; bf16 rounds every
# intermediate, and the implementations round in different places
CHECK_RTOL = {"float32": 1e-4, "bf16": 2e-2}


@dataclass(frozen=True)
class HFModelShape:
    """A small MoE model of one family (``qwen2_moe`` adds a shared expert of the same width)."""

    family: str = "mixtral"
    hidden_size: int = 256
    intermediate_size: int = 512
    num_experts: int = 8
    top_k: int = 2
    layers: int = 2
    vocab_size: int = 1024
    heads: int = 4

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not supported; use one of {FAMILIES}")
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_experts",
            "top_k",
            "layers",
            "vocab_size",
            "heads",
        ):
            check_int(name, getattr(self, name), 1)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; use top_k <= "
                "num_experts"
            )
        if self.hidden_size % self.heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by heads={self.heads}"
            )


@dataclass(frozen=True)
class HFBenchConfig:
    shape: HFModelShape = HFModelShape()
    world_size: int = 2
    batch: int = 4
    seq_len: int = 128
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    routings: tuple[str, ...] = ROUTINGS
    hot_expert: int = 0
    hot_bias: float = 10.0
    steps: int = 10
    warmup: int = 3
    lr: float = 1e-4
    threads: int = 1
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    profile: str = ""  # preset name or calibrate JSON for the mixmoe planners ('' = the default)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, HFModelShape):
            raise TypeError(f"shape must be an HFModelShape, got {self.shape!r}")
        check_device(self.device)
        check_choice("dtype", self.dtype, tuple(CHECK_RTOL))
        if self.world_size > 1 and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(
                f"device={self.device!r} dtype={self.dtype!r} are for the one-device run "
                "(world_size=1); on ranks the model is float32 and its device follows the process "
                "group (gloo: CPU; NCCL under torchrun: each rank's GPU)"
            )
        for name, lo in (
            ("world_size", 1),
            ("batch", 1),
            ("seq_len", 1),
            ("steps", 1),
            ("warmup", 0),
            ("threads", 0),
            ("seed", 0),
            ("hot_expert", 0),
        ):
            check_int(name, getattr(self, name), lo)
        check_float("lr", self.lr)
        if isinstance(self.hot_bias, bool) or not isinstance(self.hot_bias, (int, float)):
            raise TypeError(f"hot_bias must be a float, got {self.hot_bias!r}")
        if not math.isfinite(self.hot_bias):  # a NaN router bias routes nothing sensibly
            raise ValueError(f"hot_bias must be a finite number, got {self.hot_bias}")
        check_str("profile", self.profile)
        allowed = EXPERTS_IMPLEMENTATIONS if self.world_size == 1 else IMPLEMENTATIONS
        unknown = set(self.implementations) - set(allowed)
        if unknown or not self.implementations:
            where = "one device" if self.world_size == 1 else f"{self.world_size} ranks"
            raise ValueError(
                f"implementations {sorted(unknown) or '(none)'} on {where}: use some of {allowed}"
            )
        if self.baseline not in self.implementations:
            raise ValueError(f"implementations must include the baseline {self.baseline!r}")
        if not self.routings or set(self.routings) - set(ROUTINGS):
            raise ValueError(f"routings {self.routings}: use some of {ROUTINGS}")
        if self.shape.num_experts % self.world_size:
            raise ValueError(
                f"num_experts={self.shape.num_experts} is not divisible by world_size="
                f"{self.world_size}; use a multiple of {self.world_size}"
            )
        if self.profile:
            if self.world_size == 1:
                raise ValueError(
                    f"profile={self.profile!r} is for the planners of the EP implementations "
                    "(world_size >= 2); one device has no planner"
                )
            load_profile(self.profile)  # fails early: unknown preset, missing file
        if not 0 <= self.hot_expert < self.shape.num_experts:
            raise ValueError(
                f"hot_expert={self.hot_expert} is not an expert id; use 0..{self.shape.num_experts - 1}"
            )

    @property
    def baseline(self) -> str:
        """What the ratios are relative to: ``all_to_all`` on ranks, ``eager`` on one device."""
        return EXPERTS_BASELINE if self.world_size == 1 else BASELINE


def _transformers():
    try:
        import transformers
        import transformers.distributed  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "mixmoe bench hf needs transformers>=5.23 and accelerate: pip install 'mixmoe[models]'"
        ) from e
    return transformers


def model_config(shape: HFModelShape):
    """The transformers config of ``shape`` (dropout and jitter off)."""
    tf = _transformers()
    common = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "num_experts_per_tok": shape.top_k,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    if shape.family == "mixtral":
        return tf.MixtralConfig(
            **common,
            intermediate_size=shape.intermediate_size,
            num_local_experts=shape.num_experts,
            router_jitter_noise=0.0,
        )
    return tf.Qwen2MoeConfig(
        **common,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.intermediate_size,
        shared_expert_intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


def save_random_model(shape: HFModelShape, path: str, seed: int) -> None:
    """Build ``shape`` from its config class with random init (seeded) and save it to ``path``."""
    tf = _transformers()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(model_config(shape))
    model.save_pretrained(path)


def load_model(
    path: str,
    implementation: str | None,
    ep_size: int,
    fsdp_size: int,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The saved model in ``dtype``: one process (``implementation`` None) or under
    transformers' FSDP x EP with that EP implementation (every rank of the world calls it)."""
    tf = _transformers()
    if implementation is None:
        return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    import mixmoe.hf  # noqa: F401  registers the mixmoe EP implementations

    dc = tf.DistributedConfig(
        ep_size=ep_size, fsdp_size=fsdp_size, ep_implementation=implementation
    )
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=dc)


def _sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks: modules with a router ``gate`` and an ``experts`` module."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "gate", None), nn.Module)
        and isinstance(getattr(m, "experts", None), nn.Module)
    ]


def skew_router(model: nn.Module, expert: int, bias: float) -> list:
    """Raise expert ``expert``'s router logit by ``bias`` for every token and leave the others
    as they are: a forward pre-hook on each router adds ``c_D = bias * pinv(W_ND)[:, expert]``
    to its input (``W_ND``: the router's current weight, detached; N <= D, so ``W c = bias *
    e_expert``). Returns the hook handles."""

    def hook(gate: nn.Module, args):
        w_ND = gate.weight.detach()
        c_D = bias * torch.linalg.pinv(w_ND.double())[:, expert].to(w_ND.dtype)
        return (args[0] + c_D,) + tuple(args[1:])

    blocks = _sparse_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no sparse MoE block (gate + experts)")
    return [b.gate.register_forward_pre_hook(hook) for b in blocks]


class RoutingCounter:
    """Counts the routed slots per expert (the routers' top-k indices) while installed."""

    def __init__(self, model: nn.Module, num_experts: int) -> None:
        self.counts_N = torch.zeros(num_experts, dtype=torch.int64)
        self.handles = [b.gate.register_forward_hook(self._hook) for b in _sparse_blocks(model)]

    def _hook(self, gate, args, out) -> None:
        ids = out[-1].detach().reshape(-1).cpu()
        self.counts_N += torch.bincount(ids, minlength=self.counts_N.numel())

    def hot_share(self) -> float:
        total = int(self.counts_N.sum())
        return float(self.counts_N.max()) / total if total else 0.0


def batches(cfg: HFBenchConfig, rank: int, count: int) -> list[torch.Tensor]:
    """``count`` batches of token ids [B, S] for ``rank`` (seeded by seed and rank)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + rank)
    return [
        torch.randint(0, cfg.shape.vocab_size, (cfg.batch, cfg.seq_len), generator=gen)
        for _ in range(count)
    ]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One causal-LM step (forward, backward, optimizer step); the loss."""
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(out.loss.detach())


def interleaved_steps(
    models: dict[str, nn.Module],
    opts: dict[str, torch.optim.Optimizer],
    data: list[torch.Tensor],
    warmup: int,
    device: torch.device,
    check_first: Callable[[dict[str, float]], None],
    after_measured: Callable[[str, nn.Module], None] | None = None,
) -> dict[str, list[float]]:
    """Every model steps on every batch in turn (so each ratio comes from one interleaved run);
    the step ms of each model after ``warmup``. ``check_first(losses)`` sees the first step's
    losses; ``after_measured(name, model)`` runs after each measured step."""
    times: dict[str, list[float]] = {impl: [] for impl in models}
    for step, ids in enumerate(data):
        first = {}
        for impl, model in models.items():
            timer = StageTimer(device)
            timer.mark()
            loss = train_step(model, opts[impl], ids)
            timer.mark()
            if step >= warmup:
                times[impl].append(timer.elapsed_ms()[0])
                if after_measured is not None:
                    after_measured(impl, model)
            if step == 0:
                first[impl] = loss
        if step == 0:
            check_first(first)
    return times


def _count_replicas(
    replicas: dict[str, list[int]], ep_implementations, impl: str, model: nn.Module
) -> None:
    """Record the replicas the model's mixmoe EP layers used in their last forward."""
    replicas[impl].append(sum(ep.last_stats.get("replicas", 0) for ep in ep_implementations(model)))


def run_rank(cfg: HFBenchConfig, comm: Communicator, path: str) -> list[dict]:
    """This rank's part of the benchmark; every rank returns the same records (times are the
    slowest rank's)."""
    from mixmoe.hf.ep import ep_implementations

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.profile:  # the mixmoe implementations plan with this profile, under their own names
        import mixmoe.hf  # noqa: F401  first: its import registers the defaults
        from mixmoe.hf.ep import EP_CLASSES, register_ep_implementation

        profile = load_profile(cfg.profile)
        for name, cls in EP_CLASSES.items():
            register_ep_implementation(name, cls.strategy, profile=profile)
    W = comm.world_size
    records = []
    for routing in cfg.routings:
        models, opts, counters = {}, {}, {}
        for impl in cfg.implementations:
            model = load_model(path, impl, ep_size=W, fsdp_size=W)
            model.train()
            if routing == "skewed":
                skew_router(model, cfg.hot_expert, cfg.hot_bias)
            counters[impl] = RoutingCounter(model, cfg.shape.num_experts)
            models[impl] = model
            opts[impl] = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        device = next(iter(models.values())).device
        data = [b.to(device) for b in batches(cfg, comm.rank, cfg.warmup + cfg.steps)]
        replicas = {impl: [] for impl in cfg.implementations}
        times = interleaved_steps(
            models,
            opts,
            data,
            cfg.warmup,
            device,
            partial(_check_first_losses, routing=routing, rank=comm.rank),
            partial(_count_replicas, replicas, ep_implementations),
        )
        every = (
            comm.all_gather_rows(
                torch.tensor([times[i] for i in cfg.implementations], dtype=torch.float64)
                .reshape(-1)
                .to(device)
            )
            .reshape(W, len(cfg.implementations), cfg.steps)
            .cpu()
        )
        slowest = every.max(dim=0).values  # [impls, steps]
        shares = (
            comm.all_gather_rows(
                torch.stack([counters[i].counts_N for i in cfg.implementations])
                .reshape(-1)
                .to(device)
            )
            .reshape(W, len(cfg.implementations), -1)
            .sum(0)
            .cpu()
        )
        base = median(slowest[cfg.implementations.index(BASELINE)].tolist())
        for i, impl in enumerate(cfg.implementations):
            step_ms = slowest[i].tolist()
            counts_N = shares[i]
            records.append(
                {
                    "routing": routing,
                    "implementation": impl,
                    "device": str(device),
                    "median_ms": median(step_ms),
                    "min_ms": min(step_ms),
                    "ratio": median(step_ms) / base,
                    "hot_share": float(counts_N.max()) / max(int(counts_N.sum()), 1),
                    "replicas_per_step": sum(replicas[impl]) / len(replicas[impl]),
                    "step_ms": step_ms,
                }
            )
        del models, opts
    add_balance_bound(records)
    return records


def add_balance_bound(records: list[dict]) -> None:
    """Add ``balance_bound`` to every skewed record when the run also timed uniform routing:
    ``all_to_all``'s uniform median over its skewed median, the ratio a skewed step would reach
    if balancing the hot expert cost nothing and made the step as fast as a uniform one (the
    same tokens, the same model; only the router differs). None when either is missing.

    With the uniform ``all_to_all`` step, every record also gets ``pct_balanced`` = that step
    over its own median (issue 26's "% of force-balanced": 1.0 for uniform ``all_to_all``; a
    skewed record's distance to balance)."""
    base = {r["routing"]: r["median_ms"] for r in records if r["implementation"] == BASELINE}
    bound = base["uniform"] / base["skewed"] if {"uniform", "skewed"} <= base.keys() else None
    for r in records:
        if r["routing"] == "skewed":
            r["balance_bound"] = bound
        if "uniform" in base:
            r["pct_balanced"] = base["uniform"] / r["median_ms"]


def _check_first_losses(
    first: dict[str, float], routing: str, rank: int, baseline: str = BASELINE, rtol: float = 1e-4
) -> None:
    base = first[baseline]
    for impl, loss in first.items():
        if abs(loss - base) > rtol * abs(base):
            raise RuntimeError(
                f"{impl} disagrees with {baseline} before timing ({routing} routing, rank {rank}):"
                f" first-step loss {loss!r} vs {base!r}"
            )


def run_single_device(cfg: HFBenchConfig) -> list[dict]:
    """One device (``cfg.device``, the model in ``cfg.dtype``): the same random-init model under
    each experts implementation (``model.set_experts_implementation(name)``; ``mixmoe``
    registered by ``import mixmoe.hf``), stepped in turn on the same batches (CUDA events on a
    GPU); ratios to ``eager``, and ``vs_fastest_hf``: the step over the fastest of transformers'
    implementations in the run."""
    import copy

    import mixmoe.hf  # noqa: F401  registers the "mixmoe" experts implementation

    tf = _transformers()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = cfg.device
    base_model = tf.AutoModelForCausalLM.from_config(model_config(cfg.shape))
    base_model = base_model.to(device, torch_dtype(cfg.dtype))
    records = []
    for routing in cfg.routings:
        models, opts, counters = {}, {}, {}
        for impl in cfg.implementations:
            model = copy.deepcopy(base_model)
            model.set_experts_implementation(impl)
            model.train()
            if routing == "skewed":
                skew_router(model, cfg.hot_expert, cfg.hot_bias)
            counters[impl] = RoutingCounter(model, cfg.shape.num_experts)
            models[impl] = model
            opts[impl] = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        data = [b.to(device) for b in batches(cfg, 0, cfg.warmup + cfg.steps)]
        times = interleaved_steps(
            models,
            opts,
            data,
            cfg.warmup,
            torch.device(device),
            partial(
                _check_first_losses,
                routing=routing,
                rank=0,
                baseline=cfg.baseline,
                rtol=CHECK_RTOL[cfg.dtype],
            ),
        )
        base = median(times[cfg.baseline])
        hf = [median(times[i]) for i in cfg.implementations if i != "mixmoe"]
        for impl in cfg.implementations:
            counts_N = counters[impl].counts_N
            records.append(
                {
                    "routing": routing,
                    "implementation": impl,
                    "device": device,
                    "dtype": cfg.dtype,
                    "median_ms": median(times[impl]),
                    "min_ms": min(times[impl]),
                    "ratio": median(times[impl]) / base,
                    "vs_fastest_hf": median(times[impl]) / min(hf),
                    "hot_share": float(counts_N.max()) / max(int(counts_N.sum()), 1),
                    "replicas_per_step": 0.0,
                    "step_ms": times[impl],
                }
            )
        del models, opts
    return records


def _rank_main(comm: Communicator, cfg: HFBenchConfig, path: str) -> list[dict]:
    return run_rank(cfg, comm, path)


def run_hf_bench(cfg: HFBenchConfig) -> list[dict] | None:
    """The records on the reporting process (this one when it spawned the ranks, rank 0 under
    torchrun); None on the other torchrun ranks."""
    _transformers()
    if cfg.world_size == 1:
        return run_single_device(cfg)
    if under_torchrun():
        from mixmoe.comm import init_distributed

        # every rank writes its own copy (seeded: the same model) BEFORE it joins the group:
        # once torch.distributed is up, transformers writes a checkpoint on global rank 0 only,
        # and the ranks of other hosts could not read that one
        prefix = f"mixmoe-bench-hf-rank{os.environ['RANK']}-"
        with tempfile.TemporaryDirectory(prefix=prefix) as path:
            save_random_model(cfg.shape, path, cfg.seed)
            comm = init_distributed("auto")
            if comm.world_size != cfg.world_size:
                raise ValueError(
                    f"--world-size {cfg.world_size} but torchrun launched {comm.world_size} ranks"
                )
            records = run_rank(cfg, comm, path)
        return records if comm.rank == 0 else None
    with tempfile.TemporaryDirectory(prefix="mixmoe-bench-hf-") as path:
        save_random_model(cfg.shape, path, cfg.seed)
        return spawn_gloo(
            _rank_main, cfg.world_size, cfg, path, threads=cfg.threads or 1, timeout_s=3600
        )[0]
