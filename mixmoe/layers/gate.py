"""``Gate``: the router module (a linear layer plus a routing function from ``mixmoe.gating``).

Legend: T tokens, D model dim, N experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.config import MoEConfig
from mixmoe.gating import load_balancing_loss, route, router_z_loss
from mixmoe.gating.losses import balance_probs, sequence_balance_loss
from mixmoe.types import Routing

_ROUTER_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Gate(nn.Module):
    """logits_TN = x_TD @ weight.T + bias, then the configured router (``GateConfig``).

    Returns ``(routing, balance_loss, z_loss)``. Switch jitter and GShard random routing act only in
    training mode; ``generator`` (optional) makes them reproducible.

    ``gate.router_dtype`` set: ``wg`` is created in that dtype and kept in it by ``.to()`` /
    ``.half()`` / ``.bfloat16()``; the router runs in it with autocast off, and the combine
    weights are cast to the input's dtype. ``gate.expert_bias``: a float32 buffer
    ``expert_bias`` [N] (zeros; persistent, so it is checkpointed), added to the scores for
    selection only; ``MoE.end_step`` updates it.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        gate = config.gate
        self.router_dtype = _ROUTER_DTYPES.get(gate.router_dtype or "")
        self.wg = nn.Linear(
            config.model_dim,
            config.num_experts,
            bias=gate.bias,
            device=device,
            dtype=self.router_dtype or dtype,
        )
        self.expert_bias: torch.Tensor | None
        if gate.expert_bias:
            bias_N = torch.zeros(config.num_experts, dtype=torch.float32, device=device)
            self.register_buffer("expert_bias", bias_N)
        else:
            self.expert_bias = None
        self.generator: torch.Generator | None = None

    def _apply(self, fn, recurse=True):
        # ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` must not touch the router weight (when
        # router_dtype is set) nor the selection bias: a cast there would round them to the
        # layer's precision. Device moves still apply. (Gate has no parameters of its own: wg's
        # are its child's; its buffers are expert_bias.)
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.dtype != t.dtype and t.is_floating_point():
                return t.to(device=out.device)  # take the move, refuse the cast
            return out

        if recurse:
            self.wg._apply(fn if self.router_dtype is None else keep_dtype, recurse)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = keep_dtype(buf)
        return self

    def _logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.router_dtype is None:
            return self.wg(x_TD)
        with torch.autocast(x_TD.device.type, enabled=False):
            return self.wg(x_TD.to(self.router_dtype))

    def forward(
        self,
        x_TD: torch.Tensor,
        valid_T: torch.Tensor | None = None,
        seq_len: int | None = None,
    ) -> tuple[Routing, torch.Tensor, torch.Tensor]:
        """``valid_T`` (bool [T], optional): False marks a padded token: its choices become id -1
        and weight 0 (it is not routed) and it counts in no loss. ``seq_len``: tokens per
        sequence for ``balance_loss="sequence"`` (None: all T tokens are one sequence)."""
        cfg, gate = self.config, self.config.gate
        if self.training and gate.jitter_eps > 0:
            noise = torch.empty_like(x_TD).uniform_(
                1.0 - gate.jitter_eps, 1.0 + gate.jitter_eps, generator=self.generator
            )
            x_TD = x_TD * noise
        logits_TN = self._logits(x_TD)
        routing = route(logits_TN, cfg.top_k, gate, self.training, self.generator, self.expert_bias)
        ids_TK, weights_TK = routing.ids_TK, routing.weights_TK
        if self.router_dtype is not None:  # router math wide, combine in the layer's dtype
            weights_TK = weights_TK.to(x_TD.dtype)
        if valid_T is not None:
            pad_TK = ~valid_T[:, None].expand_as(ids_TK)
            ids_TK = ids_TK.masked_fill(pad_TK, -1)
            weights_TK = weights_TK.masked_fill(pad_TK, 0.0)
        routing = Routing(ids_TK, weights_TK, logits_TN)
        probs_TN = balance_probs(logits_TN, gate.score)
        if cfg.balance_loss == "sequence":
            S = x_TD.shape[0] if seq_len is None else seq_len
            balance = sequence_balance_loss(probs_TN, ids_TK, max(S, 1), valid_T)
        else:  # micro_batch; global_batch is finished by the layer from the step's counts
            balance = load_balancing_loss(
                logits_TN,
                ids_TK,
                first_choice_only=gate.type == "gshard",
                probs_TN=probs_TN,
                valid_T=valid_T,
            )
        return routing, balance, router_z_loss(logits_TN, valid_T)
