"""``MoE``: the mixture-of-experts layer.

Legend: T tokens (all leading dims flattened), D model dim, N experts, K top-k.

One token's path: gate (logits -> top-k ids and weights) -> row layout (rows sorted by expert,
cut into 64-row blocks; the layer's one host sync) -> gather into the block layout -> expert MLP
(grouped GEMM, activation, grouped GEMM) -> weighted combine of its K outputs.

The module is written for one device. Expert parallelism is applied from outside by replacing
``self.dispatcher`` (and sharding ``self.experts``), never by branching in here.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.config import MoEConfig
from mixmoe.dispatch.local import LocalDispatcher
from mixmoe.gating.bias_balance import update_expert_bias
from mixmoe.gating.losses import balance_probs, global_balance_loss
from mixmoe.layers.experts import Experts
from mixmoe.layers.gate import Gate
from mixmoe.layers.shared import SharedExperts
from mixmoe.tracing import trace_span
from mixmoe.types import LoadRecord, MoEAux


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread: a forward run then is an
    activation recomputation (torch.utils.checkpoint, reentrant or not), already counted."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """``forward(x[..., D]) -> (y[..., D], aux)``; dropless, any top-k, fp32/bf16/fp16.

    ``gate`` replaces the router module (it must return ``(Routing, balance_loss, z_loss)``);
    benchmarks use it to impose synthetic routing.

    ``ep_rank`` / ``ep_size``: build only the experts rank ``ep_rank`` of an expert-parallel group
    of ``ep_size`` ranks owns (``N / ep_size`` of them, the same weights the single-device layer
    built from the same seed holds), so no rank ever allocates all N experts. Such a layer runs
    after ``mixmoe.parallel.parallelize_moe(layer, comm)`` installed its strategy.

    Step load (balance metrics and aux-loss-free balancing): every training-mode forward that is
    not an activation recomputation adds the step's GLOBAL rows per expert (every rank of the
    expert-parallel group: the dispatcher's count matrix, no extra collective) to the buffer
    ``step_load_N`` (int64, not in the state_dict). ``end_step()`` (once per optimizer step, on
    every rank) turns it into a ``LoadRecord``, moves ``gate.expert_bias`` when enabled, and
    resets it; gradient accumulation sums its micro-batches into one step.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        gate: nn.Module | None = None,
        ep_rank: int = 0,
        ep_size: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        for name, value in (("ep_rank", ep_rank), ("ep_size", ep_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if ep_size < 1 or not 0 <= ep_rank < ep_size:
            raise ValueError(
                f"need ep_size >= 1 and 0 <= ep_rank < ep_size, got {ep_rank}, {ep_size}"
            )
        if config.num_experts % ep_size:
            raise ValueError(
                f"num_experts={config.num_experts} is not divisible by ep_size={ep_size}; use a "
                f"multiple of {ep_size}"
            )
        self.config = config
        self.gate = gate if gate is not None else Gate(config, device=device, dtype=dtype)
        E = config.num_experts // ep_size
        self.experts = Experts(
            E,
            config.model_dim,
            config.hidden_dim,
            config.activation,
            config.bias,
            first_expert=ep_rank * E,
            num_global_experts=config.num_experts,
            device=device,
            dtype=dtype,
        )
        self.shared = (
            SharedExperts(
                config.model_dim,
                config.shared_dim,
                config.activation,
                config.bias,
                config.shared_gate,
                device=device,
                dtype=dtype,
            )
            if config.shared_experts
            else None
        )
        self.dispatcher = LocalDispatcher(config)
        N = config.num_experts
        self.register_buffer(
            "step_load_N", torch.zeros(N, dtype=torch.int64, device=device), persistent=False
        )
        self._step_forwards = 0
        self._step_replicas = 0

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoE input must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(
                f"MoE input must be floating point, got {x.dtype}; convert it, e.g. x.float()"
            )
        if x.dim() < 1 or x.shape[-1] != self.config.model_dim:
            raise ValueError(
                f"MoE input must have last dim model_dim={self.config.model_dim}, got shape "
                f"{tuple(x.shape)}; reshape it to [..., {self.config.model_dim}]"
            )
        p_dtype = self.experts.w1.dtype
        if x.device.type == "cuda" and p_dtype == torch.float64:
            # found on an H200: the Triton kernels refused float64 from deep inside the experts
            raise TypeError(
                "float64 experts run on the CPU only: the CUDA kernels take float32, bfloat16 "
                "and float16; use layer.float() (or bf16) on CUDA, or keep float64 on the CPU"
            )
        if x.dtype != p_dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"MoE input dtype {x.dtype} differs from the layer's parameters ({p_dtype}); "
                f"call layer.to({x.dtype}) or cast the input"
            )

    def _check_padding(self, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool:
            raise TypeError(
                "padding_mask must be a bool tensor (True = padded token), got "
                f"{getattr(padding_mask, 'dtype', type(padding_mask).__name__)}"
            )
        if padding_mask.shape != x.shape[:-1]:
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)} but the input's tokens are "
                f"{tuple(x.shape[:-1])}; pass one flag per token (x.shape[:-1])"
            )
        if not isinstance(self.gate, Gate):
            raise TypeError(
                f"padding_mask needs mixmoe's Gate; this layer's gate is a "
                f"{type(self.gate).__name__}"
            )
        return ~padding_mask.reshape(-1).to(x.device)

    def forward(
        self, x: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, MoEAux]:
        """``padding_mask`` (bool, ``x.shape[:-1]``, True = padded, optional): padded tokens are
        not routed (their output is the shared experts' only, zero without them) and count in
        no loss, load or bias update."""
        self._check_input(x)
        valid_T = None if padding_mask is None else self._check_padding(x, padding_mask)
        with torch.profiler.record_function("moe.layer"):
            return self._forward(x, valid_T)

    def _route(self, x: torch.Tensor, x_TD: torch.Tensor, valid_T: torch.Tensor | None):
        if not isinstance(self.gate, Gate):  # a replacement gate: (routing, balance, z)
            if self.config.balance_loss == "sequence":
                raise TypeError(
                    "balance_loss='sequence' needs mixmoe's Gate; this layer's gate is a "
                    f"{type(self.gate).__name__}"
                )
            return self.gate(x_TD)
        seq_len = x.shape[-2] if x.dim() >= 3 else None  # [..., S, D]: sequences of S tokens
        return self.gate(x_TD, valid_T, seq_len)

    def _forward(
        self, x: torch.Tensor, valid_T: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, MoEAux]:
        cfg = self.config
        x_TD = x.reshape(-1, cfg.model_dim)
        with trace_span("moe.gate", kind="compute"):
            routing, balance, z = self._route(x, x_TD, valid_T)
        # dispatch -> experts -> combine: the strategy decides where rows go and which replicas
        # exist; the experts own the compute (the same fused ops on every path)
        rows, layout, meta = self.dispatcher.dispatch(x_TD, routing, self.experts.weights())
        shared_TD = None
        if self.shared is not None:  # here: while an async token exchange is in flight
            with trace_span("moe.shared_experts", kind="compute"):
                shared_TD = self.shared(x_TD)
        out = self.experts(rows, layout)
        y_TD = self.dispatcher.combine(out, meta)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        # the step's rows per expert over the whole expert-parallel group (on one device: ours)
        global_N = getattr(meta, "global_counts_N", None)
        global_N = meta.counts_N if global_N is None else global_N
        if cfg.balance_loss == "global_batch":
            score = cfg.gate.score if isinstance(self.gate, Gate) else "softmax"
            probs_TN = balance_probs(routing.logits_TN, score)
            balance = global_balance_loss(probs_TN, global_N, valid_T)
        if self.training and not _in_backward():
            self._record_load(global_N, meta.stats)
        loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        aux = MoEAux(
            balance_loss=balance,
            z_loss=z,
            loss=loss,
            counts_N=meta.counts_N,
            stats=meta.stats or None,
            plan_wait_ms=getattr(meta, "plan_wait_ms", 0.0),  # (an expert-parallel step's)
        )
        return y_TD.to(x.dtype).reshape(x.shape), aux

    # -- step load: metrics and aux-loss-free balancing ----------------------------------------
    @torch.no_grad()
    def _record_load(self, global_N: torch.Tensor, stats: dict | None) -> None:
        self.step_load_N += global_N.to(self.step_load_N.device)
        self._step_forwards += 1
        self._step_replicas += int((stats or {}).get("replicas", 0))

    @torch.no_grad()
    def end_step(self, all_reduce=None) -> LoadRecord:
        """Close the optimizer step: the ``LoadRecord`` of the forwards since the last call,
        then ``gate.expert_bias += rate * sign(mean - load)`` (when enabled) and a reset.

        ``all_reduce(t)`` (optional, in place, sum): adds the counts of the ranks that hold
        OTHER tokens than this layer's expert-parallel group (data parallelism on one device:
        the data-parallel group; expert-data parallelism: the replicas of this EP group). Call
        it on every rank, every step (it is a collective when given)."""
        load_N = self.step_load_N.clone()
        if all_reduce is not None:
            all_reduce(load_N)
        bias_N = getattr(self.gate, "expert_bias", None)
        if bias_N is not None:
            update_expert_bias(bias_N, load_N, self.config.gate.bias_update_rate)
        record = LoadRecord(
            load_N=load_N.cpu(),
            forwards=self._step_forwards,
            replicas=self._step_replicas,
            bias_min=None if bias_N is None else float(bias_N.min()),
            bias_max=None if bias_N is None else float(bias_N.max()),
        )
        self.step_load_N.zero_()
        self._step_forwards = self._step_replicas = 0
        return record
