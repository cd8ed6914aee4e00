"""The read side of a load: an archive's layer batches read into a ring of host buffers.

* A batch is the consecutive entries of one layer (`layer_batches`). The archive is in layer
  order, so a batch's streams are one contiguous byte range [start, end), read (reading.py) in
  pieces by a pool of threads into one ring buffer: page-cache hits with a memcpy, the rest with
  O_DIRECT.
* The ring holds `ring` host buffers, each as large as the largest batch's aligned window
  (`ring_shape`); pinned only when the target is CUDA, and then kept for the process's later loads
  (`PINNED`). The reader blocks when no buffer is free: memory stays bounded.
* With an early read (early_read.py, or a host cache hit), batches come from that memory instead
  of the file: copied into a ring buffer, or used in place when there is no ring.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from codec.constants import CODEC_RAW
from codec.entries import TensorEntry
from cuda_ext import plans

from .early_read import EarlyRead
from .reading import ALIGN, ArchiveFile, Blob, Blobs, align_down, align_up, layer_window, read_range


@dataclass(frozen=True)
class Batch:
    entries: list[TensorEntry]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def decoded_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def codec(self) -> str:
        """The codec of most of the batch's decoded bytes (a metrics label)."""
        return max(self.entries, key=lambda e: e.nbytes).codec if self.entries else CODEC_RAW



def layer_batches(entries: list[TensorEntry]) -> list[Batch]:
    """Consecutive entries of one layer (None: embeddings before, final norm after) per batch."""
    return [Batch(group, *plans.stream_range(group)) for group in plans.layer_groups(entries)]


def ring_shape(ring: int, batches: list[Batch]) -> tuple[int, int]:
    """(buffers, bytes of each) of a CUDA load's ring: one copying and one decoding at least, each
    as large as the largest batch's aligned window."""
    return min(max(ring, 2), len(batches)) or 1, layer_window([e for b in batches for e in b.entries])


def blobs_of(batch: Batch) -> list[Blob]:
    return [Blob(rec["offset"], rec["length"], rec, f"tensor {e.name!r}: stream {role}")
            for e in batch.entries for role, rec in e.streams.items()]


def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """uint8 host memory starting on an ALIGN boundary (O_DIRECT reads into it)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


class PinnedRing:
    """The pinned ring buffers of CUDA loads, kept for the process's later loads: page-locking
    768 MiB took 0.11-0.75 s of every load into a running server (H100 box, 7B-shaped), a fifth of
    it. A load takes buffers at least as large as it needs (new ones when none is free: loads may
    run side by side) and gives them back when it ends."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, n: int, nbytes: int) -> list[torch.Tensor]:
        with self._lock:
            fits = sorted((b for b in self._free if b.numel() >= nbytes), key=torch.Tensor.numel)[:n]
            taken = {id(b) for b in fits}                  # by identity: == on tensors compares elements
            self._free = [b for b in self._free if id(b) not in taken]
        return fits + [aligned_buffer(nbytes, True) for _ in range(n - len(fits))]

    def reserve(self, n: int, nbytes: int) -> None:
        """Have `n` free buffers of at least `nbytes` ready before a load asks (start-up does this
        beside the decoder extension's import: page-locking 1 GiB takes ~1 s)."""
        self.give(self.take(n, nbytes))

    def give(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            self._free.extend(buffers)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


PINNED = PinnedRing()


def _window(batch: Batch) -> tuple[int, int]:
    return align_down(batch.start), align_up(batch.end)


class RingReader:
    """Reads batches into a ring of host buffers on its own thread, up to one batch per buffer in
    flight; `next()` hands them over in order, `release(index)` gives buffer `index` back. A read or
    checksum error is raised by `next()`. With `early` (the archive already in memory: `file` is
    then None), a batch is copied from there into a ring buffer or, given no buffers (the CPU, or
    page-locked memory), used in place (index None)."""

    def __init__(self, path: str, file: ArchiveFile | None, batches: list[Batch], buffers: list[torch.Tensor],
                 verify: bool, threads: int, early: EarlyRead | None = None):
        self.path, self.file, self.batches, self.buffers = path, file, batches, buffers
        self.verify, self.early = verify, early
        self.read_s = 0.0
        self._free: queue.Queue[int | None] = queue.Queue()
        self._filled: queue.Queue[tuple[Batch, int | None] | BaseException] = queue.Queue()
        for index in range(len(buffers)):
            self._free.put(index)
        self._thread = threading.Thread(target=self._run, name="wcodec-reader", daemon=True)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="wcodec-read")

    def __enter__(self) -> RingReader:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._free.put(None)               # wakes a reader waiting for a buffer: it stops
        self._thread.join()
        self._pool.shutdown(cancel_futures=True)

    def _copy_early(self, buf: memoryview, base: int, a: int, b: int) -> None:
        self.early.wait_until(b)
        src = np.frombuffer(self.early.view, np.uint8, b - a, a - self.early.base)
        np.copyto(np.frombuffer(buf, np.uint8, b - a, a - base), src)      # releases the GIL

    def _start(self, batch: Batch, index: int | None) -> tuple[float, list]:
        t0 = time.perf_counter()
        if index is None:                                 # early, no ring: used in place
            return t0, [self._pool.submit(self.early.wait_until, batch.end)]
        base, end = _window(batch)
        buf = memoryview(self.buffers[index].numpy())[:end - base]
        from_early = self.early is not None
        blobs = Blobs(self.path, blobs_of(batch), self.verify and not from_early)
        return t0, read_range(self._pool, self.file, buf, base, batch.start, batch.end, blobs,
                              self._copy_early if from_early else None)

    def _hand_over(self, item: tuple[Batch, int | None, float, list]) -> None:
        batch, index, t0, futures = item
        for f in futures:
            f.result()
        self.read_s += time.perf_counter() - t0
        self._filled.put((batch, index))

    def _free_buffer(self, inflight: collections.deque) -> int | None:
        if self.early is not None and not self.buffers:
            return -1
        while inflight:                                  # no free buffer: hand the oldest over first
            try:
                return self._free.get_nowait()
            except queue.Empty:
                self._hand_over(inflight.popleft())
        return self._free.get()

    def _run(self) -> None:
        inflight: collections.deque = collections.deque()
        try:
            for batch in self.batches:
                index = self._free_buffer(inflight)
                if index is None:
                    return
                index = None if index == -1 else index
                inflight.append((batch, index, *self._start(batch, index)))
            while inflight:
                self._hand_over(inflight.popleft())
        except BaseException as e:  # noqa: BLE001  (handed to the consumer, which raises it)
            self._filled.put(e)

    def next(self) -> tuple[Batch, int | None]:
        item = self._filled.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def host(self, batch: Batch, index: int | None) -> torch.Tensor:
        if index is None:
            return torch.frombuffer(self.early.view, dtype=torch.uint8, count=batch.nbytes,
                                    offset=batch.start - self.early.base)
        base = align_down(batch.start)
        return self.buffers[index][batch.start - base:batch.end - base]

    def release(self, index: int | None) -> None:
        if index is not None:
            self._free.put(index)
