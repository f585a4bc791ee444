"""``Gate``: the router module (a linear layer plus a routing function from ``mixmoe.gating``).

Legend: T tokens, D model dim, N experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.config import MoEConfig
from mixmoe.gating import load_balancing_loss, route, router_z_loss
from mixmoe.types import Routing


class Gate(nn.Module):
    """logits_TN = x_TD @ weight.T + bias, then the configured router.

    Returns ``(routing, balance_loss, z_loss)``. Switch jitter and GShard random routing act only in
    training mode; ``generator`` (optional) makes them reproducible.
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
        self.wg = nn.Linear(
            config.model_dim, config.num_experts, bias=config.gate.bias, device=device, dtype=dtype
        )
        self.generator: torch.Generator | None = None

    def forward(self, x_TD: torch.Tensor) -> tuple[Routing, torch.Tensor, torch.Tensor]:
        gate = self.config.gate
        if self.training and gate.jitter_eps > 0:
            noise = torch.empty_like(x_TD).uniform_(
                1.0 - gate.jitter_eps, 1.0 + gate.jitter_eps, generator=self.generator
            )
            x_TD = x_TD * noise
        logits_TN = self.wg(x_TD)
        routing = route(logits_TN, self.config.top_k, gate, self.training, self.generator)
        balance = load_balancing_loss(
            logits_TN, routing.ids_TK, first_choice_only=gate.type == "gshard"
        )
        return routing, balance, router_z_loss(logits_TN)
