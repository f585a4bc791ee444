"""``SharedExperts``: the dense experts every token goes through (DeepSeek, Qwen2-MoE).

Legend: T tokens, D model dim, F hidden dim of the shared MLP (count x per-expert hidden).

``count`` shared experts of hidden size h are one MLP of hidden size F = count * h: their
hidden units are disjoint and their outputs add up, which is exactly the MLP over the
concatenated hidden units (DeepSeek builds them so). Weights [in, out] like the routed experts:
w1 [D, F], b1 [F], w2 [F, D], b2 [D]; SwiGLU adds w3 [D, F] (b3 [F]): silu(x w1) * (x w3).
``gate=True``: the output times sigmoid(x @ gate_w) per token, gate_w [D] (Qwen2-MoE).
Initialisation: nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in)) from the global RNG.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SharedExperts(nn.Module):
    def __init__(
        self,
        model_dim: int,
        hidden_dim: int,
        activation: str = "gelu",
        bias: bool = True,
        gate: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        D, Fh = model_dim, hidden_dim
        kw = {"device": device, "dtype": dtype}
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(D, Fh, **kw))
        self.w2 = nn.Parameter(torch.empty(Fh, D, **kw))
        self.b1 = nn.Parameter(torch.empty(Fh, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(D, **kw)) if bias else None
        swiglu = activation == "swiglu"
        self.w3 = nn.Parameter(torch.empty(D, Fh, **kw)) if swiglu else None
        self.b3 = nn.Parameter(torch.empty(Fh, **kw)) if swiglu and bias else None
        self.gate_w = nn.Parameter(torch.empty(D, **kw)) if gate else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            fan_in = self.w2.shape[0] if name in ("w2", "b2") else self.w1.shape[0]
            if not p.is_meta:
                p.uniform_(-1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))

    def _lin(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = x @ w
        return out if b is None else out + b

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h_TF = self._lin(x_TD, self.w1, self.b1)
        if self.activation == "swiglu":
            h_TF = F.silu(h_TF) * self._lin(x_TD, self.w3, self.b3)
        elif self.activation == "gelu":
            h_TF = F.gelu(h_TF)  # exact (erf), as the routed experts
        elif self.activation == "relu":
            h_TF = F.relu(h_TF)
        else:
            h_TF = F.silu(h_TF)
        y_TD = self._lin(h_TF, self.w2, self.b2)
        if self.gate_w is not None:
            y_TD = y_TD * torch.sigmoid(x_TD @ self.gate_w)[:, None]
        return y_TD

    def extra_repr(self) -> str:
        D, Fh = self.w1.shape
        return (
            f"model_dim={D}, hidden_dim={Fh}, activation={self.activation}, "
            f"bias={self.b1 is not None}, gate={self.gate_w is not None}"
        )
