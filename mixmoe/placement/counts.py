"""Count arithmetic of the planners: validating the all-gathered counts and the sums they need.

Legend: W ranks in the EP group, E experts per rank, N = W*E experts, C = counts_WN with C[s][g] =
rows (token x choice) rank s routes to expert g; expert g is owned by rank g // E.

Validation (``counts_as_lists``, ``counts_as_tensor``), the column and row sums in one pass over C
(``counts_with_sums``) and the per-rank aggregates with nothing replicated (``baseline_loads``):
the first thing every planner does with C, and the only pass over the whole [W, N] matrix.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mixmoe.placement.cost_model import LayerShape

__all__ = [
    "CountSums",
    "baseline_loads",
    "counts_as_lists",
    "counts_as_tensor",
    "counts_with_sums",
    "sums_pointers",
]


@dataclass(frozen=True, eq=False)
class CountSums:
    """C's column sums (``colsum_N``: the rows every rank routes to each expert) and row sums
    (``rowsum_W``: the rows each rank routes), int64 CPU tensors, computed where C is: the
    layer reduces the gathered counts on the device before its one host transfer
    (``dispatch.layout.count_matrix_to_host``), or one compiled pass over C on the host
    (``native_pricing.count_sums``) serves the plan and the step's bookkeeping alike.

    Given to a planner (``plan_mix``, ``plan_shadow``, ``plan_none``: ``sums=``) they replace
    its own pass over C, ~1.4 ms at [1024, 4096]. Only their shapes, signs and equal totals are
    checked, so they must be C's: the dispatcher checks them against C when
    ``check_plans`` is set, and the planners' Python paths ignore them (they sum C)."""

    colsum_N: torch.Tensor
    rowsum_W: torch.Tensor


BAD_SUMS = -4  # the compiled entries' status for sums that cannot be C's


def raise_bad_sums() -> None:
    """The error of a compiled entry that returned ``BAD_SUMS``."""
    raise ValueError(
        "sums are not C's column and row sums (a sum is negative or the two totals differ); "
        "pass CountSums(C_WN.sum(0), C_WN.sum(1)) or leave sums=None"
    )


