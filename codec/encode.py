"""Checkpoint -> `.wcodec`: streaming, batched across tensors, parallel across worker processes."""
from __future__ import annotations

import math
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Self

import numpy as np
import torch

from . import __version__, codecs, floatcodec, gguf_blocks, int8
from .constants import CODEC_FLOAT, CODEC_INT8, FORMAT_MAJOR, FORMAT_MINOR
from .container import Prefill, Summed, Writer, blob_checksums, crc32
from .entries import DTYPES, dtype_name
from .parallel import WORKER_STATE, balanced_limit, default_workers, ordered_map
from .reads import BatchReader
from .sources import CheckpointSource, StateDictSource, layer_index, layer_order, open_source, refuse_destination
from .stagetimes import StageTimes

BATCH_ELEMENTS = 48 << 20          # elements per encode job: big enough to fill the lanes
READ_AHEAD = 2                     # batches read ahead of the one encoding (a threaded coder)


@dataclass(frozen=True)
class CompressStats:
    raw_bytes: int
    stored_bytes: int
    file_bytes: int
    seconds: float
    tensors: int
    quality: dict[str, dict] | None = None     # lossy codecs: {name: {"snr_db", "max_abs_err"}}

    @property
    def ratio(self) -> float:
        return self.file_bytes / max(self.raw_bytes, 1)

    @property
    def mb_per_s(self) -> float:
        return self.raw_bytes / 1e6 / max(self.seconds, 1e-9)


def encode_tensors(items: list[tuple[str, str, tuple, object]], lossy: str | None = None,
                   coder=floatcodec.REFERENCE) -> list[dict]:
    """Encode (name, dtype, shape, payload) tensors in one batch; a payload is the tensor's raw
    little-endian bytes (uint8) or its GGUF blocks (gguf_blocks.Blocks), whose entry decodes to
    `dtype`. lossy="int8" int8-codes the 2-D float weights. Every coded plane of the batch is
    rANS-coded in one pass. Returns records without offsets: {..., "streams": {role: bytes}};
    a lossy record also carries "quality" (not part of the header). `coder` prepares and encodes
    the coded planes: the NumPy reference, or the extension's twins (cuda_ext.encode.coder)."""
    encodings = codecs.encode_many([(dtype, payload, shape) for _, dtype, shape, payload in items], lossy, coder)
    decoded = [_decoded_bytes(dtype, shape, payload, enc) for (_, dtype, shape, payload), enc in zip(items, encodings)]
    with _threads(coder) as pool:            # zlib releases the GIL: the CRCs run beside the encode
        known = [_sums(enc).get("source") for enc in encodings]        # the GPU coder's CRC32s
        crcs = [pool.submit(crc32, dec) if k is None else k for k, dec in zip(known, decoded)]
        coded = iter(coder.encode_batch([p for enc in encodings for p in enc.coded.values()]))
        crcs = [c.result() if isinstance(c, Future) else c for c in crcs]
    out = []
    for (name, dtype, shape, payload), enc, dec, crc in zip(items, encodings, decoded, crcs):
        rec = {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": int(dec.nbytes),
               "crc32": crc, "codec": enc.codec}
        if enc.params is not None:
            rec["params"] = enc.params
        blobs = {role: next(coded) for role in enc.coded}
        rec["streams"] = {role: blobs[role] if role in blobs else _raw_blob(enc, role) for role in enc.roles}
        if enc.codec == CODEC_INT8:
            rec["quality"] = quality(payload, dec, dtype)
        out.append(rec)
    return out


def _threads(coder) -> ThreadPoolExecutor:
    """Threads for checksums: as many as torch's for a threaded coder, else one (worker processes
    are the parallelism there)."""
    return ThreadPoolExecutor(torch.get_num_threads() if coder.threaded else 1)


def _sums(enc: codecs.Encoding) -> dict[str, int]:
    """The CRC32s a coder computed for a float-coded tensor ("source": its bytes, "hi", "lo")."""
    p = enc.coded.get("exp") if enc.codec == CODEC_FLOAT else None
    return (p.sums if p is not None else None) or {}


def _raw_blob(enc: codecs.Encoding, role: str):
    """A raw stream's bytes, Summed where the coder has its CRC32 already."""
    data, crc = _as_bytes(enc.raw[role]), _sums(enc).get(role)
    return data if crc is None else Summed(data, crc)


def _as_bytes(plane: np.ndarray) -> np.ndarray:
    """A raw plane's bytes, without a copy (the writer takes any buffer)."""
    return np.ascontiguousarray(plane).reshape(-1).view(np.uint8)


def quality(original: np.ndarray, decoded: np.ndarray, dtype: str) -> dict:
    """SNR (dB) and largest absolute error of a lossy tensor against its source values."""
    want = torch.from_numpy(original).view(DTYPES[dtype]).double()
    got = torch.from_numpy(decoded).view(DTYPES[dtype]).double()
    noise = float(((got - want) ** 2).sum())
    signal = float((want ** 2).sum())
    return {"snr_db": 10 * math.log10(signal / noise) if noise else math.inf,
            "max_abs_err": float((got - want).abs().max()) if want.numel() else 0.0}


