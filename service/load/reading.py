"""Archive bytes into memory at the disk's speed, every blob verified as its bytes arrive. Read me
first. No torch here: `wcodec serve` starts these reads before its heavy imports.

    file range [start, end)  ->  aligned window [floor(start), ceil(end)) of ALIGN-byte pages
    window                   ->  pieces of PIECE bytes, one pool task each (enough reads in flight)
    piece                    ->  preadv(RWF_NOWAIT): the part in the page cache, a memcpy
                                 + preadv on an O_DIRECT descriptor: the rest, from the disk,
                                   without a second copy through the page cache
    blob (stream)            ->  hashed (XXH3-64; the GIL is released) by the task that finished
                                 its last piece, so hashing overlaps the reads of other pieces

* O_DIRECT needs the buffer address, the file offset and the length to be ALIGN-aligned: a
  window's buffer starts on a page and maps file offset `base` (itself aligned) to its byte 0.
  Where O_DIRECT or RWF_NOWAIT is refused (tmpfs, some network file systems), plain preadv.
* `Blobs.wait_until(end)` returns once every blob lying before `end` is read and verified;
  blobs are in file order, so a consumer that takes layers in order waits for nothing else.
* The first error (a short file, a checksum) is kept and raised to every waiter.
"""
from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from codec import errors
from codec.container import checksum_fault

ALIGN = 4096                       # O_DIRECT granularity (and the page size)
PIECE = 8 << 20                    # bytes per read task


