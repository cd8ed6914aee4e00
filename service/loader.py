"""Disk -> device: the pipelined loader. Read me first.

    reader thread                 copy stream (CUDA)            compute stream (CUDA) / CPU
    preadv batch k+2 -> ring  ->  H2D batch k+1 (pinned, async)  ->  decode_plan(batch k)

* A batch is the consecutive entries of one layer. The archive is in layer order, so a batch's
  streams are one contiguous byte range [start, end): one `preadv` into one ring buffer.
* The ring holds `ring` host buffers, each as large as the largest batch; pinned only when
  the target is CUDA. The reader verifies every stream's CRC32 in its own thread (zlib.crc32
  releases the GIL) and blocks when no buffer is free: memory stays bounded.
* On CUDA the copy of batch k+1 is queued on the copy stream before batch k is decoded on the
  compute stream (which waits on the copy's event), so read, H2D and decode overlap. A host
  buffer returns to the ring once its copy event has completed. On the CPU the decoder reads
  the ring buffer in place: the same pipeline without streams or copies.
* Decoded tensors are the final weights: the caller assigns them to a model built on `meta`.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

import cuda_ext
from codec import errors
from codec.constants import CODEC_RAW
from codec.decode import Archive
from codec.entries import TensorEntry
from cuda_ext import plans


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

    def phases(self) -> dict[str, float]:
        return {"read": self.read_s, "h2d": self.h2d_s, "decode": self.decode_s, "build": self.build_s,
                "total": self.total_s}


@dataclass
class Decoded:
    tensors: dict[str, torch.Tensor]
    files: dict[str, bytes]
    stats: LoadStats = field(default_factory=LoadStats)


OnBatch = Callable[[Batch, float], None]


def layer_batches(entries: list[TensorEntry]) -> list[Batch]:
    """Consecutive entries of one layer (None: embeddings before, final norm after) per batch."""
    out = []
    for _, group in itertools.groupby(entries, key=lambda e: e.layer):
        batch = list(group)
        start, end = plans.stream_range(batch)
        out.append(Batch(batch, start, end))
    return out


READ_PIECE = 16 << 20              # a batch is read (and CRC-checked) in pieces by a thread pool


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise errors.TruncatedFile(path, f"file ends before byte {offset + len(view)}")
        done += n


def _pread_parallel(pool: ThreadPoolExecutor, fd: int, view: memoryview, offset: int, path: str) -> None:
    """preadv releases the GIL: page-cache copies scale with threads."""
    pieces = [pool.submit(_pread_into, fd, view[i:i + READ_PIECE], offset + i, path)
              for i in range(0, len(view), READ_PIECE)]
    for piece in pieces:
        piece.result()


def _check_crcs(pool: ThreadPoolExecutor, batch: Batch, view: memoryview, path: str) -> None:
    """zlib.crc32 releases the GIL too: every stream of the batch is checked in parallel."""
    checks = [(e, role, rec, pool.submit(zlib.crc32, view[rec["offset"] - batch.start:
                                                       rec["offset"] - batch.start + rec["length"]]))
              for e in batch.entries for role, rec in e.streams.items()]
    for e, role, rec, crc in checks:
        if crc.result() & 0xFFFFFFFF != rec["crc32"]:
            raise errors.ChecksumError(path, f"tensor {e.name!r}: stored stream {role} fails its CRC32")


class RingReader:
    """Reads batches into a ring of host buffers on its own thread; `next()` hands them over in
    order, `release(slot)` gives a buffer back. A read error is raised by `next()`."""

    def __init__(self, path: str, batches: list[Batch], buffers: list[torch.Tensor], verify: bool):
        self.path, self.batches, self.buffers, self.verify = path, batches, buffers, verify
        self.read_s = 0.0
        self._free: queue.Queue[int | None] = queue.Queue()
        self._filled: queue.Queue[tuple[Batch, int] | BaseException] = queue.Queue()
        for slot in range(len(buffers)):
            self._free.put(slot)
        self._thread = threading.Thread(target=self._run, name="wcodec-reader", daemon=True)
        self._pool = ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="wcodec-read")

    def __enter__(self) -> RingReader:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._free.put(None)               # wakes a reader waiting for a buffer: it stops
        self._thread.join()
        self._pool.shutdown()

    def _run(self) -> None:
        try:
            with open(self.path, "rb", buffering=0) as f:
                for batch in self.batches:
                    slot = self._free.get()
                    if slot is None:
                        return
                    t0 = time.perf_counter()
                    view = memoryview(self.buffers[slot].numpy()[:batch.nbytes])
                    _pread_parallel(self._pool, f.fileno(), view, batch.start, self.path)
                    if self.verify:
                        _check_crcs(self._pool, batch, view, self.path)
                    self.read_s += time.perf_counter() - t0
                    self._filled.put((batch, slot))
        except BaseException as e:  # noqa: BLE001  (handed to the consumer, which raises it)
            self._filled.put(e)

    def next(self) -> tuple[Batch, int]:
        item = self._filled.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def host(self, batch: Batch, slot: int) -> torch.Tensor:
        return self.buffers[slot][:batch.nbytes]

    def release(self, slot: int) -> None:
        self._free.put(slot)


def _decode(batch: Batch, data: torch.Tensor, path: str) -> dict[str, torch.Tensor]:
    return cuda_ext.decode_plan(plans.build(batch.entries, path, batch.start, batch.end), data, path)


def _decode_cpu(reader: RingReader, path: str, on_batch: OnBatch, stats: LoadStats) -> dict[str, torch.Tensor]:
    tensors = {}
    for _ in reader.batches:
        batch, slot = reader.next()
        t0 = time.perf_counter()
        tensors.update(_decode(batch, reader.host(batch, slot), path))
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
                   on_batch: OnBatch, stats: LoadStats) -> dict[str, torch.Tensor]:
    t0 = time.perf_counter()
    compute.wait_event(s.copied)
    with torch.cuda.stream(compute):
        s.data.record_stream(compute)      # allocated on the copy stream, read on this one
        out = _decode(s.batch, s.data, path)
    compute.synchronize()
    seconds = time.perf_counter() - t0
    stats.h2d_s += s.started.elapsed_time(s.copied) / 1e3
    stats.decode_s += seconds
    reader.release(s.slot)
    on_batch(s.batch, seconds)
    return out


def _decode_cuda(reader: RingReader, path: str, device: torch.device, on_batch: OnBatch,
                 stats: LoadStats) -> dict[str, torch.Tensor]:
    copy_stream, compute = torch.cuda.Stream(device), torch.cuda.Stream(device)
    tensors: dict[str, torch.Tensor] = {}
    pending: _Staged | None = None
    for k in range(len(reader.batches) + 1):
        staged = _stage(reader, copy_stream, device) if k < len(reader.batches) else None
        if pending is not None:             # batch k-1 decodes while batch k copies
            tensors.update(_decode_staged(pending, reader, compute, path, on_batch, stats))
        pending = staged
    return tensors


def decode_archive(path: str | Path, device: torch.device, *, ring: int = 3, verify: bool = True,
                   on_batch: OnBatch | None = None, opened: tuple[list[TensorEntry], dict] | None = None,
                   mark: Callable[[str], None] = lambda what: None) -> Decoded:
    """Every tensor of an archive, decoded onto `device` through the pipeline above. `opened`:
    its (entries, embedded files) when the caller has read them already."""
    t0 = time.perf_counter()
    path = os.fspath(path)
    if opened is None:
        with Archive.open(path) as archive:
            opened = archive.entries, archive.reader.files(verify)
    entries, files = opened
    batches = layer_batches(entries)
    size = max((b.nbytes for b in batches), default=1) or 1
    pin = device.type == "cuda"
    n_buffers = min(max(ring, 2), len(batches)) or 1        # CUDA holds two: one copying, one decoding
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(n_buffers)]
    mark(f"{n_buffers} ring buffers of {size >> 20} MiB allocated (pinned: {pin})")
    stats = LoadStats(compressed_bytes=sum(b.nbytes for b in batches),
                      decoded_bytes=sum(b.decoded_bytes for b in batches), batches=len(batches))
    on_batch = on_batch or (lambda batch, seconds: None)
    with RingReader(path, batches, buffers, verify) as reader:
        if device.type == "cuda":
            tensors = _decode_cuda(reader, path, device, on_batch, stats)
        else:
            tensors = _decode_cpu(reader, path, on_batch, stats)
    stats.read_s, stats.total_s = reader.read_s, time.perf_counter() - t0
    mark(f"{len(batches)} batches decoded")
    return Decoded(tensors, files, stats)