def _decoded_bytes(dtype: str, shape: tuple, payload, enc: codecs.Encoding) -> np.ndarray:
    """What the entry decodes to (its CRC32 is stored): GGUF blocks are dequantized here, and
    int8-coded weights reconstructed exactly as the decoder will."""
    if isinstance(payload, gguf_blocks.Blocks):
        t = gguf_blocks.dequantize(payload.block, payload.data, tuple(shape), DTYPES[dtype])
        return t.reshape(-1).view(torch.uint8).numpy()
    if enc.codec == CODEC_INT8:
        t = int8.dequantize(enc.source.q, enc.source.scales, DTYPES[dtype])
        return t.reshape(-1).view(torch.uint8).numpy()
    return payload


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def _encode_job(job: tuple[str, list, str | None]) -> list[dict]:
    """Load (from the source the worker inherited) and encode one batch of tensors."""
    source = WORKER_STATE["source"]
    with BatchReader(source, partial(_payload, source), threads=1) as reader:
        return _encode_loaded(_load_job(job, reader))


def _load_job(job: tuple[str, list, str | None], reader: BatchReader) -> tuple[list, str | None]:
    """One batch's items for encode_tensors, its tensors read by `reader` (chunks on its threads)."""
    path, infos, lossy = job
    coder = WORKER_STATE.get("coder", floatcodec.REFERENCE)
    payloads = reader.read([i.name for i in infos])
    items = [(i.name, dtype_name(path, i.name, i.dtype), tuple(i.shape), p) for i, p in zip(infos, payloads)]
    coder.stage([p for _, dtype, shape, p in items if codecs.float_coded(dtype, p, shape, lossy)])
    return items, lossy


def _encode_loaded(loaded: tuple[list, str | None]) -> list[dict]:
    items, lossy = loaded
    return encode_tensors(items, lossy, WORKER_STATE.get("coder", floatcodec.REFERENCE))


def _read_ahead(jobs: list, state: dict, times: StageTimes):
    """encode_tensors of each job in turn, in this process (a threaded coder), the next READ_AHEAD
    batches read meanwhile (in order, each by chunks on the reader's threads): the reads overlap
    the encode, and READ_AHEAD batches more are held."""
    WORKER_STATE.update(state)
    source, pool = state["source"], state["coder"].buffers

    def load(job):
        with times.stage("read"):
            return _load_job(job, reader)
    with BatchReader(source, partial(_payload, source), pool=pool) as reader, ThreadPoolExecutor(1) as reading:
        ahead = deque(reading.submit(load, job) for job in jobs[:READ_AHEAD])
        for k in range(len(jobs)):
            with times.stage("wait for read"):
                loaded = ahead.popleft().result()
            if k + READ_AHEAD < len(jobs):
                ahead.append(reading.submit(load, jobs[k + READ_AHEAD]))
            with times.stage("encode"):
                results = _encode_loaded(loaded)
            yield results


def _payload(source: CheckpointSource, name: str):
    """A tensor's stored form: a source that keeps quantized blocks hands them over as they are."""
    blocks = source.load_blocks(name)
    return blocks if blocks is not None else _raw_bytes(source.load(name))


def _jobs(infos, path, limit: int, lossy: str | None):
    batch, size = [], 0
    for info in infos:
        n = math.prod(info.shape)
        if batch and size + n > limit:
            yield path, batch, lossy
            batch, size = [], 0
        batch.append(info)
        size += n
    if batch:
        yield path, batch, lossy


class _Tally:
    """Writes encoded batches (on the writing thread) and keeps their records and totals. A batch's
    blob checksums are started on the tally's own threads by `checksum`, on the thread that hands
    the batch over, as soon as it is encoded: they run while the batch before is written, and the
    writing thread only waits for them (rarely) and writes. Use it as a context manager (its threads)."""

    def __init__(self, writer: Writer, total: int, progress, coder, times: StageTimes):
        self.writer, self.total, self.progress, self.times = writer, total, progress, times
        self.tensors, self.raw, self.stored, self.quality = [], 0, 0, {}
        self._sums = _threads(coder)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self._sums.shutdown(cancel_futures=True)

    def checksum(self, results: list[dict]) -> list[Future]:
        """Start the checksums of a batch's blobs, in the order `write` takes them."""
        return [self._sums.submit(blob_checksums, b) for rec in results for b in rec["streams"].values()]

    def write(self, results: list[dict], sums: list[Future]) -> None:
        with self.times.stage("write"):
            self._write(results, iter(sums))

    def _write(self, results: list[dict], sums) -> None:
        for rec in results:
            if "quality" in rec:
                self.quality[rec["name"]] = rec.pop("quality")
            rec["streams"] = {role: self._add(next(sums)) for role in rec["streams"]}
            rec["layer"] = layer_index(rec["name"])
            self.tensors.append(rec)
            self.raw += rec["nbytes"]
            self.stored += sum(s["length"] for s in rec["streams"].values())
        if self.progress:
            self.progress(self.raw, self.total)

    def _add(self, summed: Future) -> dict:
        with self.times.stage("write/checksums"):          # waiting for them: they run on the tally's threads
            view, sums = summed.result()
        with self.times.stage("write/file"):
            return self.writer.add(view, sums)


