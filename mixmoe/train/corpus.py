"""A real text corpus that ships with every Python: the ``pydoc_data.topics`` help texts, as bytes.

Legend: B streams (batch), L stream length.

Byte-level (vocabulary 256), no tokenizer, no download; ~0.47 MB on CPython 3.11. Topics are
joined in sorted key order so the corpus is the same on every run and every rank.
"""

from __future__ import annotations

import torch

BYTE_VOCAB = 256


def pydoc_topics_bytes() -> torch.Tensor:
    """The corpus as an int64 tensor of byte values (0..255)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def byte_streams(data: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``data`` cut into ``batch_size`` contiguous streams, ``[B, L]`` (L = len // B; the tail is
    dropped): read segment after segment, stream b continues where its last segment ended, as a
    recurrent-memory model (Transformer-XL) trains."""
    if batch_size < 1 or batch_size > data.numel():
        raise ValueError(
            f"batch_size={batch_size} does not fit a corpus of {data.numel()} bytes; "
            f"use 1 <= batch_size <= {data.numel()}"
        )
    L = data.numel() // batch_size
    return data[: L * batch_size].view(batch_size, L)
