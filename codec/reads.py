"""Reading a batch of tensors for the encoder: each tensor's bytes are read in chunks on several
threads (pread), into host buffers that are reused once nothing refers to them.

Read me first -- the traps:
- Fresh pages cost: a buffer from a fresh allocation faults in (and the kernel zeroes) each page
  on its first write. Reading 1 GiB from the page cache into fresh memory ran at 3.1 GB/s on this
  2-core machine against 5.2 GB/s into a buffer used before, and did not scale with a second
  thread (6.8 GB/s reused): the faults take the process's memory-map lock.
- A pooled buffer is handed out again only when the pool holds the last reference to it
  (sys.getrefcount): a payload still held anywhere (a record not yet written, a staged copy) is
  never overwritten. Correctness never depends on when the writer is done; only how much memory
  is reused does. Views keep their owner alive: numpy's `.base` and torch.from_numpy both do.
- The payloads come back in the order asked for; only the chunk reads run out of order.
- Pinned buffers (a CUDA coder's, cudaHostRegister): a buffer whose host-to-device copy is still
  queued could be refilled once its last reference is gone. The encoder drops a batch's payloads
  only after that batch is written, long after its copy (prepare_planes waits for the counts
  computed from it). A registered buffer is unregistered before it is freed, or a later
  allocation at its address could not be registered.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Self

import numpy as np

from .checkpoint import CheckpointSource
from .errors import SourceError

READ_THREADS = 4                # page-cache copies: ~3-6 GB/s a thread
CHUNK_BYTES = 16 << 20          # the unit of work of a reading thread
POOL_BYTES = 1 << 30            # host buffers kept for reuse (free or not), beyond which they are freed
POOLED_MIN_BYTES = 1 << 20      # smaller tensors (norms, biases) take fresh memory


def read_threads() -> int:
    return max(1, min(READ_THREADS, len(os.sched_getaffinity(0))))


class BufferPool:
    """Host byte buffers, reused once unreferenced. `pinner` (a CUDA coder's: pin(array) -> bool,
    unpin(array)) page-locks each pooled buffer, so that copies to and from the device run at full
    speed and asynchronously; each is unpinned before it is freed (eviction, close, the pool's end)."""

    def __init__(self, limit: int = POOL_BYTES, pinner=None):
        self.limit, self._pinner = limit, pinner
        self._owned: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._release = weakref.finalize(self, _unpin_all, self._owned, pinner)

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of `nbytes` (contents undefined)."""
        if nbytes < POOLED_MIN_BYTES:
            return np.empty(nbytes, np.uint8)
        with self._lock:
            owner = self._reuse(nbytes)
            if owner is None:
                owner = self._add(nbytes)
        return owner[:nbytes]

    def _reuse(self, nbytes: int) -> np.ndarray | None:
        """The smallest unreferenced owner of nbytes to 5/4 of that (a checkpoint repeats a few shapes,
        its coded streams vary a little in size)."""
        best = None
        for k in range(len(self._owned)):
            size = self._owned[k].nbytes
            if nbytes <= size <= nbytes + nbytes // 4 and (best is None or size < self._owned[best].nbytes) \
                    and sys.getrefcount(self._owned[k]) == 2:              # the list's, the call's
                best = k
        return None if best is None else self._owned[best]

    def _add(self, nbytes: int) -> np.ndarray:
        """A new owner, kept (and pinned) if it fits within the limit once free ones are evicted."""
        self._evict(nbytes)
        owner = np.empty(nbytes, np.uint8)
        if self._bytes() + nbytes <= self.limit and (self._pinner is None or self._pinner.pin(owner)):
            self._owned.append(owner)
        return owner

    def _evict(self, nbytes: int) -> None:
        """Free unreferenced owners until `nbytes` more fits within the limit."""
        for k in reversed(range(len(self._owned))):
            if self._bytes() + nbytes <= self.limit:
                return
            if sys.getrefcount(self._owned[k]) == 2:
                if self._pinner is not None:
                    self._pinner.unpin(self._owned[k])
                del self._owned[k]

    def _bytes(self) -> int:
        return sum(o.nbytes for o in self._owned)

    def close(self) -> None:
        """Unpin and drop every buffer (one still referenced stays valid, no longer pinned)."""
        with self._lock:
            self._release()


def _unpin_all(owned: list[np.ndarray], pinner) -> None:
    for owner in owned if pinner is not None else ():
        pinner.unpin(owner)
    owned.clear()


class BatchReader:
    """Reads the payloads of a batch of tensors from `source` on a pool of threads: a tensor whose
    bytes lie in a file (source.extent) is read by chunks into a pooled buffer; any other is
    `fallback(name)` on one thread."""

    def __init__(self, source: CheckpointSource, fallback: Callable[[str], object],
                 threads: int | None = None, pool: BufferPool | None = None):
        self.source, self.fallback = source, fallback
        self.pool = pool or BufferPool()
        self._threads = ThreadPoolExecutor(threads or read_threads())

    def read(self, names: list[str]) -> list:
        """The payloads of `names`, in that order."""
        pending = [self._start(name) for name in names]
        return [p.result() if isinstance(p, Future) else _finish(*p) for p in pending]

    def _start(self, name: str):
        extent = self.source.extent(name)
        if extent is None:
            return self._threads.submit(self.fallback, name)
        fd, offset, nbytes = extent
        buf = self.pool.take(nbytes)
        view = memoryview(buf)
        where = (self.source.path, name)
        chunks = [self._threads.submit(pread_full, fd, view[a:a + CHUNK_BYTES], offset + a, where)
                  for a in range(0, nbytes, CHUNK_BYTES)]
        return buf, chunks

    def close(self) -> None:
        self._threads.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _finish(buf: np.ndarray, chunks: list[Future]) -> np.ndarray:
    for c in chunks:
        c.result()
    return buf


def pread_full(fd: int, view: memoryview, offset: int, where: tuple) -> None:
    """Fill `view` from `fd` at `offset` (pread may return short); where = (path, tensor name)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            raise SourceError(where[0], f"tensor {where[1]!r}: file ends inside its data")
        got += n
