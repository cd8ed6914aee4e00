"""`.wcodec` -> tensors: the CPU reference decoder, with checksum verification."""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from . import errors, floatcodec
from .constants import STREAM_ALIGN
from .container import Reader, crc32
from .entries import TensorEntry
from .parallel import WORKER_STATE, balanced_limit, default_workers, ordered_map

BATCH_ELEMENTS = 48 << 20          # elements per decode job


@dataclass
class Archive:
    """An opened archive: the validated reader and its tensor entries, in file (layer) order."""

    reader: Reader
    entries: list[TensorEntry]

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Archive":
        reader = Reader.open(path)
        entries = [TensorEntry.from_json(reader.path, rec) for rec in reader.header["tensors"]]
        for e in entries:                      # every stream inside the data region before any use
            for role, rec in e.streams.items():
                reader.stream(rec, f"tensor {e.name!r}: stream {role}")
        for name, rec in reader.header["files"].items():
            reader.stream(rec, f"file {name!r}")
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise errors.HeaderError(reader.path, "duplicate tensor names")
        _check_disjoint(reader, entries)
        return cls(reader, entries)

    @property
    def path(self) -> str:
        return self.reader.path

    def close(self) -> None:
        self.reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_disjoint(reader: Reader, entries: list[TensorEntry]) -> None:
    """No byte of the data region belongs to two streams or files. Streams that shared bytes would
    let a small file claim any number of tensors (decoded size is bounded by the file's only when
    each stored byte is read once)."""
    records = [(f"tensor {e.name!r}: stream {role}", rec) for e in entries for role, rec in e.streams.items()]
    records += [(f"file {name!r}", rec) for name, rec in reader.header["files"].items()]
    spans = sorted((rec["offset"], rec["offset"] + rec["length"], what) for what, rec in records if rec["length"])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise errors.HeaderError(reader.path, f"{second} overlaps {first}")


@dataclass
class LoadedModel:
    """What a decoded archive serves: the state dict plus the embedded model files."""

    state_dict: dict[str, torch.Tensor]
    files: dict[str, bytes]
    header: dict = field(repr=False)

    @property
    def config(self) -> dict | None:
        blob = self.files.get("config.json")
        return json.loads(blob) if blob else None