def sums_pointers(sums: object, W: int, N: int) -> tuple[int, int]:
    """The data pointers of ``sums`` (a ``CountSums`` for C [W, N]) for a compiled entry, after
    checking their types and shapes (TypeError / ValueError naming the field and the fix)."""
    if not isinstance(sums, CountSums):
        raise TypeError(f"sums must be a CountSums (C's column and row sums), got {sums!r}")
    for name, x, n in (("colsum_N", sums.colsum_N, N), ("rowsum_W", sums.rowsum_W, W)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int64 or x.device.type != "cpu":
            got = f"{x.dtype} on {x.device}" if isinstance(x, torch.Tensor) else repr(x)
            raise TypeError(f"sums.{name} must be an int64 CPU tensor, got {got}")
        if tuple(x.shape) != (n,) or not x.is_contiguous():
            raise ValueError(
                f"sums.{name} must be a contiguous tensor of shape ({n},), got "
                f"{tuple(x.shape)}; pass C's sums (C_WN.sum({0 if n == N else 1}))"
            )
    return sums.colsum_N.data_ptr(), sums.rowsum_W.data_ptr()


def counts_as_lists(counts_WN: object, shape: LayerShape) -> list[list[int]]:
    """Validate ``counts_WN`` ([W][N] nested sequences of ints, or an integer CPU tensor [W, N])
    against ``shape`` and return it as a list of W lists of N non-negative Python ints."""
    W, N = shape.world_size, shape.num_experts
    if isinstance(counts_WN, torch.Tensor):
        return counts_as_tensor(counts_WN, shape).tolist()  # validated, signs included
    try:
        C = [[operator.index(c) for c in row] for row in counts_WN]  # type: ignore[union-attr]
    except TypeError as exc:
        raise TypeError(
            f"counts_WN must be a [W][N] nested sequence of ints or an integer tensor: {exc}"
        ) from None
    if len(C) != W or any(len(row) != N for row in C):
        got = f"{len(C)} rows of lengths {sorted({len(row) for row in C})}"
        raise ValueError(f"counts_WN has {got}, expected (world_size, num_experts) = ({W}, {N})")
    for s, row in enumerate(C):
        if min(row, default=0) < 0:
            g = min(range(N), key=row.__getitem__)
            raise ValueError(f"counts_WN[{s}][{g}] = {row[g]} is negative; counts are row counts")
    return C


def counts_as_tensor(counts_WN: object, shape: LayerShape) -> torch.Tensor:
    """Validate ``counts_WN`` like ``counts_as_lists`` and return it as a contiguous int64 CPU
    tensor [W, N]: the tensor itself when it already is one (no copy), else a converted copy.

    Cost on an int64 tensor: one pass over it (the sign check), ~1 ms for [1024, 4096] on one
    core; nested sequences go through ``counts_as_lists`` (slow at scale: pass tensors there).
    The planners use ``counts_with_sums`` instead (the sign check inside the pass that sums).
    """
    C_WN = counts_tensor_unsigned(counts_WN, shape)
    if C_WN.numel() and int(C_WN.min()) < 0:
        _raise_negative(C_WN)
    return C_WN


def counts_with_sums(
    counts_WN: object, shape: LayerShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``counts_as_tensor`` and the sums of C in the same pass: (C_WN, colsum_N, rowsum_W), int64.

    A large C (over 8 MiB) is reduced in blocks of rows small enough to stay in cache (~0.5 MiB):
    each block's minimum, column sums and row sums are taken while it is cached, so C crosses
    the memory bus once instead of three times (measured ~1.6x faster at [1024, 4096] int64 on
    one core). A smaller C stays cached anyway: three plain reductions. The blocks' sign check
    is the minimum of their int32 words (a vectorised int32 min beats the int64 one by ~20%):
    when no word is negative no int64 is; otherwise (a negative count, or one >= 2**31) the
    exact int64 minimum decides.
    """
    C_WN = counts_tensor_unsigned(counts_WN, shape)
    W, N = C_WN.shape
    if C_WN.numel() == 0:
        return C_WN, C_WN.sum(0), C_WN.sum(1)
    rows = max(1, _BLOCK_BYTES // (8 * N))
    if rows >= W or 8 * C_WN.numel() <= _ONE_PASS_BYTES:  # three plain reductions
        low, colsum_N, rowsum_W = C_WN.min(), _column_sums(C_WN), C_WN.sum(1)
    else:
        # every block's reductions written in place: three ops per block, one sum at the end
        blocks = range(0, W, rows)
        colsum_BN = torch.empty(len(blocks), N, dtype=torch.int64)
        rowsum_W = torch.empty(W, dtype=torch.int64)
        low_B = torch.empty(len(blocks), dtype=torch.int32)
        words_W2N = C_WN.view(torch.int32)
        for i, first in enumerate(blocks):
            block = C_WN[first : first + rows]
            torch.amin(words_W2N[first : first + rows], dim=(0, 1), out=low_B[i])
            torch.sum(block, 0, out=colsum_BN[i])
            torch.sum(block, 1, out=rowsum_W[first : first + rows])
        colsum_N = colsum_BN.sum(0)
        low = low_B.min()
        if int(low) < 0:  # some int32 word is negative: the int64 counts decide
            low = C_WN.min()
    if int(low) < 0:
        _raise_negative(C_WN)
    return C_WN, colsum_N, rowsum_W


_BLOCK_BYTES = 1 << 19  # counts_with_sums' row blocks: well inside a core's L2 (1 MiB here)
_ONE_PASS_BYTES = 8 << 20  # below this C stays in the last-level cache: plain reductions


def counts_tensor_unsigned(counts_WN: object, shape: LayerShape) -> torch.Tensor:
    """Every check of ``counts_as_tensor`` but the signs; row-major."""
    return _unsigned_int64(counts_WN, shape).contiguous()


def counts_storage(counts_WN: object, shape: LayerShape) -> tuple[torch.Tensor, bool]:
    """``counts_tensor_unsigned``'s counts, and whether their storage is by columns: a C whose
    transpose is contiguous (the layer's counts from an accelerator, transposed there so that
    the compiled planner's walks down C's columns read consecutive counts) is kept as it is,
    not copied row-major (~20 ms at [1024, 4096] on this repo's CPU VM)."""
    C_WN = _unsigned_int64(counts_WN, shape)
    if C_WN.is_contiguous():
        return C_WN, False
    if C_WN.t().is_contiguous():
        return C_WN, True
    return C_WN.contiguous(), False


def _unsigned_int64(counts_WN: object, shape: LayerShape) -> torch.Tensor:
    if not isinstance(counts_WN, torch.Tensor):
        return torch.tensor(counts_as_lists(counts_WN, shape), dtype=torch.int64).reshape(
            shape.world_size, shape.num_experts
        )
    W, N = shape.world_size, shape.num_experts
    if (
        counts_WN.dtype.is_floating_point
        or counts_WN.dtype.is_complex
        or counts_WN.dtype == torch.bool
    ):
        raise TypeError(f"counts_WN must hold integers, got dtype {counts_WN.dtype}")
    if counts_WN.device.type != "cpu":
        raise ValueError(
            f"counts_WN must be a CPU tensor (the plan runs on the host), got device "
            f"{counts_WN.device}; bring the counts to the host once and pass them here"
        )
    if tuple(counts_WN.shape) != (W, N):
        raise ValueError(
            f"counts_WN has shape {tuple(counts_WN.shape)}, expected (world_size, num_experts)"
            f" = ({W}, {N})"
        )
    return counts_WN.to(torch.int64)  # (its strides kept: a C by columns stays so)


def _raise_negative(C_WN: torch.Tensor) -> None:
    s, g = divmod(int(C_WN.argmin()), C_WN.shape[1])
    raise ValueError(f"counts_WN[{s}][{g}] = {int(C_WN[s, g])} is negative; counts are row counts")


def baseline_loads(
    C_WN: torch.Tensor,
    experts_per_rank: int,
    sums: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rank_loads`` with nothing replicated, vectorized over a validated int64 ``C_WN``:
    (loads_4W, colsum_N, own_N). loads_4W: float64 [4, W], the aggregates in ``LOADS`` order
    (replica all 0); colsum_N[g] = rows routed to g by every rank; own_N[g] = C[g // E][g], the
    rows of g its owner routes to it (both int64). ``sums``: (colsum_N, rowsum_W) when already
    known (``counts_with_sums``), else computed here.

    Cost without ``sums``: two reductions over C (column and row sums), ~2-3 ms for [1024, 4096]
    int64 on one core.
    """
    W, N = C_WN.shape
    E = experts_per_rank
    colsum_N, sent_all_W = (_column_sums(C_WN), C_WN.sum(1)) if sums is None else sums
    own_N = torch.diagonal(C_WN.view(W, W, E), dim1=0, dim2=1).t().reshape(N)
    local_W = own_N.view(W, E).sum(1)
    rows_W = colsum_N.view(W, E).sum(1)
    remote_W = (sent_all_W - local_W) + (rows_W - local_W)
    loads_4W = torch.stack([rows_W, local_W, remote_W, torch.zeros_like(rows_W)])
    return loads_4W.to(torch.float64), colsum_N, own_N


def _column_sums(C_WN: torch.Tensor) -> torch.Tensor:
    """C_WN.sum(0), reduced 8 rows at a time first: on one CPU core torch reduces the outer dim
    of a [1024, 4096] int64 tensor ~2x faster this way (1.4 ms vs 2.5-3 ms measured)."""
    W, N = C_WN.shape
    W8 = W // 8 * 8
    if W8 == 0:
        return C_WN.sum(0)
    colsum_N = C_WN[:W8].view(W8 // 8, 8, N).sum(1).sum(0)
    return colsum_N + C_WN[W8:].sum(0) if W8 < W else colsum_N
