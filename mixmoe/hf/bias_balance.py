"""Aux-loss-free balancing for transformers models: update the routers' ``e_score_correction_bias``.

Legend: T tokens, K top-k, N experts (of one router), R routers with a bias.

DeepSeek-V3, GLM-4-MoE and their kin (every router of the installed transformers that carries an
``e_score_correction_bias`` [N] buffer, or [1, N] as ERNIE-4.5's ``moe_statics``) add that bias to the router scores to choose experts,
never to the combine weights; transformers loads it and never moves it. ``BiasBalancer`` moves
it as DeepSeek-V3 trains it, once per optimizer step, with mixmoe's rule
(``mixmoe.gating.bias_balance.update_expert_bias``):

    bias_N += rate * sign(mean(load_N) - load_N)

``load_N`` = the expert ids the router chose during the step's training-mode forwards (every
micro-batch of gradient accumulation summed; a forward run again inside a backward, activation
recomputation, is not counted; eval forwards are not counted), summed over the data-parallel
ranks by ONE all_reduce of the [R * N] counts when a group is given (every rank must then call
``step()`` every step, with or without tokens). Equal counts give bit-identical biases on every
rank.

Where the ids come from: the router's own output when it returns them (an integer [T, K]
tensor, e.g. ``(logits, weights, ids)``: the global ids, also under expert parallelism);
otherwise the ``top_k_index`` given to the block's experts module (families whose bias lives on
the block: HY-V3, MiniMax-M2, ERNIE-4.5's ``moe_statics``). Ids outside [0, N) (padding or
expert-parallel sentinels) are not counted. Padded tokens the router routes are counted (the
router cannot tell them apart).

    balancer = install_bias_balance(model, optimizer, rate=1e-3, group=dp_comm)  # or:
    balancer = BiasBalancer(model); ...; optimizer.step(); balancer.step()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mixmoe.gating.bias_balance import update_expert_bias

BIAS_NAME = "e_score_correction_bias"


def _in_backward() -> bool:
    """A forward run while autograd executes a backward on this thread is a recomputation."""
    return torch._C._current_graph_task_id() != -1


def _is_experts(module: nn.Module) -> bool:
    """An experts module decorated with ``@use_experts_implementation`` (it sets these flags)."""
    return all(hasattr(module, f) for f in ("has_gate", "is_transposed", "is_concatenated"))


def _chosen_ids(output: object) -> torch.Tensor | None:
    """The last integer [T, K] tensor of a router's output tuple (None if there is none)."""
    items = output if isinstance(output, tuple) else (output,)
    for item in reversed(items):
        if isinstance(item, torch.Tensor) and item.dim() == 2 and not item.is_floating_point():
            return item
    return None


@dataclass
class _Router:
    """One biased router: its bias, the step's counts, and where its ids were read."""

    name: str
    bias_N: torch.Tensor
    load_N: torch.Tensor
    source: str | None = None  # "router" once the router's output carried the ids
    handles: list = field(default_factory=list)

    def count(self, ids: torch.Tensor) -> None:
        N = self.bias_N.numel()
        flat = ids.reshape(-1).to(self.load_N.device)
        flat = flat[(flat >= 0) & (flat < N)]  # sentinels / dropped choices are no load
        self.load_N += torch.bincount(flat, minlength=N)


