"""Disk -> device: the pipelined loader. Read me first.

    reader thread + pool          copy stream (CUDA)            compute stream (CUDA) / CPU
    read batch k+2 -> ring    ->  H2D batch k+1 (pinned, async)  ->  decode_plan(batch k)

* A batch is the consecutive entries of one layer. The archive is in layer order, so a batch's
  streams are one contiguous byte range [start, end), read (service/reading.py) in pieces by a
  pool of threads into one ring buffer: page-cache hits with a memcpy, the rest with O_DIRECT.
* Every stream is verified: on CUDA by its CRC32 on the GPU, beside its decode
  (service/devicecheck.py); elsewhere (XXH3-64 from format 1.1, else CRC32) by the pool thread
  that read its last piece, so checks overlap reads. Up to one batch per ring buffer is in flight.
* The ring holds `ring` host buffers, each as large as the largest batch's aligned window;
  pinned only when the target is CUDA. The reader blocks when no buffer is free: memory stays
  bounded. With an early read (service/prefetch.py: the archive read at process start, or held
  by the host cache, service/hostcache.py), batches come from that memory instead of the file:
  decoded in place on the CPU, and on CUDA copied from it straight to the device when it is
  page-locked (a host cache hit), else through the ring.
* On CUDA the copy of batch k+1 is queued on the copy stream before batch k is decoded on the
  compute stream (which waits on the copy's event), so read, H2D and decode overlap. A host
  buffer returns to the ring once its copy event has completed. On the CPU the decoder reads
  the ring buffer in place: the same pipeline without streams or copies.
* Decoded tensors are the final weights: the caller assigns them to a model built on `meta`.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import cuda_ext
from codec import errors
from codec.constants import CODEC_RAW
from codec.decode import Archive
from codec.entries import TensorEntry
from cuda_ext import plans

from . import devicecheck, resident
from .prefetch import EarlyRead
from .reading import ALIGN, ArchiveFile, Blob, Blobs, align_down, align_up, read_range

log = logging.getLogger("wcodec.service")


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


@dataclass
class LoadStats:
    read_s: float = 0.0            # reader thread: preadv + CRC32
    h2d_s: float = 0.0             # copy stream (CUDA events); 0 on the CPU
    decode_s: float = 0.0          # decode_plan, per batch, summed
    build_s: float = 0.0           # set by the model builder
    total_s: float = 0.0
    compressed_bytes: int = 0
    decoded_bytes: int = 0
    batches: int = 0
    source: str = "file"           # where the compressed bytes came from: file, early read, host cache

    def phases(self) -> dict[str, float]:
        return {"read": self.read_s, "h2d": self.h2d_s, "decode": self.decode_s, "build": self.build_s,
                "total": self.total_s}


@dataclass
class Decoded:
    tensors: dict[str, torch.Tensor]
    files: dict[str, bytes]
    stats: LoadStats = field(default_factory=LoadStats)
    layers: list[resident.CompressedLayer] = field(default_factory=list)   # compressed-resident mode


OnBatch = Callable[[Batch, float], None]


def layer_batches(entries: list[TensorEntry]) -> list[Batch]:
    """Consecutive entries of one layer (None: embeddings before, final norm after) per batch."""
    out = []
    for _, group in itertools.groupby(entries, key=lambda e: e.layer):
        batch = list(group)
        start, end = plans.stream_range(batch)
        out.append(Batch(batch, start, end))
    return out


def ring_shape(ring: int, batches: list[Batch]) -> tuple[int, int]:
    """(buffers, bytes of each) of a CUDA load's ring: one copying and one decoding at least, each
    as large as the largest batch's aligned window."""
    size = max((align_up(b.end) - align_down(b.start) for b in batches), default=ALIGN) or ALIGN
    return min(max(ring, 2), len(batches)) or 1, size


def _blobs(batch: Batch) -> list[Blob]:
    return [Blob(rec["offset"], rec["length"], rec, f"tensor {e.name!r}: stream {role}")
            for e in batch.entries for role, rec in e.streams.items()]


