"""Gradient synchronisation and global-norm clipping of ``mixmoe train``.

The objective of one step is the global-batch mean loss J = sum over shards s of J_s, where
J_s = (sum of the shard's cross entropies) / (targets of the global batch) + aux_s / S (S shards,
see ``mixmoe.train.loop``). Each rank back-propagates its own shards' J_s, so:

- dense and gate parameters (replicated on every rank): dJ/dp = the SUM over the world of the
  ranks' gradients -> one flat all_reduce(sum) over the world (a bucket, not one call per
  tensor);
- expert parameters (rank r of an EP group owns a slice): the backward all-to-all already sums
  the contributions of every token of the EP group, so the owner holds the sum over its EP
  group; EP groups see different data, so dJ/dw = the SUM over the expert-data-parallel group
  (the ranks owning the same experts in the other EP groups) -> one flat all_reduce(sum) there.

Clipping uses the GLOBAL norm: ||g||^2 = sum of the dense squares (identical on every rank after
the reduction, counted once) + the expert squares summed over the EP group (each rank holds a
different slice; the EDP copies are identical after the reduction and are not counted twice).
Every rank then scales by the same factor, as a 1-rank run with every expert would.
Every rank joins every collective, with missing gradients (parameters unused by a shard) taken
as zeros, so nobody waits on a rank that skipped a call.
"""

from __future__ import annotations

import torch
from torch import nn

from mixmoe.comm import Communicator


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense + gate parameters, expert parameters) of ``model``, in ``named_parameters`` order
    (the same on every rank). Expert parameters are the ones ``parallelize_moe`` marked, or the
    ``Experts`` parameters of a model that was not parallelized."""
    from mixmoe.parallel import expert_parameters

    experts = [p for _, p in expert_parameters(model)]
    ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in ids]
    return dense, experts


def _fill_missing(params: list[nn.Parameter]) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _flat_all_reduce(comm: Communicator, params: list[nn.Parameter]) -> None:
    if comm.world_size == 1 or not params:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def sync_gradients(dense: list[nn.Parameter], experts: list[nn.Parameter], world, edp) -> None:
    """Dense gradients summed over ``world``, expert gradients over ``edp`` (in place)."""
    _fill_missing(dense)
    _fill_missing(experts)
    _flat_all_reduce(world, dense)
    _flat_all_reduce(edp, experts)


def clip_global_norm(
    dense: list[nn.Parameter], experts: list[nn.Parameter], ep, max_norm: float
) -> torch.Tensor:
    """The global gradient norm (float64 scalar, the same on every rank); when ``max_norm > 0``
    every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s
    rule). Call after ``sync_gradients``."""

    def squares(params: list[nn.Parameter]) -> torch.Tensor:
        if not params:
            return torch.zeros((), dtype=torch.float64)
        sq = torch.stack([p.grad.detach().double().pow(2).sum() for p in params]).sum()
        return sq.cpu()

    expert_sq = squares(experts)
    if ep.world_size > 1:
        device = experts[0].grad.device if experts else torch.device("cpu")
        expert_sq = expert_sq.to(device)
        ep.all_reduce(expert_sq)
        expert_sq = expert_sq.cpu()
    norm = (squares(dense) + expert_sq).sqrt()
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in dense + experts:
                p.grad.mul_(coef)
    return norm