class BiasBalancer:
    """Counts every biased router's choices (forward hooks) and applies the update in
    ``step()``. ``rate`` > 0 (DeepSeek-V3: 1e-3). ``group``: None (one process), a mixmoe
    ``Communicator`` / ``LocalCommunicator``, or a ``torch.distributed`` process group (the
    data-parallel ranks whose tokens count together). Raises ValueError when the model has no
    router with ``e_score_correction_bias``."""

    def __init__(self, model: nn.Module, rate: float = 1e-3, group: object | None = None) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1e30:
            raise ValueError(f"rate must be a finite number > 0 (e.g. 1e-3), got {rate!r}")
        self.rate = float(rate)
        self.comm = _communicator(group)
        self.model = model
        self.routers: list[_Router] = []
        self.last_load: dict[str, torch.Tensor] = {}  # set by the optimizer hook, when installed
        self._optimizer_handle = None
        modules = dict(model.named_modules())
        for name, module in modules.items():
            bias_N = getattr(module, BIAS_NAME, None)
            if not isinstance(bias_N, torch.Tensor):
                continue
            if bias_N.dim() == 2 and bias_N.shape[0] == 1:  # ERNIE-4.5: [1 group, N]
                bias_N = bias_N[0]  # a view: updates reach the module's tensor
            if bias_N.dim() != 1:
                continue
            load_N = torch.zeros(bias_N.numel(), dtype=torch.int64, device=bias_N.device)
            router = _Router(name, bias_N, load_N)
            router.handles.append(module.register_forward_hook(self._router_hook(router)))
            experts = _experts_near(modules, name)
            if experts is not None:
                router.handles.append(experts.register_forward_pre_hook(self._experts_hook(router)))
            self.routers.append(router)
        if not self.routers:
            raise ValueError(
                f"{type(model).__name__} has no module with an {BIAS_NAME} buffer; bias "
                "balancing applies to DeepSeek-V3 / GLM-4-MoE style routers"
            )

    def _counting(self) -> bool:
        return self.model.training and not _in_backward()

    def _router_hook(self, router: _Router):
        def hook(module, args, output):
            ids = _chosen_ids(output)
            if ids is None:
                return
            router.source = "router"
            if self._counting():
                router.count(ids)

        return hook

    def _experts_hook(self, router: _Router):
        def hook(module, args):
            # the router (a child of the block) ran first: if it returned the ids, they counted
            if router.source != "router" and self._counting() and len(args) >= 2:
                router.count(args[1])

        return hook

    @torch.no_grad()
    def step(self) -> dict[str, torch.Tensor]:
        """Close the optimizer step: ``{router name: load_N}`` (the counts used, all ranks
        summed), every bias moved once, the counts reset. One all_reduce when a group is set."""
        loads = torch.cat([r.load_N for r in self.routers])  # [R * N]
        if self.comm is not None:
            self.comm.all_reduce(loads)
        out, start = {}, 0
        for r in self.routers:
            N = r.bias_N.numel()
            load_N = loads[start : start + N]
            start += N
            update_expert_bias(r.bias_N, load_N, self.rate)
            out[r.name] = load_N.cpu()
            r.load_N.zero_()
        return out

    def remove(self) -> None:
        """Detach every hook (and the optimizer hook, when installed)."""
        for r in self.routers:
            for h in r.handles:
                h.remove()
            r.handles.clear()
        if self._optimizer_handle is not None:
            self._optimizer_handle.remove()
            self._optimizer_handle = None


def install_bias_balance(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rate: float = 1e-3,
    group: object | None = None,
) -> BiasBalancer:
    """A ``BiasBalancer`` whose ``step()`` runs after every ``optimizer.step()`` (a step post
    hook); ``balancer.last_load`` holds the last step's loads."""
    balancer = BiasBalancer(model, rate, group)

    def after_step(optimizer, args, kwargs) -> None:
        balancer.last_load = balancer.step()

    balancer._optimizer_handle = optimizer.register_step_post_hook(after_step)
    return balancer


def _experts_near(modules: dict[str, nn.Module], name: str) -> nn.Module | None:
    """The one experts module in the bias owner's block: under the owner, its parent or its
    grandparent (the first level that holds exactly one)."""
    prefix = name
    for _ in range(3):
        found = [
            m
            for n, m in modules.items()
            if _is_experts(m) and (n.startswith(prefix + ".") or not prefix)
        ]
        if len(found) == 1:
            return found[0]
        if len(found) > 1 or not prefix:
            return None
        prefix = prefix.rpartition(".")[0]
    return None


def _communicator(group: object | None):
    """None, a mixmoe communicator as it is, or a torch process group wrapped in one."""
    if group is None:
        return None
    from mixmoe.comm import Communicator, ProcessGroupCommunicator

    if isinstance(group, Communicator):
        return group
    return ProcessGroupCommunicator(group)
