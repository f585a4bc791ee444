"""``--data``: UTF-8 text files (or a directory of them) byte-level, pre-tokenized uint16 /
uint32 ``.bin`` files through a memory map with ``--vocab-size`` (a ``train.bin`` + ``val.bin``
directory too); a fixed split; batches a function of (seed, step) only, so a resumed run
continues exactly; bad files are one clear ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _train_helpers import tiny
from torch.testing import assert_close

from mixmoe.train.data import global_batch
from mixmoe.train.loop import train
from mixmoe.train.sources import load_tokens


def test_text_directory_is_its_bytes_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("zweite Datei: ü " * 40)
    (tmp_path / "a.txt").write_text("first file, é " * 40)
    tok = load_tokens(tmp_path)
    whole = ("first file, é " * 40 + "\n\n" + "zweite Datei: ü " * 40).encode()
    got = torch.cat([tok.train, tok.eval])
    assert tok.vocab_size == 256 and got.tolist() == list(whole)
    assert len(tok.eval) == len(whole) - int(len(whole) * 0.95)
    a = global_batch("causal", tok.train, 7, 4, 16, seed=3)
    b = global_batch("causal", tok.train, 7, 4, 16, seed=3)
    c = global_batch("causal", tok.train, 8, 4, 16, seed=3)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    # each row is a window of the text: the targets are the inputs shifted by one
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])
    result = train(tiny(max_steps=2, data=str(tmp_path), seq_len=16))
    assert len(result.steps) == 2


def _bin(path, ids, dtype) -> None:
    np.asarray(ids, dtype=dtype).tofile(path)


def test_token_file_trains_resumes_exactly_and_reads_through_a_memmap(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=20_000)
    path = tmp_path / "tokens.bin"
    _bin(path, ids, np.uint16)
    tok = load_tokens(path, 1000)
    assert isinstance(tok.train, np.memmap) and tok.train.dtype == np.uint16
    assert len(tok.train) + len(tok.eval) == len(ids)
    inputs, targets = global_batch("stream", tok.train, 3, 4, 16, seed=0)
    length = len(tok.train) // 4  # stream 1, segment 3
    assert inputs[1].tolist() == ids[length + 48 : length + 64].tolist()
    assert targets[1].tolist() == ids[length + 49 : length + 65].tolist()
    kw = {"model": "transformer-xl", "data": str(path), "vocab_size": 1000, "seq_len": 16}
    full = train(tiny(max_steps=4, **kw))
    assert full.steps[0].loss == pytest.approx(np.log(1000), rel=0.05)  # 1000 ids, untrained
    train(tiny(max_steps=2, save_dir=str(tmp_path / "ck"), **kw))
    resumed = train(tiny(max_steps=4, save_dir=str(tmp_path / "ck"), resume="auto", **kw))
    assert resumed.start_step == 2
    assert_close(
        torch.tensor([s.loss for s in resumed.steps]),
        torch.tensor([s.loss for s in full.steps[2:]]),
        rtol=0,
        atol=0,
    )


def test_bert_masks_with_one_past_the_vocabulary_and_val_bin_is_the_eval_split(tmp_path):
    _bin(tmp_path / "train.bin", np.arange(5000) % 300, np.uint16)
    _bin(tmp_path / "val.bin", np.arange(900) % 7, np.uint16)
    tok = load_tokens(tmp_path, 300)
    assert len(tok.train) == 5000 and len(tok.eval) == 900
    inputs, targets = global_batch("masked", tok.train, 0, 8, 32, seed=0, mask_id=300)
    masked = targets != -100
    assert masked.any() and bool((inputs[masked] == 300).all())
    result = train(
        tiny(model="bert", max_steps=1, data=str(tmp_path), vocab_size=300, eval_every=1)
    )
    assert result.final_eval_loss is not None


def test_uint32_beyond_65536_ids(tmp_path):
    _bin(tmp_path / "big.bin", [70_000, 1, 69_999, 5] * 50, np.uint32)
    tok = load_tokens(tmp_path / "big.bin", 70_001)
    assert tok.train.dtype == np.uint32 and int(tok.train[0]) == 70_000


@pytest.mark.parametrize(
    "setup, vocab, match",
    [
        (lambda p: _bin(p / "t.bin", [5, 2000], np.uint16), 1000, "id 2000 >= --vocab-size 1000"),
        (lambda p: _bin(p / "t.bin", [5, 6], np.uint16), None, "give its --vocab-size"),
        (lambda p: (p / "t.bin").write_bytes(b"abc"), 1000, "not a whole number of uint16"),
        (lambda p: (p / "t.txt").write_bytes(b"ok \xff\xfe"), None, "is not UTF-8 text"),
        (lambda p: (p / "t.txt").write_text("text"), 1000, "is text"),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, setup, vocab, match):
    setup(tmp_path)
    name = "t.txt" if (tmp_path / "t.txt").exists() else "t.bin"
    with pytest.raises(ValueError, match=match):
        load_tokens(tmp_path / name, vocab)