def decode_entries(archive: Archive, entries: list[TensorEntry], verify: bool = True,
                   outputs: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Decode a batch of entries to their raw little-endian bytes, into `outputs` (uint8 arrays
    of each entry's nbytes) when given. Each entry's codec row (codecs.py) names its coded
    streams; those of the whole batch are rANS-decoded in one pass, then each row builds its
    tensor from them and its raw streams."""
    outputs = outputs or [np.empty(e.nbytes, dtype=np.uint8) for e in entries]
    work = []
    for e in entries:
        what = f"tensor {e.name!r}"
        streams = {role: archive.reader.checked_stream(rec, what, verify) for role, rec in e.streams.items()}
        try:
            items = e.codec_row.rans_items(e, streams)
        except floatcodec.StreamFault as fault:
            raise errors.CorruptStreamError(archive.path, f"{what}: {fault}") from None
        work.append((e, streams, items))
    flat = [item for _, _, items in work for _, item in items]
    decoded = iter(floatcodec.decode_batch(flat) if flat else [])
    for (e, streams, items), out in zip(work, outputs):
        symbols = []
        for label, _ in items:
            sym, status, _, _ = next(decoded)
            if status.any():
                seg = int(np.flatnonzero(status)[0])
                raise errors.CorruptStreamError(archive.path, f"tensor {e.name!r}: {label}segment {seg} "
                                                              f"fails to decode (status {int(status[seg])})")
            symbols.append(sym)
        try:
            e.codec_row.finish(e, streams, symbols, out)
        except floatcodec.StreamFault as fault:
            raise errors.CorruptStreamError(archive.path, f"tensor {e.name!r}: {fault}") from None
    if verify:
        for e, data in zip(entries, outputs):
            if crc32(data) != e.crc32:
                raise errors.ChecksumError(archive.path, f"tensor {e.name!r}: decoded bytes fail their CRC32")
    return outputs


def _decode_job(job) -> None:
    path, verify, picks = job
    archive = WORKER_STATE.get(("archive", path))
    if archive is None:
        archive = WORKER_STATE[("archive", path)] = Archive.open(path)
    out = np.frombuffer(WORKER_STATE["out"], dtype=np.uint8)
    entries = [archive.entries[i] for i, _ in picks]
    decode_entries(archive, entries, verify, [out[off:off + e.nbytes] for (_, off), e in zip(picks, entries)])


def _plan_jobs(archive: Archive, verify: bool, workers: int):
    offsets, pos = [], 0
    for e in archive.entries:
        offsets.append(pos)
        pos += -(-e.nbytes // STREAM_ALIGN) * STREAM_ALIGN
    limit = balanced_limit(sum(e.numel for e in archive.entries), workers, BATCH_ELEMENTS)
    jobs, batch, size = [], [], 0
    for i, e in enumerate(archive.entries):
        if batch and size + e.numel > limit:
            jobs.append((archive.path, verify, batch))
            batch, size = [], 0
        batch.append((i, offsets[i]))
        size += e.numel
    if batch:
        jobs.append((archive.path, verify, batch))
    return jobs, offsets, pos


def load(path: str | os.PathLike, *, verify: bool = True, workers: int | None = None) -> LoadedModel:
    """Decode a whole archive on the CPU with the NumPy reference, in parallel across tensors.

    The tensors share one anonymous memory map that the worker processes write into, so the
    decoded weights exist once."""
    with Archive.open(path) as archive:
        files = archive.reader.files(verify)
        workers = workers or default_workers()
        jobs, offsets, total = _plan_jobs(archive, verify, workers)
        out = mmap.mmap(-1, max(total, 1))
        try:
            for _ in ordered_map(_decode_job, jobs, min(workers, len(jobs) or 1), state={"out": out}):
                pass
        finally:
            WORKER_STATE.clear()
        state = {e.name: _tensor_view(out, off, e) for e, off in zip(archive.entries, offsets)}
        return LoadedModel(state, files, archive.reader.header)


def _tensor_view(out: mmap.mmap, offset: int, e: TensorEntry) -> torch.Tensor:
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=e.torch_dtype)
    flat = torch.frombuffer(out, dtype=torch.uint8, count=e.nbytes, offset=offset)
    return flat.view(e.torch_dtype).reshape(e.shape)


def decompress(src: str | os.PathLike, dst: str | os.PathLike, *, workers: int | None = None,
               loader=None) -> int:
    """Archive -> a plain .safetensors file. `loader(path)` decodes (default: this module's load;
    the CLI passes the extension's, which uses the C++ twin when it is built). Written beside `dst`
    under a temporary name, created before the decode (a missing or read-only folder fails at once,
    not after the whole model is decoded), and renamed, so a failure leaves nothing and replaces
    nothing."""
    from .container import refuse_directory, temp_path
    from .sources import refuse_destination
    refuse_destination(src, dst)
    refuse_directory(dst)
    tmp = temp_path(os.fspath(dst))
    try:
        open(tmp, "xb").close()
    except OSError as e:
        raise errors.CodecError(dst, f"cannot create: {e.strerror or e}") from None
    try:
        model = (loader or (lambda p: load(p, workers=workers)))(src)
        _save_safetensors(model.state_dict, src, dst, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return sum(t.nbytes for t in model.state_dict.values())


def _save_safetensors(state: dict[str, torch.Tensor], src, dst, tmp: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from .sources import SAFETENSORS_RESERVED
    if SAFETENSORS_RESERVED in state:
        raise errors.CodecError(dst, f"a tensor is named {SAFETENSORS_RESERVED!r}, which safetensors reserves for "
                                     "its metadata: the file could not be read back")
    try:
        save_file(state, tmp, metadata={"format": "pt", "wcodec_source": os.path.basename(os.fspath(src))})
    except (OSError, SafetensorError) as e:
        raise errors.CodecError(dst, f"cannot write: {e}") from None
