"""Where ``mixmoe train`` takes its tokens from (``--data PATH``): the user's own data, with a
fixed train/eval split.

- nothing: the built-in byte-level pydoc corpus (``mixmoe.train.corpus``), vocabulary 256;
- a UTF-8 text file, or a directory of them (every regular file below it, in sorted path
  order, joined by a blank line): byte-level as the built-in corpus, vocabulary 256;
- a pre-tokenized file ``*.bin`` of little-endian uint16 ids (uint32 when ``vocab_size`` >
  65536: the nanoGPT convention), read through a read-only memory map, with ``vocab_size``;
  a directory holding ``train.bin`` (and ``val.bin``) the same way.

Split: the last ``EVAL_FRACTION`` of the tokens is held out, unless a ``val.bin`` is given.
The split is a function of the data only, so every rank and every resumed run sees the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mixmoe.train.corpus import BYTE_VOCAB
from mixmoe.train.data import EVAL_FRACTION, split_corpus

UINT16_VOCAB = 1 << 16
_CHECK_CHUNK = 1 << 24  # ids checked per read when a token file is opened


@dataclass(frozen=True)
class Tokens:
    """A train/eval split (1-D int64 tensors or uint16/uint32 memmaps) and the vocabulary."""

    train: object
    eval: object
    vocab_size: int


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ValueError(f"--data {path}: the directory holds no file")
    return files


def _read_text(path: Path) -> torch.Tensor:
    chunks = []
    for f in _text_files(path):
        raw = f.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--data: {f} is not UTF-8 text (byte {e.start}); pass text files, or a "
                "pre-tokenized .bin file with --vocab-size"
            ) from None
        chunks.append(raw)
    data = b"\n\n".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _memmap(path: Path, vocab_size: int):
    import numpy as np

    dtype = np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32
    size = path.stat().st_size
    if size == 0 or size % np.dtype(dtype).itemsize:
        raise ValueError(
            f"--data {path}: {size} bytes is not a whole number of {np.dtype(dtype).name} ids "
            f"(vocab_size {vocab_size}); check --vocab-size"
        )
    ids = np.memmap(path, dtype=dtype, mode="r")
    for lo in range(0, len(ids), _CHECK_CHUNK):  # an id past the vocabulary would index garbage
        top = int(ids[lo : lo + _CHECK_CHUNK].max())
        if top >= vocab_size:
            raise ValueError(
                f"--data {path} holds id {top} >= --vocab-size {vocab_size}; give the "
                "tokenizer's vocabulary size"
            )
    return ids


def _split(data) -> tuple[object, object]:
    cut = int(len(data) * (1.0 - EVAL_FRACTION))
    return data[:cut], data[cut:]


def load_tokens(path: str | os.PathLike[str] | None, vocab_size: int | None = None) -> Tokens:
    """The tokens ``--data path`` names (see the module docstring); ValueError naming the fix."""
    if path is None:
        if vocab_size not in (None, BYTE_VOCAB):
            raise ValueError("--vocab-size is for a pre-tokenized --data file; give --data PATH")
        return Tokens(*split_corpus(), BYTE_VOCAB)
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--data {p} does not exist; give a text file, a directory or a .bin")
    if p.is_dir() and (p / "train.bin").is_file():
        p_train, p_val = p / "train.bin", p / "val.bin"
    elif p.suffix == ".bin":
        p_train, p_val = p, None
    else:
        if vocab_size not in (None, BYTE_VOCAB):
            raise ValueError(
                f"--data {p} is text (byte-level, vocabulary {BYTE_VOCAB}); --vocab-size is "
                "for pre-tokenized .bin files"
            )
        return Tokens(*_split(_read_text(p)), BYTE_VOCAB)
    if vocab_size is None:
        raise ValueError(f"--data {p_train} is pre-tokenized; give its --vocab-size")
    train = _memmap(p_train, vocab_size)
    if p_val is not None and p_val.is_file():
        return Tokens(train, _memmap(p_val, vocab_size), vocab_size)
    return Tokens(*_split(train), vocab_size)