def identity(path: str) -> tuple[int, int, int, int]:
    """What tells a file from its replacement: (st_dev, st_ino, st_size, st_mtime_ns)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layer_window(records) -> int:
    """Bytes of a ring buffer (ring.ring_shape's) for an archive's tensor records in file order
    (header dicts or TensorEntry objects): the largest aligned window over one layer's streams."""
    get = (lambda r, k: r[k]) if records and isinstance(records[0], dict) else getattr
    size = 0
    for _, run in itertools.groupby(records, key=lambda r: get(r, "layer")):
        recs = [s for r in run for s in get(r, "streams").values()]
        if recs:
            start, end = min(s["offset"] for s in recs), max(s["offset"] + s["length"] for s in recs)
            size = max(size, align_up(end) - align_down(start))
    return size or ALIGN


class ArchiveFile:
    """An archive opened twice: buffered, and O_DIRECT where the file system allows (`direct`:
    None = where it helps, i.e. for bytes not in the page cache; False = never)."""

    def __init__(self, path: str, direct: bool | None = None):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise errors.CodecError(path, f"cannot open: {e.strerror or e}") from None
        self.direct_fd: int | None = None
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self.direct_fd = None
        self.nowait = self.direct_fd is not None and hasattr(os, "RWF_NOWAIT")

    @property
    def direct(self) -> bool:
        return self.direct_fd is not None

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None

    def _cached(self, view: memoryview, offset: int) -> int:
        """Bytes read from the page cache alone (0 when the first page is not cached)."""
        try:
            return os.preadv(self.fd, [view], offset, os.RWF_NOWAIT)
        except BlockingIOError:
            return 0
        except OSError:                       # RWF_NOWAIT unsupported here: read buffered
            self.nowait = False
            return 0

    def read_cached(self, buf: memoryview, base: int, start: int, end: int) -> int:
        """Bytes [start, start + n) put in buf as read() puts them, from the page cache alone: n
        (0 when the first page is not cached, or without O_DIRECT's RWF_NOWAIT probe)."""
        return self._cached(buf[start - base:end - base], start) if self.nowait else 0

    def read(self, buf: memoryview, base: int, start: int, end: int) -> None:
        """Fill buf[start - base : end - base] with file bytes [start, end). `buf` maps file
        offset `base` (aligned) to its byte 0 and extends to an aligned length."""
        pos = start
        if self.nowait:
            pos += self._cached(buf[pos - base:end - base], pos)
        while pos < end:
            if self.direct_fd is not None:
                lo, hi = align_down(pos), min(align_up(end), base + len(buf))
                try:
                    n = os.preadv(self.direct_fd, [buf[lo - base:hi - base]], lo)
                except OSError:                # EINVAL: this file system refuses O_DIRECT reads
                    self.direct_fd, self.nowait = None, False
                    continue
                got = lo + n
            else:
                got = pos + os.preadv(self.fd, [buf[pos - base:end - base]], pos)
            if got <= pos:
                raise errors.TruncatedFile(self.path, f"file ends before byte {end}")
            pos = got


@dataclass(frozen=True)
class Blob:
    offset: int
    length: int
    record: dict                   # the header record: offset, length, crc32, xxh3
    what: str                      # for errors: "tensor 'x': stream hi"

    @property
    def end(self) -> int:
        return self.offset + self.length


class Blobs:
    """Blobs of one byte range (file order), each verified once every piece covering it is read."""

    def __init__(self, path: str, blobs: list[Blob], verify: bool):
        self.path, self.blobs, self.verify = path, sorted(blobs, key=lambda b: b.offset), verify
        self._missing: list[int] = [0] * len(self.blobs)
        self._done = [False] * len(self.blobs)
        self._first_open = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def plan(self, pieces: list[tuple[int, int]]) -> list[list[int]]:
        """For each piece, the blobs it overlaps; counts each blob's pieces."""
        out, j = [], 0
        for a, b in pieces:
            while j < len(self.blobs) and self.blobs[j].end <= a:
                j += 1
            mine = []
            k = j
            while k < len(self.blobs) and self.blobs[k].offset < b:
                if self.blobs[k].end > a or self.blobs[k].length == 0:
                    mine.append(k)
                    self._missing[k] += 1
                k += 1
            out.append(mine)
        with self._cond:                       # blobs no piece covers (empty ones) are done
            for k, n in enumerate(self._missing):
                if n == 0:
                    self._done[k] = True
            self._advance()
        return out

    def piece_done(self, mine: list[int], buf: memoryview, base: int) -> None:
        with self._cond:
            ready = []
            for k in mine:
                self._missing[k] -= 1
                if self._missing[k] == 0:
                    ready.append(k)
        for k in ready:
            blob = self.blobs[k]
            fault = checksum_fault(buf[blob.offset - base:blob.end - base], blob.record) if self.verify else None
            if fault:
                raise errors.ChecksumError(self.path, f"{blob.what}: stored stream fails its {fault} checksum")
        with self._cond:
            for k in ready:
                self._done[k] = True
            self._advance()

    def _advance(self) -> None:
        while self._first_open < len(self.blobs) and self._done[self._first_open]:
            self._first_open += 1
        self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()

    def wait_until(self, end: int) -> None:
        """Block until every blob that starts before `end` is read and verified."""
        with self._cond:
            while self._error is None and self._first_open < len(self.blobs) \
                    and self.blobs[self._first_open].offset < end:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    @property
    def complete(self) -> bool:
        with self._cond:
            return self._error is None and self._first_open == len(self.blobs)


def pieces_of(start: int, end: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """[start, end) cut at multiples of `piece` (which is aligned), so pieces after the first are aligned."""
    cuts = [start, *range((start // piece + 1) * piece, end, piece), end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def read_range(pool: ThreadPoolExecutor, file: ArchiveFile | None, buf: memoryview, base: int, start: int,
               end: int, blobs: Blobs, fetch: Callable[[memoryview, int, int, int], None] | None = None,
               piece: int = PIECE) -> list[Future]:
    """Submit the reads of [start, end) into `buf` (mapping file offset `base`); each task marks
    its piece done in `blobs`, which verifies blobs as they complete. `fetch(buf, base, a, b)`
    replaces the file read (a copy from memory read earlier, or nothing when `buf` holds the
    bytes already); `file` is then unused."""
    fetch = fetch or file.read
    parts = pieces_of(start, end, piece)
    owners = blobs.plan(parts)

    def task(a: int, b: int, mine: list[int]) -> None:
        try:
            fetch(buf, base, a, b)
            blobs.piece_done(mine, buf, base)
        except BaseException as e:
            blobs.fail(e)
            raise
    return [pool.submit(task, a, b, mine) for (a, b), mine in zip(parts, owners)]
