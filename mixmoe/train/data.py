"""Training data of ``mixmoe train``: token sequences (the byte-level ``pydoc_data`` corpus, or the
user's own, ``mixmoe.train.sources``) split deterministically into train and eval, global
batches that are a function of (seed, step) only, and shards.

Legend: G rows of the global batch, B rows of one shard, L sequence length.

A token sequence is a 1-D int64 tensor or a read-only ``numpy.memmap`` of uint16/uint32 ids
(a pre-tokenized file: only the windows a batch reads are touched). Every rank builds the SAME
global batch for a step (G windows: cheap) and keeps its contiguous shard: shard ``i`` of ``S`` is rows ``i*G/S .. (i+1)*G/S - 1``.
With ``S = world_size * micro_batches`` and shard ``rank * micro_batches + m``, the union over
ranks and micro-batches is exactly the global batch a 1-rank run sees, and a 1-rank run with
``micro_batches = W`` processes the very shards W ranks process. The data position of a run is
its step number (a checkpoint stores it).

Objectives (``targets == IGNORE`` is not predicted):

- causal (gpt2, mixtral): G random windows of L+1 bytes; inputs = window[:-1], targets =
  window[1:];
- masked (bert): G random windows of L bytes; each position is masked with probability 0.15
  (replaced by ``mask_id``, one past the data's ids), targets = the original byte at masked positions, IGNORE elsewhere;
- stream (transformer-xl): the train tokens cut into G contiguous streams; step s reads segment
  ``s mod segments`` of every stream (inputs L bytes, targets the next L), so the recurrent
  memory carries the previous segment; ``starts_stream(step)`` says when it must be reset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixmoe.train.corpus import pydoc_topics_bytes
from mixmoe.train.presets import IGNORE, MASK_ID

MASK_PROB = 0.15
EVAL_FRACTION = 0.05


@dataclass(frozen=True)
class Batch:
    """One shard: ``inputs_BL`` and ``targets_BL`` (int64), and ``num_targets``, the number of
    predicted positions of the GLOBAL batch (the loss of a shard is its sum of cross
    entropies divided by it, so the shards' losses add up to the global-batch mean)."""

    inputs_BL: torch.Tensor
    targets_BL: torch.Tensor
    num_targets: int


def split_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, eval bytes): the last ``EVAL_FRACTION`` of the corpus is held out."""
    data = pydoc_topics_bytes()
    cut = int(data.numel() * (1.0 - EVAL_FRACTION))
    return data[:cut], data[cut:]


def _take(data, idx: torch.Tensor) -> torch.Tensor:
    """``data[idx]`` as int64 for a tensor or a numpy memmap (which reads only those ids)."""
    if isinstance(data, torch.Tensor):
        return data[idx]
    import numpy as np

    return torch.from_numpy(np.asarray(data[idx.numpy()]).astype(np.int64))


def _generator(seed: int, step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4 + salt)


def stream_segments(data: torch.Tensor, batch_size: int, seq_len: int) -> int:
    """How many segments of ``seq_len`` (+1 target byte) each of ``batch_size`` streams holds."""
    L = len(data) // batch_size
    n = (L - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"batch_size={batch_size} x seq_len={seq_len} does not fit a corpus of "
            f"{len(data)} tokens; use a smaller batch or sequence"
        )
    return n


def starts_stream(data: torch.Tensor, step: int, batch_size: int, seq_len: int) -> bool:
    """True when ``step`` reads the first segment of the streams (the memory starts over)."""
    return step % stream_segments(data, batch_size, seq_len) == 0


def global_batch(
    objective: str,
    data: torch.Tensor,
    step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    salt: int = 0,
    mask_id: int = MASK_ID,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [G, L], targets [G, L]) of ``step``; ``objective``: causal | masked | stream;
    ``salt`` tells random streams apart (train 0, eval 1); ``mask_id``: BERT's mask token."""
    if objective == "stream":
        length = len(data) // batch_size  # stream b is tokens b*length .. (b+1)*length - 1
        j = step % stream_segments(data, batch_size, seq_len)
        # segment j of every stream: seq_len inputs and the one more token the targets need
        idx = (torch.arange(batch_size) * length + j * seq_len)[:, None] + torch.arange(seq_len + 1)
        window = _take(data, idx)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
    span = seq_len + 1 if objective == "causal" else seq_len
    if len(data) <= span:
        raise ValueError(f"seq_len={seq_len} does not fit a corpus of {len(data)} tokens")
    gen = _generator(seed, step, salt)
    starts = torch.randint(0, len(data) - span + 1, (batch_size,), generator=gen)
    window = _take(data, starts[:, None] + torch.arange(span)[None, :])
    if objective == "causal":
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
    if objective != "masked":
        raise ValueError(f"objective {objective!r} is unknown; use causal, masked or stream")
    mask = torch.rand(window.shape, generator=gen) < MASK_PROB
    inputs = torch.where(mask, mask_id, window)
    targets = torch.where(mask, window, IGNORE)
    return inputs, targets


def shard(inputs_GL: torch.Tensor, targets_GL: torch.Tensor, index: int, count: int) -> Batch:
    """Shard ``index`` of ``count`` (contiguous rows) of a global batch."""
    G = inputs_GL.shape[0]
    if G % count:
        raise ValueError(f"a global batch of {G} rows does not split into {count} equal shards")
    b = G // count
    rows = slice(index * b, (index + 1) * b)
    num_targets = int((targets_GL != IGNORE).sum())
    return Batch(inputs_GL[rows], targets_GL[rows], max(num_targets, 1))
