"""The benchmarks' cold counts (``placement.native_cache_lines``): the flush leaves the data as it
was, and without it every cache is evicted instead. (Whether lines left the cache is not
observable from a test; ``bench planner`` measures its effect.)"""

from __future__ import annotations

import pytest
import torch

from mixmoe.placement import native_cache_lines, native_lib
from mixmoe.placement.native_cache_lines import CacheEvictor, last_level_cache_bytes


def test_cache_size_read_from_sysfs(tmp_path) -> None:
    caches = (("index0", "1", "48K"), ("index2", "2", "1024K"), ("index3", "3", "32768K"))
    for index, level, size in caches:
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(level + "\n")
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    (tmp_path / "index4").mkdir()  # unreadable entries are skipped
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "absent") == 32 << 20


def test_the_flush_leaves_the_counts_as_they_were() -> None:
    counts = torch.arange(1000, dtype=torch.int64)
    evictor = CacheEvictor([counts, torch.empty(0, dtype=torch.int64)])
    assert evictor.how == "lines" and evictor.buffer is None  # built here (CI: g++)
    before = counts.clone()
    evictor.evict()
    assert torch.equal(counts, before)  # written back, never changed
    flush = native_lib.function(
        "mixmoe_flush_lines", native_lib.I64, [native_lib.P, native_lib.I64]
    )
    assert flush(counts.data_ptr() + 3, 70) == 0 and torch.equal(counts, before)  # unaligned span


def test_without_the_flush_every_cache_is_evicted(monkeypatch) -> None:
    monkeypatch.setattr(native_cache_lines.native_lib, "function", lambda *args: None)
    monkeypatch.setattr(native_cache_lines, "last_level_cache_bytes", lambda: 1 << 20)
    evictor = CacheEvictor([torch.ones(8, dtype=torch.int64)])
    assert evictor.how == "caches" and evictor.buffer.numel() * 8 == 2 << 20
    evictor.evict()
    assert int(evictor.buffer[0]) == 1


def test_strided_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        CacheEvictor([torch.ones(4, 4, dtype=torch.int64).t()])
