"""``Experts``: the parameters of E experts, stacked, and the compute over them.

Legend: E experts held by this module, N global experts, D model dim, F hidden dim.

w1 [E, D, F], b1 [E, F], w2 [E, F, D], b2 [E, D]; SwiGLU adds w3 [E, D, F] (and b3 [E, F]).
The module holds global experts ``first_expert .. first_expert + E - 1`` of ``num_global_experts``
(all of them on one device; one rank's shard under expert parallelism, built directly: never
the full set first).

Initialisation matches ``nn.Linear`` per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn for
expert g from its own generator seeded with ``base_seed + g``; ``base_seed`` is one draw from the
global RNG (or given). So a shard built after ``torch.manual_seed(s)`` holds exactly the weights
the single-device layer built after ``torch.manual_seed(s)`` holds for the same experts.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mixmoe.dispatch.step import DispatchedRows, ExpertLayout, ExpertOutputs, run_work
from mixmoe.ops.expert_mlp import ExpertWeights

EXPERT_PARAM_NAMES = ("w1", "b1", "w2", "b2", "w3", "b3")


class Experts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        model_dim: int,
        hidden_dim: int,
        activation: str = "gelu",
        bias: bool = True,
        *,
        first_expert: int = 0,
        num_global_experts: int | None = None,
        base_seed: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_global_experts = num_experts if num_global_experts is None else num_global_experts
        if not 0 <= first_expert <= num_global_experts - num_experts:
            raise ValueError(
                f"experts {first_expert}..{first_expert + num_experts - 1} do not fit in "
                f"num_global_experts={num_global_experts}; use 0 <= first_expert <= "
                f"{num_global_experts - num_experts}"
            )
        self.num_experts, self.model_dim, self.hidden_dim = num_experts, model_dim, hidden_dim
        self.activation = activation
        # which global experts these are: first_expert .. first_expert + num_experts - 1
        self.first_expert, self.num_global_experts = first_expert, num_global_experts
        E, D, F = num_experts, model_dim, hidden_dim
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(E, D, F, **kw))
        self.w2 = nn.Parameter(torch.empty(E, F, D, **kw))
        self.b1 = nn.Parameter(torch.empty(E, F, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(E, D, **kw)) if bias else None
        swiglu = activation == "swiglu"
        self.w3 = nn.Parameter(torch.empty(E, D, F, **kw)) if swiglu else None
        self.b3 = nn.Parameter(torch.empty(E, F, **kw)) if swiglu and bias else None
        self.reset_parameters(base_seed)

    @torch.no_grad()
    def reset_parameters(self, base_seed: int | None = None) -> None:
        """Per-expert seeded init (see the module docstring); ``base_seed`` None draws one from
        the global RNG. Nothing is drawn for parameters on the meta device."""
        if base_seed is None:
            # on the CPU even under a meta/cuda default device: the same draw everywhere
            base_seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        params = self.named_expert_parameters()
        if not params or params[0][1].is_meta:
            return
        device = params[0][1].device
        for e in range(self.num_experts):
            gen = torch.Generator(device=device).manual_seed(base_seed + self.first_expert + e)
            for name, p in params:
                fan_in = self.hidden_dim if name in ("w2", "b2") else self.model_dim
                bound = 1.0 / math.sqrt(fan_in)
                p[e].uniform_(-bound, bound, generator=gen)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.w1, self.w2, self.b1, self.b2, self.w3, self.b3)

    def named_expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, getattr(self, n)) for n in EXPERT_PARAM_NAMES if getattr(self, n) is not None]

    def forward(self, rows: DispatchedRows, layout: ExpertLayout) -> ExpertOutputs:
        """Run every work item of the step in order: one fused expert MLP call each, reading its
        source rows by index and writing token order (local rows, weighted and K-summed) or
        return order (received rows, unweighted). Local outputs are summed in work order, after
        the local output the dispatcher already computed (``rows.local_done_TD``), if any."""
        local_TD, received_RD = rows.local_done_TD, None
        for work in layout.work:
            source = rows.local_TD if work.source == "local" else rows.received()
            weights = self.weights() if work.weights == "owned" else rows.replicas
            if weights is None:
                raise ValueError(f"work item {work.span!r} needs replicas but none were fetched")
            out = run_work(work, source, weights, self.activation)
            if work.source == "received":
                received_RD = out if received_RD is None else received_RD + out
            else:
                local_TD = out if local_TD is None else local_TD + out
        if local_TD is None:
            raise ValueError("an expert layout needs at least one local work item")
        return ExpertOutputs(local_TD, received_RD)

    def extra_repr(self) -> str:
        return (
            f"experts {self.first_expert}..{self.first_expert + self.num_experts - 1} of "
            f"{self.num_global_experts}, model_dim={self.model_dim}, "
            f"hidden_dim={self.hidden_dim}, activation={self.activation}, bias={self.b1 is not None}"
        )
