"""Training data of ``mixmoe train``: the byte-level ``pydoc_data`` corpus, split deterministically
into train and eval, global batches that are a function of (seed, step) only, and shards.

Legend: G rows of the global batch, B rows of one shard, L sequence length.

Every rank builds the SAME global batch for a step (the corpus is ~0.5 MB, so this costs
nothing) and keeps its contiguous shard: shard ``i`` of ``S`` is rows ``i*G/S .. (i+1)*G/S - 1``.
With ``S = world_size * micro_batches`` and shard ``rank * micro_batches + m``, the union over
ranks and micro-batches is exactly the global batch a 1-rank run sees, and a 1-rank run with
``micro_batches = W`` processes the very shards W ranks process. The data position of a run is
its step number (a checkpoint stores it).

Objectives (``targets == IGNORE`` is not predicted):

- causal (gpt2, mixtral): G random windows of L+1 bytes; inputs = window[:-1], targets =
  window[1:];
- masked (bert): G random windows of L bytes; each position is masked with probability 0.15
  (replaced by ``MASK_ID``), targets = the original byte at masked positions, IGNORE elsewhere;
- stream (transformer-xl): the train bytes cut into G contiguous streams; step s reads segment
  ``s mod segments`` of every stream (inputs L bytes, targets the next L), so the recurrent
  memory carries the previous segment; ``starts_stream(step)`` says when it must be reset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixmoe.train.corpus import byte_streams, pydoc_topics_bytes
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


def _generator(seed: int, step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4 + salt)


def stream_segments(data: torch.Tensor, batch_size: int, seq_len: int) -> int:
    """How many segments of ``seq_len`` (+1 target byte) each of ``batch_size`` streams holds."""
    L = data.numel() // batch_size
    n = (L - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"batch_size={batch_size} x seq_len={seq_len} does not fit a corpus of "
            f"{data.numel()} bytes; use a smaller batch or sequence"
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [G, L], targets [G, L]) of ``step``; ``objective``: causal | masked | stream;
    ``salt`` tells random streams apart (train 0, eval 1)."""
    if objective == "stream":
        streams = byte_streams(data, batch_size)
        j = step % stream_segments(data, batch_size, seq_len)
        window = streams[:, j * seq_len : (j + 1) * seq_len + 1]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
    span = seq_len + 1 if objective == "causal" else seq_len
    if data.numel() <= span:
        raise ValueError(f"seq_len={seq_len} does not fit a corpus of {data.numel()} bytes")
    gen = _generator(seed, step, salt)
    starts = torch.randint(0, data.numel() - span + 1, (batch_size,), generator=gen)
    window = data[starts[:, None] + torch.arange(span)[None, :]]
    if objective == "causal":
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
    if objective != "masked":
        raise ValueError(f"objective {objective!r} is unknown; use causal, masked or stream")
    mask = torch.rand(window.shape, generator=gen) < MASK_PROB
    inputs = torch.where(mask, MASK_ID, window)
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
