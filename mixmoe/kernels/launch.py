"""What every launcher in ``mixmoe.kernels`` shares: tile configs, the fp32 matmul precision, and
the argument checks that turn a bad call into a ``ValueError`` instead of a wrong kernel.

Legend: Nb blocks, B block size, S weight slots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TileConfig:
    """One explicit tile shape; passing it to a launcher bypasses autotuning (tests use tiny tiles
    because the Triton interpreter is slow). ``block_m``/``block_n``/``block_k`` are the GEMM tile
    (for the weight gradient: ``block_m`` tiles the input features, ``block_n`` the output features,
    ``block_k`` the rows reduced per step); all must be powers of two >= 16.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {value}")

    def meta(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


AUTOTUNE_ENV = "MIXMOE_AUTOTUNE"


def autotune_enabled() -> bool:
    """Whether launchers called without ``config`` autotune (``MIXMOE_AUTOTUNE=1``) or take the
    fixed tiles of ``default_tiles``. Off by default: autotuning compiles and times every
    candidate tile for every new problem class (tens of seconds per class), which made a first
    step, and the GPU test tier, take minutes."""
    value = os.environ.get(AUTOTUNE_ENV, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{AUTOTUNE_ENV}={value!r} is not understood; set it to 1 (autotune) or 0")


def default_tiles(kernel: str, dtype: torch.dtype, block_size: int) -> TileConfig:
    """The fixed tiles launchers use when not autotuning. ``kernel``: ``"gemm"`` (forward and dX;
    ``block_m`` tiles one block's rows, so it never exceeds the block size) or ``"weight_grad"``
    (``block_k`` reduces rows of one block at a time). 16-bit inputs take the wide tiles the
    H100 autotuner favoured; fp32 (tf32 dots) smaller ones that fit shared memory."""
    wide = dtype in (torch.float16, torch.bfloat16)
    if kernel == "gemm":
        if wide:
            bm = min(block_size, 128)
            return TileConfig(
                bm, 128, 64, num_warps=8 if bm == 128 else 4, num_stages=4 if bm < 128 else 3
            )
        return TileConfig(min(block_size, 64), 64, 32, num_warps=4, num_stages=3)
    if kernel == "weight_grad":
        if wide:
            return TileConfig(128, 128, min(block_size, 64), num_warps=8, num_stages=3)
        return TileConfig(64, 64, min(block_size, 32), num_warps=4, num_stages=3)
    raise ValueError(f"kernel must be 'gemm' or 'weight_grad', got {kernel!r}")


def check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [16, 256] (the schedule's block size), "
            f"got {block_size}"
        )


def check_schedule(
    block_slot_Nb: torch.Tensor, block_rows_Nb: torch.Tensor, device: torch.device
) -> None:
    for name, t in (("block_slot_Nb", block_slot_Nb), ("block_rows_Nb", block_rows_Nb)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the data on {device}; move it with .to()")
    if block_slot_Nb.shape != block_rows_Nb.shape:
        raise ValueError(
            f"block_slot_Nb {tuple(block_slot_Nb.shape)} and block_rows_Nb "
            f"{tuple(block_rows_Nb.shape)} must have the same length"
        )


def check_index(
    name: str, index: torch.Tensor | None, length: int, device: torch.device
) -> torch.Tensor | None:
    """A per-padded-row index or scale: 1-D, ``length`` long, on ``device``; made contiguous."""
    if index is None:
        return None
    if index.dim() != 1 or index.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(index.shape)}")
    if index.device != device:
        raise ValueError(f"{name} is on {index.device}, the data on {device}; move it with .to()")
    return index.contiguous()


def check_float(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def check_out(
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    name: str = "out",
) -> torch.Tensor:
    """``out`` when it fits, else a fresh ``torch.empty`` (every element is written by the kernel)."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {tuple(shape)} on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


def common_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision. fp32 operands follow ``torch.backends.cuda.matmul.allow_tf32``
    as ``torch.matmul`` does (off by default: IEEE fp32 products). fp16/bf16 operands get Triton's
    default ("tf32", which only concerns fp32 operands): their products are exact on the tensor
    cores. Accumulation is fp32 always."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def dot_in_fp32(kernel, dtype: torch.dtype) -> bool:
    """True when ``kernel`` runs under the Triton CPU interpreter (``TRITON_INTERPRET=1`` at import)
    with bf16 operands: the interpreter's ``tl.dot`` multiplies bf16's raw uint16 storage, so the
    kernels upcast both tiles to fp32 first. bf16 products are exact in fp32 and the accumulator is
    fp32 either way, so the result is the one the GPU's bf16 MMA computes (up to summation order)."""
    from triton.runtime.interpreter import InterpretedFunction

    return dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction)