def _aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
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
            for b in fits:
                self._free.remove(b)
        return fits + [_aligned_buffer(nbytes, True) for _ in range(n - len(fits))]

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
    flight; `next()` hands them over in order, `release(slot)` gives a buffer back. A read or
    checksum error is raised by `next()`. With `early` (the archive already in memory: `file` is
    then None), a batch is copied from there into a ring buffer or, given no buffers (the CPU, or
    page-locked memory), used in place (slot None)."""

    def __init__(self, path: str, file: ArchiveFile | None, batches: list[Batch], buffers: list[torch.Tensor],
                 verify: bool, threads: int, early: EarlyRead | None = None):
        self.path, self.file, self.batches, self.buffers = path, file, batches, buffers
        self.verify, self.early = verify, early
        self.read_s = 0.0
        self._free: queue.Queue[int | None] = queue.Queue()
        self._filled: queue.Queue[tuple[Batch, int | None] | BaseException] = queue.Queue()
        for slot in range(len(buffers)):
            self._free.put(slot)
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

    def _start(self, batch: Batch, slot: int | None) -> tuple[float, list]:
        t0 = time.perf_counter()
        if slot is None:                                 # early, no ring: used in place
            return t0, [self._pool.submit(self.early.wait_until, batch.end)]
        base, end = _window(batch)
        buf = memoryview(self.buffers[slot].numpy())[:end - base]
        from_early = self.early is not None
        blobs = Blobs(self.path, _blobs(batch), self.verify and not from_early)
        return t0, read_range(self._pool, self.file, buf, base, batch.start, batch.end, blobs,
                              self._copy_early if from_early else None)

    def _hand_over(self, item: tuple[Batch, int | None, float, list]) -> None:
        batch, slot, t0, futures = item
        for f in futures:
            f.result()
        self.read_s += time.perf_counter() - t0
        self._filled.put((batch, slot))

    def _slot(self, inflight: collections.deque) -> int | None:
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
                slot = self._slot(inflight)
                if slot is None:
                    return
                slot = None if slot == -1 else slot
                inflight.append((batch, slot, *self._start(batch, slot)))
            while inflight:
                self._hand_over(inflight.popleft())
        except BaseException as e:  # noqa: BLE001  (handed to the consumer, which raises it)
            self._filled.put(e)

    def next(self) -> tuple[Batch, int | None]:
        item = self._filled.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def host(self, batch: Batch, slot: int | None) -> torch.Tensor:
        if slot is None:
            return torch.frombuffer(self.early.view, dtype=torch.uint8, count=batch.nbytes,
                                    offset=batch.start - self.early.base)
        base = align_down(batch.start)
        return self.buffers[slot][batch.start - base:batch.end - base]

    def release(self, slot: int | None) -> None:
        if slot is not None:
            self._free.put(slot)


DecodeFn = Callable[[Batch, torch.Tensor, str], dict[str, torch.Tensor]]


def _decode(batch: Batch, data: torch.Tensor, path: str) -> dict[str, torch.Tensor]:
    return cuda_ext.decode_plan(plans.build(batch.entries, path, batch.start, batch.end), data, path)


def _keeping(layers: list[resident.CompressedLayer]) -> DecodeFn:
    """Compressed-resident mode: a decoder layer's float tensors stay compressed (their bytes kept
    on the device, with the resident index); everything else, and every layer without such a
    tensor (GGUF blocks, int8, fp8), is decoded as usual."""
    def decode(batch: Batch, data: torch.Tensor, path: str) -> dict[str, torch.Tensor]:
        layer = batch.entries[0].layer
        if layer is None or not any(resident.stays_compressed(e) for e in batch.entries):
            return _decode(batch, data, path)
        kept = data.clone() if data.device.type == "cpu" else data       # the CPU ring buffer is reused
        compressed, raw = resident.keep_layer(layer, batch.entries, (batch.start, batch.end), kept, path)
        layers.append(compressed)
        return raw
    return decode


def _decode_cpu(reader: RingReader, path: str, on_batch: OnBatch, stats: LoadStats,
                decode: DecodeFn) -> dict[str, torch.Tensor]:
    tensors = {}
    for _ in reader.batches:
        batch, slot = reader.next()
        t0 = time.perf_counter()
        tensors.update(decode(batch, reader.host(batch, slot), path))
        seconds = time.perf_counter() - t0
        reader.release(slot)
        stats.decode_s += seconds
        on_batch(batch, seconds)
    return tensors


@dataclass
class _Staged:
    batch: Batch
    slot: int
    data: torch.Tensor             # the batch's bytes on the device
    copied: torch.cuda.Event
    started: torch.cuda.Event


def _stage(reader: RingReader, copy_stream: torch.cuda.Stream, device: torch.device) -> _Staged:
    batch, slot = reader.next()
    started, copied = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(copy_stream):
        data = torch.empty(batch.nbytes, dtype=torch.uint8, device=device)
        started.record(copy_stream)
        data.copy_(reader.host(batch, slot), non_blocking=True)
        copied.record(copy_stream)
    return _Staged(batch, slot, data, copied, started)


def _decode_staged(s: _Staged, reader: RingReader, compute: torch.cuda.Stream, path: str,
                   on_batch: OnBatch, stats: LoadStats, decode: DecodeFn, verify: bool) -> dict[str, torch.Tensor]:
    t0 = time.perf_counter()
    compute.wait_event(s.copied)
    with torch.cuda.stream(compute):
        s.data.record_stream(compute)      # allocated on the copy stream, read on this one
        checks = devicecheck.queue(_blobs(s.batch), s.data, s.batch.start, path) if verify else None
        try:
            out = decode(s.batch, s.data, path)
        except errors.CodecError:
            if checks is not None:         # bytes the decoder tripped over: a checksum failure first
                checks.raise_if_bad()
            raise
    s.copied.synchronize()
    reader.release(s.slot)                 # the host buffer is free once copied: the reader goes on
    compute.synchronize()
    if checks is not None:
        checks.raise_if_bad()
    seconds = time.perf_counter() - t0
    stats.h2d_s += s.started.elapsed_time(s.copied) / 1e3
    stats.decode_s += seconds
    on_batch(s.batch, seconds)
    return out


def _decode_cuda(reader: RingReader, path: str, device: torch.device, on_batch: OnBatch,
                 stats: LoadStats, decode: DecodeFn, verify: bool) -> dict[str, torch.Tensor]:
    copy_stream, compute = torch.cuda.Stream(device), torch.cuda.Stream(device)
    tensors: dict[str, torch.Tensor] = {}
    pending: _Staged | None = None
    try:
        for k in range(len(reader.batches) + 1):
            staged = _stage(reader, copy_stream, device) if k < len(reader.batches) else None
            if pending is not None:         # batch k-1 decodes while batch k copies
                tensors.update(_decode_staged(pending, reader, compute, path, on_batch, stats, decode, verify))
            pending = staged
    finally:                                # no copy still reads host memory once this returns or raises
        copy_stream.synchronize()
    return tensors


@functools.lru_cache(maxsize=1)
def note_gpudirect() -> bool:
    """Say once in the log whether GPUDirect Storage (kvikio) could read straight into GPU memory.
    This loader reads through pinned host memory either way (kvikio is not used yet)."""
    present = importlib.util.find_spec("kvikio") is not None
    log.info("GPUDirect Storage: kvikio %s; archives are read through pinned host memory",
             "is installed but not used by this loader yet" if present else "is absent")
    return present


def read_threads() -> int:
    return min(16, 2 * (os.cpu_count() or 1))


def decode_archive(path: str | Path, device: torch.device, *, ring: int = 4, verify: bool = True,
                   on_batch: OnBatch | None = None, opened: tuple[list[TensorEntry], dict] | None = None,
                   mark: Callable[[str], None] = lambda what: None, early: EarlyRead | None = None,
                   direct: bool | None = None, threads: int | None = None, compressed: bool = False) -> Decoded:
    """Every tensor of an archive, decoded onto `device` through the pipeline above. `opened`:
    its (entries, embedded files) when the caller has read them already; `early`: the archive's
    bytes in memory, read at start-up or held by the host cache (used only if it is of this very
    file; released at the end); `direct`: False never uses O_DIRECT, None uses it for bytes not in
    the page cache. `compressed`: keep the decoder layers' float tensors compressed on the device
    (Decoded.layers; service/resident.py)."""
    t0 = time.perf_counter()
    path = os.fspath(path)
    if device.type == "cuda":
        note_gpudirect()
    if opened is None:
        with Archive.open(path) as archive:
            opened = archive.entries, archive.reader.files(verify)
    entries, files = opened
    batches = layer_batches(entries)
    early = early if early is not None and early.matches(path) else None
    in_place = early is not None and (device.type == "cpu" or early.pinned)
    on_host = devicecheck.on_host(device, verify)          # else on the GPU, beside the decode
    n_buffers, size = ring_shape(ring, batches)
    n_buffers = 0 if in_place else n_buffers
    pin = device.type == "cuda"
    buffers = PINNED.take(n_buffers, size) if pin else [_aligned_buffer(size, pin) for _ in range(n_buffers)]
    mark(f"{n_buffers} ring buffers of {size >> 20} MiB allocated (pinned: {pin}; early read: {early is not None}; "
         f"in place: {in_place}; streams verified: {'on the host' if on_host else 'on the GPU' if verify else 'no'})")
    stats = LoadStats(compressed_bytes=sum(b.nbytes for b in batches),
                      decoded_bytes=sum(b.decoded_bytes for b in batches), batches=len(batches),
                      source="file" if early is None else "early read")
    on_batch = on_batch or (lambda batch, seconds: None)
    layers: list[resident.CompressedLayer] = []
    decode = _keeping(layers) if compressed else _decode
    file = ArchiveFile(path, direct) if early is None else None
    try:
        with RingReader(path, file, batches, buffers, on_host, threads or read_threads(), early) as reader:
            if device.type == "cuda":
                tensors = _decode_cuda(reader, path, device, on_batch, stats, decode, verify and not on_host)
            else:
                tensors = _decode_cpu(reader, path, on_batch, stats, decode)
    finally:
        if file is not None:
            file.close()
        if early is not None:
            early.release()
        if pin:
            PINNED.give(buffers)
    stats.read_s, stats.total_s = reader.read_s, time.perf_counter() - t0
    mark(f"{len(batches)} batches decoded")
    return Decoded(tensors, files, stats, layers)
