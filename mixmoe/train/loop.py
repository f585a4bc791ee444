"""The training loop of ``mixmoe train``: ``train(TrainConfig, comm) -> TrainResult``.

Legend: W world size, S = W * micro_batches shards of the global batch, G global batch rows,
L sequence length.

Parallelism. Every rank is in an expert-parallel (EP) group of ``ep_size`` consecutive ranks
(default: the whole world); every MoE layer is ``parallelize_moe(layer, ep, strategy)``. Dense
and gate parameters are data-parallel over the world; when ``ep_size < W`` the ranks owning the
same experts in the other EP groups form expert-data-parallel groups. ``ep_size = 1`` (strategy
``local``) is plain data parallelism with every expert on every rank.

The objective of one step is the mean loss of the GLOBAL batch, written as a sum over its S
shards (rank r processes shards ``r * micro_batches + m``):

    J = sum_s J_s,   J_s = CE_sum(shard s) / targets(global batch) + aux_s / S

so the task term is exactly the 1-rank global-batch mean (BERT's masked positions included),
and ``aux_s`` is the summed MoE aux loss of shard s's forward (each layer's balance loss of the
shard's own tokens). The 1-rank equivalent of W ranks is therefore a 1-rank run with
``micro_batches = W`` (the same shards, gradients accumulated), which is what the tests compare
against; a 1-rank run with ``micro_batches = 1`` computes the aux loss over the whole batch
instead (a different, equally valid regulariser). Gradients: see ``mixmoe.train.grads`` (dense
summed over the world, experts over the EDP group, clipping by the global norm).

Stopping: ``max_steps``, or ``time_budget_s`` checked before each step by one all_reduce(max) of
"over budget" flags, so every rank stops at the same step. Eval: every ``eval_every`` steps and
at the end, the mean loss over ``eval_batches`` held-out global batches. Mixed precision: bf16
autocast on CUDA (``dtype="bfloat16"``; parameters and optimizer stay float32).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from mixmoe.comm import Communicator
from mixmoe.config import STRATEGIES
from mixmoe.layers.balance import end_balance_step
from mixmoe.placement.profile import HardwareProfile
from mixmoe.train import checkpoint as ckpt_io
from mixmoe.train import sharded
from mixmoe.train.balance_log import BalanceLog
from mixmoe.train.data import global_batch, shard, starts_stream
from mixmoe.train.grads import clip_global_norm, split_parameters, sync_gradients
from mixmoe.train.lr_schedule import LR_SCHEDULES, lr_at
from mixmoe.train.presets import MODELS, PRESETS, ModelSpec, loss_sums, moe_auxes, preset
from mixmoe.train.sources import load_tokens
from mixmoe.validation import (
    check_bool,
    check_device,
    check_float,
    check_int,
    check_plan_ahead,
)

DTYPES = ("float32", "float64", "bfloat16")
OBJECTIVES = {
    "gpt2": "causal",
    "mixtral": "causal",
    "deepseek": "causal",
    "bert": "masked",
    "transformer-xl": "stream",
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on. ``num_experts`` is the GLOBAL expert count N;
    ``num_local_experts`` (experts per EP rank) is the alternative (N = E * ep_size); with
    neither, N = 2 * ep_size (``deepseek``: the preset's). ``batch_size`` is the GLOBAL batch
    (rows of ``seq_len`` bytes). ``top_k`` / ``aux_loss_coef`` None: the preset's (2 / 0.01;
    ``deepseek`` 4 / 1e-4). ``bias_update_rate``: aux-loss-free balancing step of ``deepseek``
    (None: the preset's 1e-3; 0: off). ``router_skew`` adds to the router bias of experts
    0 .. N/2 - 1 at the start (a skewed start, to watch balancing work)."""

    model: str = "gpt2"
    preset: str = "tiny"
    moe_layers: str = "all"
    num_experts: int | None = None
    num_local_experts: int | None = None
    top_k: int | None = None
    seq_len: int | None = None
    strategy: str = "local"
    ep_size: int | None = None
    batch_size: int = 8
    micro_batches: int = 1
    max_steps: int = 50
    time_budget_s: float | None = None
    lr: float = 1e-3
    lr_schedule: str = "constant"  # constant | cosine | linear (after the warm-up)
    warmup_steps: int = 0
    min_lr: float = 0.0  # the floor cosine and linear decay reach at max_steps
    weight_decay: float = 0.0
    clip: float = 1.0
    aux_loss_coef: float | None = None
    eval_every: int = 0
    eval_batches: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    save: str | None = None  # one consolidated file at the end (gathered on rank 0)
    resume: str | None = None  # "auto", a step-* checkpoint directory, or a --save file
    save_dir: str | None = None  # sharded checkpoints (every rank writes its own shards)
    save_every: int = 0  # steps between sharded checkpoints (0: only at the end)
    save_every_minutes: float | None = None  # minutes between sharded checkpoints
    keep: int | None = None  # keep the newest K complete checkpoints (None: all)
    out: str | None = None
    progress: bool = True
    profile: HardwareProfile | None = None
    dense: bool = False  # the dense FFN model of the same dims (no experts; strategy local)
    router_skew: float = 0.0  # added to the router bias of experts 0 .. N/2 - 1 (hot experts)
    bias_update_rate: float | None = None  # deepseek's aux-loss-free balancing (0: off)
    data: str | None = None  # text file/dir or pre-tokenized .bin (mixmoe.train.sources)
    vocab_size: int | None = None  # of a pre-tokenized --data file
    collective_timeout_s: float = 300.0  # a rank silent this long in a collective: the run fails
    tensorboard: bool = False  # TensorBoard event files in out/tensorboard (needs tensorboard)
    plan_ahead: bool = False  # mix: each step fits the plan of the step before (MoEConfig)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r} is unknown; use one of {', '.join(MODELS)}")
        if self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r} is unknown; use one of {', '.join(PRESETS)}")
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy {self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {DTYPES}")
        for name, lo in (
            ("batch_size", 1),
            ("micro_batches", 1),
            ("max_steps", 0),
            ("eval_every", 0),
            ("eval_batches", 1),
            ("seed", 0),
        ):
            check_int(name, getattr(self, name), lo)
        for name in (
            "num_experts",
            "num_local_experts",
            "seq_len",
            "ep_size",
            "top_k",
            "vocab_size",
        ):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.num_experts is not None and self.num_local_experts is not None:
            raise ValueError("give num_experts (global) or num_local_experts (per rank), not both")
        for name in ("lr", "weight_decay", "clip", "aux_loss_coef", "bias_update_rate"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name))
        if self.time_budget_s is not None:
            check_float("time_budget_s", self.time_budget_s)
        check_float("collective_timeout_s", self.collective_timeout_s)
        if self.collective_timeout_s == 0:
            raise ValueError("collective_timeout_s must be > 0 (every collective would time out)")
        if isinstance(self.router_skew, bool) or not isinstance(self.router_skew, (int, float)):
            raise TypeError(f"router_skew must be a float, got {self.router_skew!r}")
        if not math.isfinite(self.router_skew):
            raise ValueError(f"router_skew must be a finite number, got {self.router_skew}")
        for name in ("progress", "dense", "tensorboard"):
            check_bool(name, getattr(self, name))
        for name in ("save", "resume", "save_dir", "out", "data"):  # paths, or None
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path (str) or None, got {value!r}")
        if self.profile is not None and not isinstance(self.profile, HardwareProfile):
            raise TypeError(f"profile must be a HardwareProfile or None, got {self.profile!r}")
        check_int("warmup_steps", self.warmup_steps, 0)
        check_float("min_lr", self.min_lr)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule {self.lr_schedule!r} is unknown; use one of {', '.join(LR_SCHEDULES)}"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} is above lr={self.lr}; use min_lr <= lr")
        check_int("save_every", self.save_every, 0)
        if self.keep is not None:
            check_int("keep", self.keep, 1)
        if self.save_every_minutes is not None:
            check_float("save_every_minutes", self.save_every_minutes)
        if (self.save_every or self.save_every_minutes or self.keep) and not self.save_dir:
            raise ValueError("save_every / save_every_minutes / keep need --save-dir DIR")
        if self.resume == "auto" and not self.save_dir:
            raise ValueError(
                "--resume auto takes the newest checkpoint under --save-dir; give --save-dir DIR"
            )
        if self.tensorboard and not self.out:
            raise ValueError("tensorboard needs an output directory; give --out DIR")
        check_device(self.device)  # one that torch can use here: cpu, or a visible cuda:N
        if self.dtype == "bfloat16" and not self.device.startswith("cuda"):
            raise ValueError("dtype bfloat16 (autocast) is for CUDA; use float32 on the CPU")
        check_plan_ahead(self.plan_ahead, self.strategy, "drop --plan-ahead")
        self.model_spec(self.ep_size or 1)  # the model's own checks (moe_layers range, ...)

    def model_spec(self, ep_size: int) -> ModelSpec:
        """The ``ModelSpec`` for an EP group of ``ep_size`` ranks."""
        if self.num_experts is not None:
            n = self.num_experts
        elif self.num_local_experts is not None or self.model != "deepseek":
            n = (self.num_local_experts or 2) * ep_size
        else:
            n = None  # the deepseek preset's own expert count
        extra = {
            name: value
            for name, value in (
                ("seq_len", self.seq_len),
                ("num_experts", n),
                ("top_k", self.top_k),
                ("aux_loss_coef", self.aux_loss_coef),
                ("bias_update_rate", self.bias_update_rate),
                ("token_vocab", self.vocab_size),
            )
            if value is not None
        }
        return preset(
            self.model, self.preset, moe_layers=self.moe_layers, dense=self.dense, **extra
        )


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step. ``loss``: global-batch mean task loss (before the step's update);
    ``aux_loss``: mean over shards of the summed MoE aux loss; ``grad_norm``: the global norm
    before clipping; ``step_ms``: the slowest rank's step; ``replicas``: expert replicas used by
    the MoE layers of this step, summed over layers and ranks (mix / shadow); ``plans_fitted``:
    the MoE layers' forwards whose plan was the step before's, fitted (``plan_ahead``; the
    same on every rank); ``plan_wait_ms``: what the MoE layers' forwards waited for their
    planning threads (an async or ahead plan's unhidden part), summed, the slowest rank's.
    ``moe``: one dict
    per MoE layer (``mixmoe.train.balance_log``): its global load this step, busiest expert /
    mean, coefficient of variation, dead experts, replicas, selection-bias range."""

    step: int
    loss: float
    aux_loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    step_ms: float
    replicas: int
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    eval_loss: float | None = None
    moe: tuple[dict, ...] = ()
    plans_fitted: int = 0
    plan_wait_ms: float = 0.0


@dataclass(frozen=True)
class TrainResult:
    """What ``train`` returns on every rank: the records of the steps run (from ``start_step``,
    the resumed position), the final eval loss (None without eval), why it stopped, the world
    and EP sizes, the strategy, the model spec and the config as plain values."""

    steps: tuple[StepRecord, ...]
    final_eval_loss: float | None
    stopped_by: str  # "max_steps" or "time_budget"
    world_size: int
    ep_size: int
    strategy: str
    spec: ModelSpec
    start_step: int = 0
    config: dict = field(default_factory=dict)


def check_world(config: TrainConfig, world_size: int) -> tuple[ModelSpec, int]:
    """(model spec, EP size) of ``config`` on ``world_size`` ranks; ValueError naming the fix
    when they do not fit (no collective: the CLI calls it before spawning ranks)."""
    W = world_size
    ep_size = config.ep_size or (1 if config.dense else W)
    if config.dense and (config.strategy != "local" or ep_size != 1):
        raise ValueError(
            "a dense model has no experts to distribute; use strategy 'local' (ep_size 1: "
            "plain data parallelism)"
        )
    if W % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the world size {W}; use a divisor")
    if ep_size == 1 and config.strategy != "local":
        raise ValueError(
            f"strategy {config.strategy!r} needs an expert-parallel group of > 1 rank; use "
            "--strategy local on one rank (or with --ep-size 1), or run on more ranks"
        )
    if ep_size > 1 and config.strategy == "local":
        raise ValueError(
            f"strategy 'local' keeps every expert on one rank; with an EP group of {ep_size} "
            "ranks use a2a, shadow or mix (or --ep-size 1 for plain data parallelism)"
        )
    spec = config.model_spec(ep_size)
    if spec.num_experts % ep_size:
        raise ValueError(
            f"num_experts={spec.num_experts} is not divisible by the EP size {ep_size} (the "
            f"world size unless --ep-size); use a multiple of {ep_size}"
        )
    shards = W * config.micro_batches
    if config.batch_size % shards:
        raise ValueError(
            f"batch_size={config.batch_size} (global) does not split into {W} ranks x "
            f"{config.micro_batches} micro-batches; use a multiple of {shards}"
        )
    return spec, ep_size


def _resolve_groups(config: TrainConfig, world):
    W = world.world_size
    spec, ep_size = check_world(config, W)
    from mixmoe.comm import LocalCommunicator

    if W == 1:
        return spec, ep_size, world, LocalCommunicator()
    if ep_size == W:
        return spec, ep_size, world, LocalCommunicator()
    if ep_size == 1:
        return spec, ep_size, LocalCommunicator(), world
    from mixmoe.comm import new_expert_groups

    ep, edp = new_expert_groups(ep_size, config.collective_timeout_s)
    return spec, ep_size, ep, edp


def _device(config: TrainConfig) -> torch.device:
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def build_parallel_model(config: TrainConfig, spec: ModelSpec, ep, device: torch.device):
    """The model on ``device`` with every MoE layer parallelized over ``ep`` (same seed on
    every rank, so dense weights are identical; each rank builds only the experts it owns)."""
    from mixmoe.parallel import parallelize_moe
    from mixmoe.train.presets import build_model, moe_layers_of

    torch.manual_seed(config.seed)
    # each rank builds only its own experts (same weights as the full build: per-expert seeds)
    model = build_model(spec, ep_rank=ep.rank, ep_size=ep.world_size)
    param_dtype = torch.float64 if config.dtype == "float64" else torch.float32
    model = model.to(device=device, dtype=param_dtype)
    layers = moe_layers_of(model)
    if config.router_skew:
        hot = spec.num_experts // 2 or 1
        for name, moe in layers:
            bias = getattr(moe.gate.wg, "bias", None)
            if bias is None:
                raise ValueError(f"router_skew needs a router bias; {name} has none")
            with torch.no_grad():
                bias[:hot] += config.router_skew
    if ep.world_size > 1:
        for _, moe in layers:
            if config.plan_ahead:  # (a dispatcher setting: the layer's math is the same)
                moe.config = replace(moe.config, plan_ahead=True)
            parallelize_moe(moe, ep, config.strategy, profile=config.profile)
    return model


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _reduce(world, values: list[float], op: str, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if world.world_size > 1:
        if world.backend == "nccl":
            t = t.to(device)
        world.all_reduce(t, op)
    return t.cpu().tolist()


def _autocast(config: TrainConfig, device: torch.device):
    if config.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Trainer:
    """One rank's training state (model, optimizer, data position, memory) and THE training
    step: ``step(i) -> StepRecord`` (``mixmoe train`` and ``mixmoe bench model`` both run it).
    Building it is collective (expert groups, checkpoint verdict): every rank builds one."""

    def __init__(self, config: TrainConfig, comm: Communicator | None = None) -> None:
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        from mixmoe.comm import LocalCommunicator

        self.config = config
        self.world = world = comm if comm is not None else LocalCommunicator()
        self.spec, self.ep_size, self.ep, self.edp = _resolve_groups(config, world)
        self.device = device = _device(config)
        self.model = build_parallel_model(
            replace(config, ep_size=self.ep_size), self.spec, self.ep, device
        )
        self.dense, self.experts = split_parameters(self.model)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        self.objective = OBJECTIVES[self.spec.model]
        tokens = load_tokens(config.data, config.vocab_size)
        self.train_data, self.eval_data = tokens.train, tokens.eval
        M = config.micro_batches
        self.num_shards = world.world_size * M
        self.mems: list = [None] * M
        self.start_step = 0
        self.clock = _Clock(device)
        self.balance = BalanceLog()
        self.resumed_from: str | None = None
        if config.resume:
            self._resume(config.resume)

    def _resume(self, resume: str) -> None:
        """Load the checkpoint ``resume`` names: "auto" (the newest complete one under
        ``save_dir``; none: start from step 0), a sharded ``step-*`` directory, or a file of
        ``save``. Collective."""
        M, device = self.config.micro_batches, self.device
        path = self._agreed_latest() if resume == "auto" else resume
        if path is None:
            return
        dtype = next(self.model.parameters()).dtype
        if os.path.isdir(path):
            loaded = sharded.load_sharded(
                path, model=self.model, optimizer=self.opt, spec=self.spec, world=self.world
            )
            sharded.invalidate_replica_caches(self.model)
            self.start_step, mems = loaded.step, {"mems": loaded.mems}
        else:
            ckpt = ckpt_io.read_checkpoint(path, self.spec, self.world)
            ckpt_io.load_into(ckpt, self.model, self.opt)
            self.start_step, mems = int(ckpt["step"]), ckpt
        self.mems = [
            ckpt_io.mems_for_shard(mems, self._shard(m), self.num_shards, device, dtype)
            for m in range(M)
        ]
        self.resumed_from = str(path)

    def _agreed_latest(self) -> str | None:
        """The newest complete checkpoint under ``save_dir``, the same on every rank (they
        read the directory separately; a disagreement is an error, not a guess)."""
        found = sharded.latest_checkpoint(self.config.save_dir)
        step = -1 if found is None else int(found.name.split("-")[1])
        lo, hi = _reduce(self.world, [step, -step], "max", self.device)
        if lo != -hi:
            raise RuntimeError(
                f"ranks see different newest checkpoints under {self.config.save_dir} "
                f"(steps {int(-hi)}..{int(lo)}); is the directory shared by every rank?"
            )
        return None if found is None else str(found)

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (``mixmoe.train.lr_schedule``)."""
        cfg = self.config
        return lr_at(
            step,
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            warmup_steps=cfg.warmup_steps,
            total_steps=cfg.max_steps,
            schedule=cfg.lr_schedule,
        )

    def _shard(self, m: int) -> int:
        return self.world.rank * self.config.micro_batches + m

    def step(self, step: int) -> StepRecord:
        """Forward + backward of this rank's shards of global batch ``step``, gradient sums,
        global-norm clipping, one AdamW step. Collective. ``fwd_ms``: the forwards (loss
        included); ``bwd_ms``: the rest (backward, gradient reduction, clipping, optimizer);
        each the slowest rank's, as ``step_ms``."""
        cfg, spec, model, device = self.config, self.spec, self.model, self.device
        G, L, S = cfg.batch_size, spec.seq_len, self.num_shards
        t_start = self.clock.now()
        inputs, targets = global_batch(
            self.objective, self.train_data, step, G, L, cfg.seed, mask_id=spec.token_vocab
        )
        if self.objective == "stream" and starts_stream(self.train_data, step, G, L):
            self.mems = [None] * cfg.micro_batches
        ce_local, aux_local, replicas, fitted, fwd_s, wait_ms = 0.0, 0.0, 0, 0, 0.0, 0.0
        for m in range(cfg.micro_batches):
            b = shard(inputs, targets, self._shard(m), S)
            t_fwd = self.clock.now()
            with _autocast(cfg, device):
                ce, aux, self.mems[m] = loss_sums(
                    spec, model, b.inputs_BL.to(device), b.targets_BL.to(device), self.mems[m]
                )
                objective_s = ce / b.num_targets + aux / S
            fwd_s += self.clock.now() - t_fwd
            objective_s.backward()
            ce_local += float(ce.detach()) / b.num_targets
            aux_local += float(aux.detach()) / S
            auxes = moe_auxes(model)  # this forward's MoE layers
            replicas += sum(int((a.stats or {}).get("replicas", 0)) for a in auxes)
            fitted += sum(bool((a.stats or {}).get("plan_fitted")) for a in auxes)
            wait_ms += sum(a.plan_wait_ms for a in auxes)
        sync_gradients(self.dense, self.experts, self.world, self.edp)
        norm = float(clip_global_norm(self.dense, self.experts, self.ep, cfg.clip))
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        moe = self._end_balance_step()
        step_s = self.clock.now() - t_start
        loss, aux_loss, replicas_all = _reduce(
            self.world, [ce_local, aux_local, replicas], "sum", device
        )
        step_s, fwd_s, bwd_s, wait_ms = _reduce(
            self.world, [step_s, fwd_s, step_s - fwd_s, wait_ms], "max", device
        )
        return StepRecord(
            step=step,
            loss=loss,
            aux_loss=aux_loss,
            lr=self.opt.param_groups[0]["lr"],
            grad_norm=norm,
            tokens_per_s=G * L / step_s if step_s > 0 else math.inf,
            step_ms=step_s * 1e3,
            replicas=int(replicas_all),
            fwd_ms=fwd_s * 1e3,
            bwd_ms=bwd_s * 1e3,
            moe=moe,
            plans_fitted=fitted,
            plan_wait_ms=wait_ms,
        )

    def _end_balance_step(self) -> tuple[dict, ...]:
        """Once per optimizer step: every MoE layer's step load (summed over the EP group by the
        dispatcher; over the other EP groups or data-parallel ranks by one all_reduce per step)
        moves its selection bias and becomes the step's balance metrics."""
        edp = self.edp
        reduce = None if edp.world_size == 1 else (lambda t: edp.all_reduce(t))
        return self.balance.step(end_balance_step(self.model, reduce))

    def evaluate(self) -> float:
        """Mean task loss over ``eval_batches`` held-out global batches (collective)."""
        cfg, spec, model, device = self.config, self.spec, self.model, self.device
        M, G, L = cfg.micro_batches, cfg.batch_size, spec.seq_len
        was_training = model.training
        model.eval()
        ce_total, targets_total = 0.0, 0
        mems: list = [None] * M
        with torch.no_grad(), _autocast(cfg, device):
            for i in range(cfg.eval_batches):
                inputs, targets = global_batch(
                    self.objective, self.eval_data, i, G, L, cfg.seed, 1, spec.token_vocab
                )
                for m in range(M):
                    b = shard(inputs, targets, self._shard(m), self.num_shards)
                    ce, _, mems[m] = loss_sums(
                        spec, model, b.inputs_BL.to(device), b.targets_BL.to(device), mems[m]
                    )
                    ce_total += float(ce)
                targets_total += b.num_targets
        model.train(was_training)
        (ce_sum,) = _reduce(self.world, [ce_total], "sum", device)
        return ce_sum / targets_total

    def save_sharded(self, steps_done: int) -> str:
        """Sharded checkpoint after ``steps_done`` steps under ``save_dir`` (collective; every
        rank writes its own shards); returns its path."""
        mems = self.mems if self.objective == "stream" else None
        path = sharded.save_sharded(
            self.config.save_dir,
            step=steps_done,
            model=self.model,
            optimizer=self.opt,
            spec=self.spec,
            mems_global=ckpt_io.global_mems(mems, self.world),
            config=_plain(self.config),
            world=self.world,
            ep_size=self.ep_size,
            keep=self.config.keep,
        )
        return str(path)

    def save(self, path: str, steps_done: int) -> None:
        """Checkpoint after ``steps_done`` steps (collective; world rank 0 writes)."""
        ckpt_io.save_checkpoint(
            path,
            model=self.model,
            optimizer=self.opt,
            spec=self.spec,
            step=steps_done,
            mems_shards=self.mems if self.objective == "stream" else None,
            config=_plain(self.config),
            world=self.world,
            ep=self.ep,
        )


def _open_log(config: TrainConfig, trainer: Trainer):
    """Rank 0's streamed log (``mixmoe.train.outputs.RunLog``), or None."""
    if not config.out or trainer.world.rank != 0:
        return None
    from mixmoe.train.outputs import RunLog

    common = {
        "model": trainer.spec.model,
        "strategy": config.strategy,
        "world_size": trainer.world.world_size,
        "ep_size": trainer.ep_size,
    }
    return RunLog(config.out, _plain(config), trainer.device, common, config.tensorboard)


def train(config: TrainConfig, comm: Communicator | None = None) -> TrainResult:
    """Train on this rank (``comm``: the world communicator; None = one process). Every rank of
    the world calls it with the same config; all return the same ``TrainResult``. Rank 0
    writes the outputs (``out``: JSONL streamed step by step, TensorBoard, and the loss-curve
    PNG at the end; ``save``: the checkpoint)."""
    trainer = Trainer(config, comm)
    world, clock = trainer.world, trainer.clock
    log = _open_log(config, trainer)
    t0 = t_saved = clock.now()
    records: list[StepRecord] = []
    stopped_by = "max_steps"
    show = config.progress and world.rank == 0
    saved_at = trainer.start_step if trainer.resumed_from else None
    finished = False
    try:
        for step in range(trainer.start_step, config.max_steps):
            if config.time_budget_s is not None:
                over = 1.0 if clock.now() - t0 > config.time_budget_s else 0.0
                if _reduce(world, [over], "max", trainer.device)[0] > 0:
                    stopped_by = "time_budget"
                    break
            rec = trainer.step(step)
            last = step == config.max_steps - 1
            if config.eval_every and ((step + 1) % config.eval_every == 0 or last):
                rec = replace(rec, eval_loss=trainer.evaluate())
            records.append(rec)
            if log is not None:
                log.write(asdict(rec))
            if show:
                _progress(rec, config.max_steps)
            if config.save_dir and not last and _save_due(config, step + 1, t_saved, trainer):
                trainer.save_sharded(step + 1)
                saved_at, t_saved = step + 1, clock.now()
        if show and records:
            sys.stderr.write("\n")
        final_eval = (
            records[-1].eval_loss if records and records[-1].eval_loss is not None else None
        )
        if final_eval is None and config.eval_every:
            final_eval = trainer.evaluate()
        done = records[-1].step + 1 if records else trainer.start_step
        if config.save_dir and saved_at != done:
            trainer.save_sharded(done)
        if config.save:
            trainer.save(config.save, done)
        finished = True
    finally:
        if log is not None and not (finished and records):
            log.close_files()  # the lines written so far are on disk already
    if log is not None and records:
        log.close(
            f"{trainer.spec.model} {config.strategy} W={world.world_size} "
            f"N={trainer.spec.num_experts}"
        )
    return TrainResult(
        steps=tuple(records),
        final_eval_loss=final_eval,
        stopped_by=stopped_by,
        world_size=world.world_size,
        ep_size=trainer.ep_size,
        strategy=config.strategy,
        spec=trainer.spec,
        start_step=trainer.start_step,
        config=_plain(config),
    )


def _save_due(config: TrainConfig, steps_done: int, t_saved: float, trainer: Trainer) -> bool:
    """Whether to checkpoint after ``steps_done`` steps: every ``save_every`` steps, or when
    ``save_every_minutes`` passed on ANY rank since the last save (one all_reduce: every rank
    decides alike)."""
    if config.save_every and steps_done % config.save_every == 0:
        return True
    if config.save_every_minutes is None:
        return False
    late = 1.0 if trainer.clock.now() - t_saved >= 60.0 * config.save_every_minutes else 0.0
    return _reduce(trainer.world, [late], "max", trainer.device)[0] > 0


def _plain(config: TrainConfig) -> dict:
    d = asdict(config)
    d["profile"] = None if config.profile is None else asdict(config.profile)
    return d


def _progress(rec: StepRecord, total: int) -> None:
    width = 20
    filled = int(width * (rec.step + 1) / max(total, 1))
    sys.stderr.write(
        f"\rtrain [{'#' * filled}{'.' * (width - filled)}] step {rec.step + 1}/{total} "
        f"loss {rec.loss:.4f} aux {rec.aux_loss:.4f} {rec.tokens_per_s:,.0f} tok/s"
        + (f" eval {rec.eval_loss:.4f}" if rec.eval_loss is not None else "")
        + "   "
    )
    sys.stderr.flush()
