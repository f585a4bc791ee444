"""Water-fill starts thinned from a candidate in shadow's form: its coldest experts dropped.

Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (C[s][g] = rows rank s routes
to expert g; expert g is owned by rank g // E).

A fill only adds holders to its start (``mixmoe.placement.level_fill``); it never drops one. When
the best candidate holds each of its experts at every rank but the owner (shadow's form: FasterMoE's
rule, or a source-replica search that replicated everywhere), the fill from it inherits two costs
it cannot undo: every rank's slots the candidate fills are out of reach of the helpers the next
hottest experts need (with ``replica_slots`` experts shadowed, all of them), and every copy of a
merely warm expert is paid by every rank. The fill from nothing replicated has neither cost, but
loses the hottest experts' replicas everywhere, which save the most traffic.

``thinned_starts`` gives the starts in between: the candidate less its coldest expert, less its two
coldest, and so on down to its hottest alone. ``plan_mix`` fills them in that order, after its
other fills and only where the fill from the candidate ended ``THIN_WHEN`` below it (or C is
small: ``THIN_ALWAYS``), while each is the best fill so far and ends ``THIN_GAIN`` below the
one before (``planner.py``). Measured with ``bench balance`` (2026-11-27,
docs/results/2026-11-27-thinned-starts.md): DeepSeek-like shape, zipf:1.2 and zipf:2.0 at W = 64
and 256, 24-45% lower steps on one link and 28-55% under 8-GPU nodes, where 8 shadowed experts
filled every rank's 8 slots.
"""

from __future__ import annotations

import torch

__all__ = ["thinned_starts"]


def thinned_starts(
    replicas: tuple[tuple[int, tuple[int, ...]], ...], colsum_N: torch.Tensor, world_size: int
) -> list[dict[int, tuple[int, ...]]]:
    """The fill starts thinned from ``replicas`` (a plan's ``(g, holders)``, ascending by g):
    when every one of its experts is held by all ``world_size - 1`` ranks but its owner and it
    has two or more, the starts keeping its k hottest experts (by column sum ``colsum_N``,
    ties: the lower id hotter) with their holders, for k = len - 1 down to 1, each a dict
    ascending by g; else []. Deterministic: a function of its arguments only. Twin of
    ``native/plan_mix.cpp``'s ``thinned_starts``."""
    if len(replicas) < 2 or any(len(h) != world_size - 1 for _, h in replicas):
        return []
    holders = dict(replicas)
    cols = {g: int(colsum_N[g]) for g in holders}
    hottest = sorted(holders, key=lambda g: (-cols[g], g))
    return [{g: holders[g] for g in sorted(hottest[:k])} for k in range(len(hottest) - 1, 0, -1)]
