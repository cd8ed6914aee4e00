"""Early reads: a preloaded model's archive read into memory (and verified) from the first instant
of `wcodec serve`, while Python imports torch and the service and CUDA starts. No torch here.

The load that follows (service/load/pipeline.py) takes its layers from this memory as they arrive
instead of from the file; if the file changed since, or anything here failed, it reads the file
itself (a bad archive then fails the load with the same typed error). An archive larger than
half the available memory is not read early. The host cache (hostcache.py) keeps such
reads after their load (`kept`) and verifies them again from memory for the next (`recheck`)."""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

from codec.container import Reader
from codec.errors import CodecError

from ..timeline import Timeline
from .memory import available_memory, unmap
from .names import DEMO_NAME, SUFFIX, valid_name
from .reading import ArchiveFile, Blob, Blobs, align_down, align_up, identity, layer_window, read_range

log = logging.getLogger("wcodec.service")


RECHECK_PIECE = 64 << 20           # a recheck's tasks: nothing to read, so few and large (1/8 as many
                                   # Python tasks as a read's: 8 MiB ones cost a 7B switch ~0.2 s of GIL)


def _in_memory(buf: memoryview, base: int, a: int, b: int) -> None:
    """A piece's fetch when its bytes are in memory already: nothing to read, only to verify."""


def _blobs(reader: Reader) -> list[Blob]:
    out = []
    for t in reader.header["tensors"]:
        for role, rec in t["streams"].items():
            what = f"tensor {t['name']!r}: stream {role}"
            reader.stream(rec, what)                # bounds-checked: HeaderError otherwise
            out.append(Blob(rec["offset"], rec["length"], rec, what))
    return out


class ImportGate:
    """Keeps a start-up read's disk requests few and small while Python imports, then lets them
    run wide. The imports read hundreds of small files one after another, and on a disk without an
    I/O scheduler (`none`, as on the lent GPU boxes) each of those reads queues behind every byte
    the archive's read has in flight: 16 reads of 8 MiB made `import torch` take 15 s instead of
    ~5 s with the page cache dropped. Narrow: `narrow` requests of `chunk` bytes at most. (2 of
    1 MiB on an H100 box: `import torch` 7.4 s, but the archive crawled at ~0.2 GB/s meanwhile,
    each request waiting for the GIL that the imports hold: wcodec serve shortens the switch
    interval until the gate opens.) Bytes already in the page cache are no disk request: they are
    taken whole (a piece, ~8 MiB), so a warm start's read waits for the GIL a quarter as often
    (H200, 7B-shaped: 9 GB in 2 MiB requests ran at 1.6 GB/s beside the imports and ended after
    them)."""

    def __init__(self, narrow: int = 4, chunk: int = 2 << 20):
        self.chunk = chunk
        self._requests = threading.Semaphore(narrow)
        self._wide = threading.Event()

    def open(self) -> None:
        """The imports are done: every read goes at once, whole."""
        self._wide.set()

    def read(self, file: ArchiveFile, buf: memoryview, base: int, start: int, end: int) -> None:
        pos = start
        while pos < end and not self._wide.is_set():
            with self._requests:
                cached = file.read_cached(buf, base, pos, end)        # no disk request: whole
                step = pos + cached if cached else min(end, align_down(pos + self.chunk) or end)
                if not cached:
                    file.read(buf, base, pos, step)
            pos = step
        if pos < end:
            file.read(buf, base, pos, end)


