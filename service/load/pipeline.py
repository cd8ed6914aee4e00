"""Disk -> device: the pipelined loader. Read me first.

    reader thread + pool          copy stream (CUDA)            decode stream (CUDA) / CPU
    read batch k+2 -> ring    ->  H2D batch k+1 (pinned, async)  ->  decode_plan(batch k)

* A batch is the consecutive entries of one layer, read into a ring of host buffers (ring.py).
* Every stream is verified: on CUDA by its CRC32 on the GPU, beside its decode
  (devicecheck.py); elsewhere (XXH3-64 from format 1.1, else CRC32) by the pool thread
  that read its last piece, so checks overlap reads. Up to one batch per ring buffer is in flight.
* With an early read (early_read.py: the archive read at process start, or held by the host
  cache, hostcache.py), batches come from that memory instead of the file:
  decoded in place on the CPU, and on CUDA copied from it straight to the device when it is
  page-locked (a host cache hit), else through the ring.
* On CUDA the copy of batch k+1 is queued on the copy stream before batch k is decoded on the
  decode stream (which waits on the copy's event), so read, H2D and decode overlap. A host
  buffer returns to the ring once its copy event has completed. On the CPU the decoder reads
  the ring buffer in place: the same pipeline without streams or copies.
* Decoded tensors are the final weights: the caller assigns them to a model built on `meta`.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import cuda_ext
from codec import errors
from codec.container import crc32
from codec.decode import Archive, LoadedModel
from codec.errors import ChecksumError
from codec.entries import TensorEntry
from cuda_ext import fixedrate, plans, quant

from ..model import compressed, fixed, fp8, fp8_linear, quantized
from . import devicecheck
from .early_read import EarlyRead
from .reading import ArchiveFile
from .ring import PINNED, Batch, RingReader, aligned_buffer, blobs_of, layer_batches, ring_shape

log = logging.getLogger("wcodec.service")


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
    layers: list[compressed.CompressedLayer] = field(default_factory=list)   # compressed-resident mode
    blocks: dict[str, quant.QuantBlocks] = field(default_factory=dict)       # its GGUF tensors (quantized.py)
    fixed: dict[str, fixedrate.FixedRateWeight] = field(default_factory=dict)   # or its fixed-rate form (fixed.py)
    fp8: dict[str, fp8_linear.Fp8Weight] = field(default_factory=dict)     # its e4m3 matrices (fp8_linear.py)


OnBatch = Callable[[Batch, float], None]


DecodeFn = Callable[[Batch, torch.Tensor, str], dict[str, torch.Tensor]]


def _decode(batch: Batch, data: torch.Tensor, path: str, entries: list | None = None) -> dict[str, torch.Tensor]:
    entries = batch.entries if entries is None else entries
    return cuda_ext.decode_plan(plans.build(entries, path, batch.start, batch.end), data, path) if entries else {}


def _keeping(layers: list[compressed.CompressedLayer], blocks: dict[str, quant.QuantBlocks],
             fixed_form: dict[str, fixedrate.FixedRateWeight] | None) -> DecodeFn:
    """Compressed-resident mode: GGUF matrices stay their blocks (`blocks`); float-coded matrices
    are transcoded into the fixed-rate form (`fixed_form`, CUDA), or else a decoder layer's stay
    its compressed streams, kept on the device with the resident index (`layers`); everything
    else (norms, int8, fp8) is decoded as usual."""
    def decode(batch: Batch, data: torch.Tensor, path: str) -> dict[str, torch.Tensor]:
        held = [e for e in batch.entries if quantized.keeps(e)]
        if held:
            blocks.update(cuda_ext.keep_blocks(plans.build(held, path, batch.start, batch.end), data, path))
        rest = [e for e in batch.entries if not quantized.keeps(e)]
        if fixed_form is not None:
            tensors = _decode(batch, data, path, rest)
            fixed_form.update({e.name: fixedrate.encode(tensors.pop(e.name)) for e in rest if fixed.keeps(e)})
            return tensors
        if not rest or rest[0].layer is None or not any(compressed.stays_compressed(e) for e in rest):
            return _decode(batch, data, path, rest)
        kept = data.clone() if data.device.type == "cpu" else data       # the CPU ring buffer is reused
        layer_kept, raw = compressed.keep_layer(rest[0].layer, rest, (batch.start, batch.end), kept, path)
        layers.append(layer_kept)
        return raw
    return decode


def _decode_cpu(reader: RingReader, path: str, on_batch: OnBatch, stats: LoadStats,
                decode: DecodeFn) -> dict[str, torch.Tensor]:
    tensors = {}
    for _ in reader.batches:
        batch, index = reader.next()
        t0 = time.perf_counter()
        tensors.update(decode(batch, reader.host(batch, index), path))
        seconds = time.perf_counter() - t0
        reader.release(index)
        stats.decode_s += seconds
        on_batch(batch, seconds)
    return tensors


@dataclass
class _Staged:
    batch: Batch
    index: int
    data: torch.Tensor             # the batch's bytes on the device
    copied: torch.cuda.Event
    started: torch.cuda.Event


def _stage(reader: RingReader, copy_stream: torch.cuda.Stream, device: torch.device) -> _Staged:
    batch, index = reader.next()
    started, copied = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(copy_stream):
        data = torch.empty(batch.nbytes, dtype=torch.uint8, device=device)
        started.record(copy_stream)
        data.copy_(reader.host(batch, index), non_blocking=True)
        copied.record(copy_stream)
    return _Staged(batch, index, data, copied, started)


def _decode_staged(s: _Staged, reader: RingReader, decode_stream: torch.cuda.Stream, path: str,
                   on_batch: OnBatch, stats: LoadStats, decode: DecodeFn, verify: bool) -> dict[str, torch.Tensor]:
    t0 = time.perf_counter()
    decode_stream.wait_event(s.copied)
    with torch.cuda.stream(decode_stream):
        s.data.record_stream(decode_stream)      # allocated on the copy stream, read on this one
        checks = devicecheck.queue(blobs_of(s.batch), s.data, s.batch.start, path) if verify else None
        try:
            out = decode(s.batch, s.data, path)
        except errors.CodecError:
            if checks is not None:         # bytes the decoder tripped over: a checksum failure first
                checks.raise_if_bad()
            raise
    s.copied.synchronize()
    reader.release(s.index)                 # the host buffer is free once copied: the reader goes on
    decode_stream.synchronize()
    if checks is not None:
        checks.raise_if_bad()
    seconds = time.perf_counter() - t0
    stats.h2d_s += s.started.elapsed_time(s.copied) / 1e3
    stats.decode_s += seconds
    on_batch(s.batch, seconds)
    return out


def _decode_cuda(reader: RingReader, path: str, device: torch.device, on_batch: OnBatch,
                 stats: LoadStats, decode: DecodeFn, verify: bool) -> dict[str, torch.Tensor]:
    copy_stream, decode_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    tensors: dict[str, torch.Tensor] = {}
    pending: _Staged | None = None
    try:
        for k in range(len(reader.batches) + 1):
            staged = _stage(reader, copy_stream, device) if k < len(reader.batches) else None
            if pending is not None:         # batch k-1 decodes while batch k copies
                tensors.update(_decode_staged(pending, reader, decode_stream, path, on_batch, stats, decode, verify))
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
                   direct: bool | None = None, threads: int | None = None, compressed: bool = False,
                   form: str = "indexed", fp8_scheme: fp8.Scheme | None = None) -> Decoded:
    """Every tensor of an archive, decoded onto `device` through the pipeline above. `opened`:
    its (entries, embedded files) when the caller has read them already; `early`: the archive's
    bytes in memory, read at start-up or held by the host cache (used only if it is of this very
    file; released at the end); `direct`: False never uses O_DIRECT, None uses it for bytes not in
    the page cache. `compressed`: keep the decoder layers' float tensors compressed on the device
    (Decoded.layers; service/model/compressed.py) or, with `form` "fixed", in the fixed-rate form
    (Decoded.fixed; service/model/fixed.py), and GGUF matrices as their blocks (Decoded.blocks;
    service/model/quantized.py). `fp8_scheme`: float8 weights come out dequantized, each layer's
    as it is decoded (service/model/fp8.py), but for those compressed mode keeps as they are on
    CUDA (Decoded.fp8; service/model/fp8_linear.py)."""
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
    buffers = PINNED.take(n_buffers, size) if pin else [aligned_buffer(size, pin) for _ in range(n_buffers)]
    mark(f"{n_buffers} ring buffers of {size >> 20} MiB allocated (pinned: {pin}; early read: {early is not None}; "
         f"in place: {in_place}; streams verified: {'on the host' if on_host else 'on the GPU' if verify else 'no'})")
    stats = LoadStats(compressed_bytes=sum(b.nbytes for b in batches),
                      decoded_bytes=sum(b.decoded_bytes for b in batches), batches=len(batches),
                      source="file" if early is None else "early read")
    on_batch = on_batch or (lambda batch, seconds: None)
    layers: list[compressed.CompressedLayer] = []
    blocks: dict[str, quant.QuantBlocks] = {}
    fixed_form = {} if form == "fixed" else None
    if compressed and fixed_form is not None and (left := fixed.passed_over(entries)):
        log.warning("%s: %d %s matrices (%.2f GB) stay decoded: the fixed-rate form holds bf16 matrices only "
                    "(on fp16 weights it is larger than fp16); WCODEC_COMPRESSED_FORM=indexed keeps them compressed",
                    Path(path).name, len(left), "/".join(sorted({e.dtype for e in left})),
                    sum(e.nbytes for e in left) / 1e9)
    decode = _keeping(layers, blocks, fixed_form) if compressed else _decode
    fp8_kept: dict[str, fp8_linear.Fp8Weight] = {}
    if fp8_scheme is not None and compressed and fp8_linear.available(device):
        decode = fp8_linear.keeping(decode, fp8_scheme, fp8_kept)
    decode = fp8.dequantizing(decode, fp8_scheme) if fp8_scheme is not None else decode
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
    if fp8_scheme is not None:                  # weights whose scale was in another batch
        tensors = fp8.dequantize(tensors, fp8_scheme)
    stats.read_s, stats.total_s = reader.read_s, time.perf_counter() - t0
    mark(f"{len(batches)} batches decoded")
    return Decoded(tensors, files, stats, layers, blocks, fixed_form or {}, fp8_kept)


def load_archive(path: str | os.PathLike, device: str | torch.device = "cpu", *, verify: bool = True,
                 threads: int | None = None) -> LoadedModel:
    """A whole archive onto `device` through the pipeline above: the CLI's and the Python API's
    load (`wcodec.load`); codec.decode.load stays the slow, obviously-right reference. verify=True
    checks every stored stream's checksum and, on the CPU, every decoded tensor's CRC32; `threads`:
    reads in flight (default: read_threads())."""
    path, device = os.fspath(path), torch.device(device)
    with Archive.open(path) as archive:
        entries, header = archive.entries, archive.reader.header
        opened = entries, archive.reader.files(verify)
    decoded = decode_archive(path, device, verify=verify, opened=opened, threads=threads)
    if verify and device.type == "cpu":
        _check_decoded(path, entries, decoded.tensors)
    return LoadedModel({e.name: decoded.tensors[e.name] for e in entries}, decoded.files, header)


def _check_decoded(path: str, entries: list[TensorEntry], tensors: dict[str, torch.Tensor]) -> None:
    for e in entries:
        t = tensors[e.name]
        if e.nbytes and crc32(t.reshape(-1).view(torch.uint8).numpy()) != e.crc32:
            raise ChecksumError(path, f"tensor {e.name!r}: decoded bytes fail their CRC32")
