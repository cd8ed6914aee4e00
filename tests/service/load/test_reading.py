"""service/load/reading.py: pieces, O_DIRECT and page-cache reads, blobs verified as they complete."""
from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from codec.container import checksums
from codec.errors import ChecksumError, TruncatedFile
from service.load.reading import ALIGN, ArchiveFile, Blob, Blobs, align_down, align_up, pieces_of, read_range


def _evict(path: Path) -> None:
    """Drop this file's pages from the page cache (its own pages only), so reads go to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def blob_file(tmp_path: Path) -> tuple[Path, bytes, list[Blob]]:
    data = bytes((i * 7 + i // 4099) % 251 for i in range(300_000))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    cuts = [64, 100, 5000, 5000, 70_000, 150_001, 299_990]           # one empty blob, odd ends
    blobs = [Blob(a, b - a, {"offset": a, "length": b - a, **checksums(data[a:b])}, f"blob {i}")
             for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return path, data, blobs


def _read(path: Path, blobs: list[Blob], start: int, end: int, *, direct, piece: int, verify=True) -> bytes:
    base = align_down(start)
    buf = mmap.mmap(-1, align_up(end) - base)
    view = memoryview(buf)
    file = ArchiveFile(str(path), direct)
    checked = Blobs(str(path), blobs, verify)
    try:
        with ThreadPoolExecutor(3) as pool:
            for f in read_range(pool, file, view, base, start, end, checked, piece=piece):
                f.result()
        checked.wait_until(end)
        assert checked.complete
        return bytes(view[start - base:end - base])
    finally:
        file.close()
        view.release()
        buf.close()


def test_pieces_are_aligned_after_the_first() -> None:
    assert pieces_of(100, 3 * ALIGN + 5, ALIGN) == [(100, ALIGN), (ALIGN, 2 * ALIGN), (2 * ALIGN, 3 * ALIGN),
                                                     (3 * ALIGN, 3 * ALIGN + 5)]
    assert pieces_of(5, 5, ALIGN) == []


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("piece", [ALIGN, 3 * ALIGN, 1 << 20])
@pytest.mark.parametrize("cached", [True, False])
def test_reads_every_byte_and_verifies(blob_file, direct, piece: int, cached: bool) -> None:
    path, data, blobs = blob_file
    if not cached:
        _evict(path)
    assert _read(path, blobs, 64, 299_990, direct=direct, piece=piece) == data[64:299_990]


def test_direct_descriptor_is_opened_where_supported(blob_file) -> None:
    path, _, _ = blob_file
    file = ArchiveFile(str(path), None)
    try:
        assert file.direct == hasattr(os, "O_DIRECT")       # ext4/xfs: yes; tmpfs would refuse it
    finally:
        file.close()
    assert not ArchiveFile(str(path), False).direct


def test_read_cached_takes_page_cache_bytes_only(blob_file) -> None:
    """read_cached puts bytes where read() would: all of a file just written, and after an
    eviction the n bytes it reports and no others; never without O_DIRECT's probe. How many it
    finds after the eviction is the kernel's: RWF_NOWAIT's miss starts readahead (here, 5 of 300
    misses left the range's 48 pages cached just after), which a read can race, and file systems
    may keep pages despite fadvise (CI's once did). It asserted none, then no more than mincore
    showed held beforehand; each failed once with the whole range read (CI 2026-11-28, a clean
    CI run on the 2-core machine 2026-11-29)."""
    path, data, _ = blob_file
    buf = memoryview(bytearray(align_up(len(data))))
    file = ArchiveFile(str(path), None)
    try:
        if file.nowait:                                  # O_DIRECT here (ext4/xfs), RWF_NOWAIT probes
            n = file.read_cached(buf, 0, 4099, 200_001)
            assert n == 200_001 - 4099 and bytes(buf[4099:200_001]) == data[4099:200_001]
            _evict(path)
            buf[:] = bytes(len(buf))
            n = file.read_cached(buf, 0, 4099, 200_001)
            assert 0 <= n <= 200_001 - 4099 and bytes(buf[4099:4099 + n]) == data[4099:4099 + n]
            assert not any(buf[4099 + n:])                                  # nothing past what it reports
    finally:
        file.close()
    buffered = ArchiveFile(str(path), False)
    try:
        assert buffered.read_cached(buf, 0, 0, 1000) == 0               # buffered only: no probe
    finally:
        buffered.close()


def test_a_corrupt_blob_is_named(blob_file, tmp_path: Path) -> None:
    path, data, blobs = blob_file
    bad = bytearray(data)
    bad[80_000] ^= 1                                         # inside blob 4
    path.write_bytes(bytes(bad))
    with pytest.raises(ChecksumError, match="blob 4: stored stream fails its XXH3-64"):
        _read(path, blobs, 64, 299_990, direct=None, piece=ALIGN)
    assert _read(path, blobs, 64, 299_990, direct=None, piece=ALIGN, verify=False) == bytes(bad[64:299_990])


def test_a_short_file_is_truncated(blob_file) -> None:
    path, data, blobs = blob_file
    path.write_bytes(data[:200_000])
    with pytest.raises(TruncatedFile):
        _read(path, blobs, 64, 299_990, direct=None, piece=1 << 16)


def test_waiters_get_the_first_error(blob_file) -> None:
    path, _, blobs = blob_file
    checked = Blobs(str(path), blobs, True)
    checked.plan(pieces_of(64, 299_990, ALIGN))
    checked.fail(TruncatedFile(str(path), "gone"))
    with pytest.raises(TruncatedFile, match="gone"):
        checked.wait_until(100)


class _CountingFile:
    """An ArchiveFile stand-in that records each read's size and how many run at once; bytes
    before `cached_upto` are in its page cache (read_cached), the rest only on its disk (read)."""

    def __init__(self, data: bytes, cached_upto: int = 0):
        import threading
        import time
        self.data, self.sizes, self.most, self._now = data, [], 0, 0
        self.cached_upto, self.cached_sizes = cached_upto, []
        self._lock, self._sleep = threading.Lock(), time.sleep

    def read_cached(self, buf: memoryview, base: int, start: int, end: int) -> int:
        stop = min(end, self.cached_upto)
        if stop <= start:
            return 0
        with self._lock:
            self.cached_sizes.append(stop - start)
        buf[start - base:stop - base] = self.data[start:stop]
        return stop - start

    def read(self, buf: memoryview, base: int, start: int, end: int) -> None:
        with self._lock:
            self._now += 1
            self.most = max(self.most, self._now)
            self.sizes.append(end - start)
        self._sleep(0.02)                    # long enough that wide reads overlap on a busy machine
        buf[start - base:end - base] = self.data[start:end]
        with self._lock:
            self._now -= 1


def test_the_import_gate_keeps_start_up_reads_narrow_until_it_opens(blob_file) -> None:
    from service.load.early_read import ImportGate
    path, data, blobs = blob_file
    gate, file = ImportGate(narrow=2, chunk=8 * ALIGN), _CountingFile(data)
    buf = memoryview(bytearray(align_up(len(data))))
    with ThreadPoolExecutor(8) as pool:
        futures = read_range(pool, None, buf, 0, 0, len(data), Blobs(str(path), blobs, True),
                             lambda b, base, a, z: gate.read(file, b, base, a, z), piece=16 * ALIGN)
        for f in futures:
            f.result()
    assert bytes(buf[:len(data)]) == data
    assert file.most <= 2 and max(file.sizes) <= 8 * ALIGN                # narrow: 2 reads of a chunk at most
    gate.open()
    file.sizes, file.most = [], 0
    with ThreadPoolExecutor(8) as pool:
        for f in read_range(pool, None, buf, 0, 0, len(data), Blobs(str(path), blobs, True),
                            lambda b, base, a, z: gate.read(file, b, base, a, z), piece=16 * ALIGN):
            f.result()
    assert file.most > 2 and max(file.sizes) == 16 * ALIGN                # wide: whole pieces, side by side


def test_the_import_gate_takes_page_cached_bytes_whole(blob_file) -> None:
    """Bytes in the page cache are no disk request: while the gate is shut they are taken a
    whole piece at a time (still `narrow` at once); the bytes past them go to the disk narrow."""
    from service.load.early_read import ImportGate
    path, data, blobs = blob_file
    cached_upto = align_up(len(data) // 2) + 5 * ALIGN // 2                # mid-piece, not aligned
    gate, file = ImportGate(narrow=2, chunk=8 * ALIGN), _CountingFile(data, cached_upto)
    buf = memoryview(bytearray(align_up(len(data))))
    with ThreadPoolExecutor(8) as pool:
        for f in read_range(pool, None, buf, 0, 0, len(data), Blobs(str(path), blobs, True),
                            lambda b, base, a, z: gate.read(file, b, base, a, z), piece=16 * ALIGN):
            f.result()
    assert bytes(buf[:len(data)]) == data
    assert sum(file.cached_sizes) == cached_upto and max(file.cached_sizes) == 16 * ALIGN   # whole pieces
    assert sum(file.sizes) == len(data) - cached_upto                       # the disk reads only the rest,
    assert file.most <= 2 and max(file.sizes) <= 8 * ALIGN                 # narrow
