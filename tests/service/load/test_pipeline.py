"""The pipelined loader: layer batches, bit-exact decoding against cuda_ext.load, CRC checks in
the reader, progress callbacks; on a GPU, the CUDA path and memory back to baseline."""
from __future__ import annotations

import gc
import itertools
import time
from pathlib import Path

import pytest
import torch

import cuda_ext
from codec.decode import Archive
from decoding import decode_whole
from codec.encode import compress_state_dict
from codec.errors import ChecksumError
from service.load.pipeline import decode_archive, layer_batches


def assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape, name
        assert torch.equal(ours[name].cpu().reshape(-1).view(torch.uint8), t.cpu().reshape(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(3000, 8, generator=g).bfloat16(),
             "model.layers.0.mlp.weight": torch.randn(70, 90, generator=g),
             "model.layers.0.ids": torch.arange(37, dtype=torch.int32),
             "model.layers.1.mlp.weight": (torch.randn(5000, generator=g) * 3).half(),
             "model.norm.weight": torch.ones(16, dtype=torch.bfloat16)}
    path = tmp_path_factory.mktemp("small") / "small.wcodec"
    compress_state_dict(state, path, workers=1)
    return path


def test_layer_batches_are_contiguous_ranges_in_file_order(demo_archive: Path) -> None:
    with Archive.open(demo_archive) as archive:
        entries = archive.entries
    batches = layer_batches(entries)
    assert len(batches) == 32                                 # embeddings, 30 layers, final norm
    assert [e for b in batches for e in b.entries] == entries
    assert all(len({e.layer for e in b.entries}) == 1 for b in batches)
    assert all(a.end <= b.start for a, b in itertools.pairwise(batches))
    assert all(b.start <= s["offset"] and s["offset"] + s["length"] <= b.end
               for b in batches for e in b.entries for s in e.streams.values())


@pytest.mark.parametrize("ring", [2, 3])
def test_cpu_pipeline_is_bit_exact(demo_archive: Path, ring: int) -> None:
    seen = []
    decoded = decode_archive(demo_archive, torch.device("cpu"), ring=ring,
                             on_batch=lambda batch, seconds: seen.append((batch, seconds)))
    assert_same(decoded.tensors, decode_whole(demo_archive))
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= set(decoded.files)
    s = decoded.stats
    assert len(seen) == s.batches == 32 and sum(b.decoded_bytes for b, _ in seen) == s.decoded_bytes == 269030016
    assert s.read_s > 0 and s.decode_s > 0 and s.h2d_s == 0 and s.total_s >= s.decode_s


def test_every_stream_kind(small: Path) -> None:
    assert_same(decode_archive(small, torch.device("cpu")).tensors, decode_whole(small))


def _flipped(small: Path, tmp_path: Path, role: str, at: int, bit: int) -> Path:
    """A copy of `small` with one bit of model.layers.1.mlp.weight's `role` stream flipped."""
    with Archive.open(small) as archive:
        rec = next(e for e in archive.entries if e.name == "model.layers.1.mlp.weight").streams[role]
    data = bytearray(small.read_bytes())
    data[rec["offset"] + at] ^= bit
    bad = tmp_path / "bad.wcodec"
    bad.write_bytes(bytes(data))
    return bad


def test_reader_checks_stream_crcs(small: Path, tmp_path: Path) -> None:
    bad = _flipped(small, tmp_path, "hi", 5, 0x40)
    with pytest.raises(ChecksumError, match="model.layers.1.mlp.weight"):
        decode_archive(bad, torch.device("cpu"))
    unchecked = decode_archive(bad, torch.device("cpu"), verify=False).tensors     # the hi plane is raw bits
    assert not torch.equal(unchecked["model.layers.1.mlp.weight"], decode_whole(small)[
        "model.layers.1.mlp.weight"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pipeline_is_bit_exact_and_frees_its_memory(demo_archive: Path) -> None:
    if not cuda_ext.available().cuda:
        pytest.skip(f"CUDA decoder unavailable: {cuda_ext.available().reason}")
    device = torch.device("cuda")
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(device)
    decoded = decode_archive(demo_archive, device)
    assert all(t.device.type == "cuda" for t in decoded.tensors.values())
    assert decoded.stats.h2d_s > 0
    assert torch.cuda.memory_allocated(device) - baseline >= decoded.stats.decoded_bytes
    assert_same(decoded.tensors, decode_whole(demo_archive))
    del decoded
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) == baseline


def _early(path: Path, verify: bool = True):
    from service.load.early_read import EarlyRead
    from service.timeline import Timeline
    return EarlyRead(str(path), verify=verify, threads=2, direct=None, timeline=Timeline())


def _freed(early, timeout: float = 10.0) -> bool:
    """Whether the early read's buffer is closed within `timeout` (a thread unmaps it)."""
    deadline = time.monotonic() + timeout
    while not early.buf.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    return early.buf.closed


def test_early_read_feeds_the_cpu_pipeline_bit_exact(small: Path) -> None:
    """... and no decoded tensor views the early buffer: they stay the same once it is freed."""
    early = _early(small)
    decoded = decode_archive(small, torch.device("cpu"), early=early)
    assert _freed(early)
    assert_same(decoded.tensors, decode_whole(small))


def test_early_read_frees_its_memory_after_the_load_unless_a_tensor_views_it(small: Path) -> None:
    """release() hands the unmapping to a thread (it took ~1 s of a 7B load): the buffer closes
    soon after; while an array still holds a view of it, it stays mapped and the bytes stay."""
    import numpy as np
    early = _early(small)
    early.wait_until(1 << 62)
    early.release()
    assert _freed(early)
    held = _early(small)
    held.wait_until(1 << 62)
    view = np.frombuffer(held.view, np.uint8)            # holds a buffer export, as numpy does
    before = view.copy()
    held.release()
    time.sleep(0.2)
    assert not held.buf.closed and np.array_equal(view, before) and before.any()


def test_early_read_of_another_file_is_not_used(small: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.wcodec"
    copy.write_bytes(small.read_bytes())
    early = _early(copy)
    copy.write_bytes(small.read_bytes())                 # replaced after the early read began
    assert not early.matches(str(copy)) and not early.matches(str(small))
    assert_same(decode_archive(small, torch.device("cpu"), early=early).tensors,
                decode_whole(small))


def test_early_read_checks_checksums(small: Path, tmp_path: Path) -> None:
    bad = _flipped(small, tmp_path, "exp", 3, 0x01)
    with pytest.raises(ChecksumError, match="model.layers.1.mlp.weight.*exp.*XXH3-64"):
        decode_archive(bad, torch.device("cpu"), early=_early(bad))


def test_reads_from_the_disk_with_o_direct(demo_archive: Path, tmp_path: Path) -> None:
    """The demo's pages dropped from the page cache: pieces are read with O_DIRECT, bit-exact."""
    import os
    copy = tmp_path / "cold.wcodec"
    copy.write_bytes(demo_archive.read_bytes())
    fd = os.open(copy, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    decoded = decode_archive(copy, torch.device("cpu"), direct=None)
    assert_same(decoded.tensors, decode_whole(demo_archive))


def test_the_pinned_ring_hands_out_buffers_of_other_sizes() -> None:
    """Buffers kept from loads of other sizes: a load takes the smallest that fit, by identity (a
    list.remove compared the tensors element by element and raised on a size mismatch)."""
    from service.load.ring import PinnedRing
    ring = PinnedRing()
    kept = [torch.zeros(n, dtype=torch.uint8) for n in (1974272, 1572864, 4096, 1572864)]
    ring.give(kept)
    taken = ring.take(2, 1500000)
    assert [b.numel() for b in taken] == [1572864, 1572864] and all(any(b is k for k in kept) for b in taken)
    assert sorted(b.numel() for b in ring._free) == [4096, 1974272]