class EarlyRead:
    """The data region of one archive, read by `threads` tasks into anonymous memory. `kept`: the
    host cache owns the memory (release() then leaves it mapped); `pinned`: it is page-locked, so
    a CUDA load copies from it in place, without a ring (set by the host cache). `gate`: reads
    kept narrow until it opens (start-up, while Python imports)."""

    def __init__(self, path: str, *, verify: bool, threads: int, direct: bool | None, timeline: Timeline,
                 gate: ImportGate | None = None):
        self.path, self.identity, self.timeline = path, identity(path), timeline
        with Reader.open(path) as reader:
            self.start, self.end = start, end = reader.preamble.data_offset, reader.preamble.header_offset
            self.blobs = Blobs(path, _blobs(reader), verify)
            self.window = layer_window(reader.header["tensors"])       # a CUDA load's ring buffer (early_pin.py)
        self.base = align_down(start)
        self.nbytes = end - start
        self.buf = mmap.mmap(-1, max(align_up(end) - self.base, 1))
        self.view = memoryview(self.buf)
        self.kept, self.pinned, self._freed = False, False, False
        self._rechecks: list[Future] = []
        self.file: ArchiveFile | None = ArchiveFile(path, direct)
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(threads, thread_name_prefix="wcodec-early")
        self._left, self._lock = 0, threading.Lock()
        self._t0 = time.perf_counter()
        fetch = partial(gate.read, self.file) if gate is not None else None
        futures = read_range(self.pool, self.file, self.view, self.base, start, end, self.blobs, fetch)
        self._left = len(futures)
        for f in futures:
            f.add_done_callback(self._piece_finished)
        timeline.mark(f"early read {os.path.basename(path)}: {self.nbytes / 1e6:.0f} MB, {len(futures)} pieces, "
                      f"O_DIRECT {'available' if self.file.direct else 'unavailable'}")

    def _piece_finished(self, _) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            seconds = time.perf_counter() - self._t0
            self.timeline.mark(f"early read {os.path.basename(self.path)}: done, "
                               f"{self.nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s")

    @property
    def mapped_bytes(self) -> int:
        return len(self.buf)

    def matches(self, path: str) -> bool:
        """Whether this read is of the file now at `path` (same device, inode, size and mtime)."""
        try:
            return os.path.abspath(path) == os.path.abspath(self.path) and identity(path) == self.identity
        except OSError:
            return False

    def wait_until(self, end: int) -> None:
        self.blobs.wait_until(end)

    def recheck(self, verify: bool, pool: ThreadPoolExecutor) -> None:
        """Verify every stream again from memory (a host cache hit): the same blobs as the read,
        in few large tasks on the cache's long-lived `pool` (making 16 threads a load cost a 7B
        switch ~0.2 s of GIL handoffs beside the model skeleton's build), so `wait_until` paces a
        load as the read did."""
        self.blobs = Blobs(self.path, self.blobs.blobs, verify)
        self._rechecks = read_range(pool, None, self.view, self.base, self.start, self.end, self.blobs, _in_memory,
                                    piece=RECHECK_PIECE)

    def release(self) -> None:
        """The load is done with it: stop its tasks; free the memory unless the host cache keeps it."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        for f in self._rechecks:                   # the pool is the cache's: cancel ours, wait for the rest
            f.cancel()
        wait(self._rechecks)
        self._rechecks = []
        if self.file is not None:
            self.file.close()
            self.file = None
        if not self.kept:
            self.free()

    def free(self) -> None:
        """Give the memory back, off the caller's path: unmapping 9 GB of touched pages took 0.8-1.1 s
        of the load that called this (H100 box, 7B-shaped; bench/experiments/probe_load.py)."""
        if self._freed:
            return
        self._freed = True
        try:
            self.view.release()
        except BufferError:                        # an array still views it: it goes with that array
            return
        threading.Thread(target=unmap, args=(self.buf,), name="wcodec-early-free", daemon=True).start()


def start_early_reads(paths: dict[str, str], *, verify: bool, threads: int, direct: bool | None,
                      timeline: Timeline, gate: ImportGate | None = None) -> dict[str, EarlyRead]:
    """Start reading each model's archive; models that cannot be read early are left out."""
    out, budget = {}, available_memory() // 2
    for name, path in paths.items():
        try:
            size = os.path.getsize(path)
            if size > budget:
                log.info("early read of %s skipped: %d bytes exceed half the available memory", name, size)
                continue
            out[name] = EarlyRead(path, verify=verify, threads=threads, direct=direct, timeline=timeline, gate=gate)
            budget -= size
        except (OSError, CodecError, LookupError, TypeError, AttributeError) as e:
            log.info("early read of %s skipped: %s", name, e)     # the load reports it, typed
    return out


def preload_paths(settings) -> dict[str, str]:
    """{name: path} of the archives `settings` preloads that exist now: WCODEC_PRELOAD, else the
    demo model when it is in the store. Invalid or absent names are left to the load to report."""
    names = settings.preload if settings.preload is not None else ([DEMO_NAME] if settings.demo else [])
    paths = {name: os.path.join(settings.model_store, name + SUFFIX) for name in names if valid_name(name)}
    return {name: path for name, path in paths.items() if os.path.isfile(path)}
