"""Tests of codec.reads: chunked parallel reads give each tensor's exact bytes in the order asked,
buffers are reused only once unreferenced, a truncated shard is a SourceError."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from codec import reads
from codec.errors import SourceError
from codec.reads import BatchReader, BufferPool
from codec.sources import StateDictSource, open_source


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{k}": torch.randn(n, generator=g).bfloat16() for k, n in enumerate([0, 1, 3000, 70001, 5])}
    tensors["i"] = torch.arange(999, dtype=torch.int32)
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("threads", [1, 3])
def test_chunked_reads_are_exact_and_in_order(shard, monkeypatch, threads: int) -> None:
    monkeypatch.setattr(reads, "CHUNK_BYTES", 4096)           # many chunks per tensor, a short last one
    monkeypatch.setattr(reads, "POOLED_MIN_BYTES", 0)
    path, tensors = shard
    names = ["t3", "i", "t0", "t2", "t1", "t4", "t3"]
    with open_source(path) as src, BatchReader(src, src.load, threads) as reader:
        for _ in range(3):                                    # later rounds refill pooled buffers
            got = reader.read(names)
            for name, payload in zip(names, got):
                assert np.array_equal(payload, _raw(tensors[name])), name


def test_a_source_without_extents_uses_the_fallback() -> None:
    t = {"a": torch.arange(10, dtype=torch.int16), "b": torch.ones(3)}
    with StateDictSource(t) as src, BatchReader(src, lambda n: _raw(src.load(n))) as reader:
        a, b = reader.read(["a", "b"])
    assert np.array_equal(a, _raw(t["a"])) and np.array_equal(b, _raw(t["b"]))


def test_a_buffer_is_reused_only_once_unreferenced() -> None:
    pool = BufferPool(limit=1 << 30)
    n = reads.POOLED_MIN_BYTES
    first = pool.take(n)
    view = first[10:20]
    address = first.__array_interface__["data"][0]
    del first
    second = pool.take(n)                                     # `view` still refers to the first
    assert second.__array_interface__["data"][0] != address
    del view
    third = pool.take(n)
    assert third.__array_interface__["data"][0] == address
    held = torch.from_numpy(third)
    del third
    assert pool.take(n).__array_interface__["data"][0] != address      # a torch view holds it
    assert held.data_ptr() == address


def test_the_pool_stays_within_its_limit() -> None:
    n = reads.POOLED_MIN_BYTES
    pool = BufferPool(limit=2 * n)
    kept = [pool.take(n) for _ in range(4)]                   # beyond the limit: not pooled
    assert pool._bytes() == 2 * n
    del kept
    pool.take(2 * n)                                          # evicts the free ones to fit
    assert pool._bytes() == 2 * n


class _Pinner:
    def __init__(self, ok: bool = True):
        self.ok, self.pinned = ok, set()

    def pin(self, a: np.ndarray) -> bool:
        if self.ok:
            self.pinned.add(a.__array_interface__["data"][0])
        return self.ok

    def unpin(self, a: np.ndarray) -> None:
        self.pinned.remove(a.__array_interface__["data"][0])


def test_pooled_buffers_are_pinned_and_unpinned_before_they_are_freed() -> None:
    n, pinner = reads.POOLED_MIN_BYTES, _Pinner()
    pool = BufferPool(limit=2 * n, pinner=pinner)
    a, b = pool.take(n), pool.take(n)
    assert len(pinner.pinned) == 2
    del a
    c = pool.take(2 * n)                                      # evicts a's buffer, c is not pooled
    assert len(pinner.pinned) == 1 and c.nbytes == 2 * n
    pool.close()
    assert not pinner.pinned and b.nbytes == n                # b stays valid, unpinned
    refused = BufferPool(pinner=_Pinner(ok=False))
    refused.take(n)
    assert refused._bytes() == 0                              # not pinned: not pooled


def test_a_stream_reuses_a_slightly_larger_buffer() -> None:
    n = reads.POOLED_MIN_BYTES
    pool = BufferPool(limit=1 << 30)
    address = pool.take(n + n // 8).__array_interface__["data"][0]
    assert pool.take(n).__array_interface__["data"][0] == address
    assert pool.take(n // 2 + n).__array_interface__["data"][0] != address


def test_a_truncated_shard_is_a_source_error(shard) -> None:
    path, _ = shard
    with open_source(path) as src:
        _, offset, nbytes = src.extent("t3")
        os.truncate(path, offset + nbytes // 2)
        with BatchReader(src, src.load, 2) as reader, pytest.raises(SourceError, match="t3"):
            reader.read(["t3"])


def test_compress_reads_give_the_same_archive(shard, tmp_path: Path, monkeypatch) -> None:
    from codec.encode import compress
    path, _ = shard
    compress(path, tmp_path / "a.wcodec", workers=1)
    monkeypatch.setattr(reads, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(reads, "POOLED_MIN_BYTES", 0)
    compress(path, tmp_path / "b.wcodec", workers=1)
    assert (tmp_path / "a.wcodec").read_bytes() == (tmp_path / "b.wcodec").read_bytes()
