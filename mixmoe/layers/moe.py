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
from mixmoe.layers.experts import Experts
from mixmoe.layers.gate import Gate
from mixmoe.tracing import trace_span
from mixmoe.types import MoEAux


class MoE(nn.Module):
    """``forward(x[..., D]) -> (y[..., D], aux)``; dropless, any top-k, fp32/bf16/fp16.

    ``gate`` replaces the router module (it must return ``(Routing, balance_loss, z_loss)``);
    benchmarks use it to impose synthetic routing.

    ``ep_rank`` / ``ep_size``: build only the experts rank ``ep_rank`` of an expert-parallel group
    of ``ep_size`` ranks owns (``N / ep_size`` of them, the same weights the single-device layer
    built from the same seed holds), so no rank ever allocates all N experts. Such a layer runs
    after ``mixmoe.parallel.parallelize_moe(layer, comm)`` installed its strategy.
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
        self.dispatcher = LocalDispatcher(config)

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
        if x.dtype != p_dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"MoE input dtype {x.dtype} differs from the layer's parameters ({p_dtype}); "
                f"call layer.to({x.dtype}) or cast the input"
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        self._check_input(x)
        with torch.profiler.record_function("moe.layer"):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        cfg = self.config
        x_TD = x.reshape(-1, cfg.model_dim)
        with trace_span("moe.gate", kind="compute"):
            routing, balance, z = self.gate(x_TD)
        # dispatch -> experts -> combine: the strategy decides where rows go and which replicas
        # exist; the experts own the compute (the same fused ops on every path)
        rows, layout, meta = self.dispatcher.dispatch(x_TD, routing, self.experts.weights())
        out = self.experts(rows, layout)
        y_TD = self.dispatcher.combine(out, meta)
        loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        aux = MoEAux(
            balance_loss=balance,
            z_loss=z,
            loss=loss,
            counts_N=meta.counts_N,
            stats=meta.stats or None,
        )
        return y_TD.to(x.dtype).reshape(x.shape), aux