def _write_each(batches, tally: _Tally, times: StageTimes) -> None:
    """Write each encoded batch on a thread: batch k is written while batch k + 1 encodes, and at
    most one batch waits to be written (bounded memory). Its checksums start as it arrives."""
    with ThreadPoolExecutor(1) as writing:
        pending: Future | None = None
        for results in batches:
            sums = tally.checksum(results)
            with times.stage("wait for write"):
                if pending is not None:
                    pending.result()
            pending = writing.submit(tally.write, results, sums)
        with times.stage("wait for write"):
            if pending is not None:
                pending.result()


def compress(src: str | os.PathLike, dst: str | os.PathLike, *, workers: int | None = None,
             gguf_dtype: torch.dtype = torch.bfloat16, gguf_keep: bool = True, lossy: str | None = None,
             progress: Callable[[int, int], None] | None = None, coder=floatcodec.REFERENCE,
             prefill: Prefill | None = None) -> CompressStats:
    """Compress a checkpoint (HF folder, .safetensors or .gguf) into `dst`. A GGUF file's
    quantized tensors keep their blocks (codec gguf, dequantized to `gguf_dtype` at load), or with
    gguf_keep=False are stored dense in `gguf_dtype`. lossy="int8" int8-codes the 2-D float weights
    (a GGUF file's then from their `gguf_dtype` values).

    `progress(done_bytes, total_bytes)` is called after each batch is written. `coder`: as
    encode_tensors' (`wcodec compress` passes the extension's on the device it picked). `prefill`:
    `dst`'s, started before (codec/container.py)."""
    keep = gguf_keep and lossy is None
    refuse_destination(src, dst)
    with open_source(src, gguf_dtype=gguf_dtype, gguf_keep=keep) as source:
        return compress_source(source, dst, workers=workers, lossy=lossy, progress=progress, coder=coder,
                               prefill=prefill)


def compress_state_dict(state_dict: dict[str, torch.Tensor], dst: str | os.PathLike, *,
                        files: dict[str, bytes] | None = None, workers: int | None = None,
                        coder=floatcodec.REFERENCE) -> CompressStats:
    """Compress in-memory tensors (plus optional model files to embed) into `dst`."""
    with StateDictSource(state_dict, files) as source:
        return compress_source(source, dst, workers=workers, coder=coder)


def compress_source(source: CheckpointSource, dst: str | os.PathLike, *, workers: int | None = None,
                    lossy: str | None = None, progress: Callable[[int, int], None] | None = None,
                    coder=floatcodec.REFERENCE, prefill: Prefill | None = None) -> CompressStats:
    """Stream an opened checkpoint source into `dst`, tensors in layer order: a batch of tensors
    at a time is read, encoded and written, so memory holds a few batches, never the model. A
    threaded coder (the extension's) runs the batches one after another in this process, reading
    the next batch while it encodes one and writing the one before. `prefill`: as compress's."""
    t0 = time.perf_counter()
    src = source.path
    infos = layer_order(source.tensors())
    total = sum(math.prod(i.shape) * i.dtype.itemsize for i in infos)
    writer = Writer(dst, prefill)
    try:
        files = {name: writer.add(blob) for name, blob in sorted(source.files.items())}
        workers = 1 if coder.threaded else workers or default_workers()
        limit = balanced_limit(sum(math.prod(i.shape) for i in infos), workers, BATCH_ELEMENTS)
        jobs = list(_jobs(infos, os.fspath(src), limit, lossy))
        times = StageTimes()
        state = {"source": source, "coder": coder}
        with _Tally(writer, total, progress, coder, times) as tally:
            _write_each(_read_ahead(jobs, state, times) if coder.threaded
                        else ordered_map(_encode_job, jobs, min(workers, len(jobs)), state), tally, times)
        tensors, raw, stored, quality = tally.tensors, tally.raw, tally.stored, tally.quality
        header = {"format": "wcodec", "version": f"{FORMAT_MAJOR}.{FORMAT_MINOR}",
                  "metadata": {"source": os.path.basename(os.fspath(src).rstrip("/")),
                               "created_by": f"wcodec {__version__}"},
                  "files": files, "tensors": tensors}
        with times.stage("finish"):
            size = writer.finish(header)
        times.print_if_asked()
    except BaseException:
        writer.abort()
        raise
    finally:
        WORKER_STATE.clear()
    return CompressStats(raw, stored, size, time.perf_counter() - t0, len(tensors), quality if lossy else None)
