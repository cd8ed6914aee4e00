"""The `.wcodec` container: preamble, data region, JSON header. docs/FORMAT.md is the spec.

    offset 0      preamble (64 bytes, little-endian; written last, so a crash leaves no magic)
                    0  u8[8]  MAGIC
                    8  u16    major          10 u16 minor          12 u32 flags (0)
                   16  u64    header_offset  24 u64 header_length
                   32  u32    header_crc32   36 u32 reserved (0)
                   40  u64    data_offset    48 u64 file_length    56 u64 reserved (0)
    data_offset   streams and embedded files, each STREAM_ALIGN-aligned      (DATA_ALIGN-aligned)
    header_offset UTF-8 JSON header: {"format", "version", "metadata", "files", "tensors"}
                  up to file_length == header_offset + header_length

The header sits after the data so a writer streams tensors out in one pass and never holds a
checkpoint in memory; readers take it from the offset the preamble gives.

Checksums (docs/FORMAT.md §4): every stored blob's record carries "crc32" (format 1.0) and, from
format 1.1, "xxh3" (XXH3-64 as 16 hex digits), which runs at memory speed and releases the GIL,
so readers verify it in parallel threads as bytes arrive. A reader checks "xxh3" when a record
has it, else "crc32"; a 1.0 reader ignores "xxh3" and checks "crc32", so 1.1 files stay readable.

Prefill: a new file's page cache costs far more to write than existing pages. On a VM whose balloon
reports free pages to the host (this machine's: VIRTIO_BALLOON_F_REPORTING), each fresh page faults
on the host: 0.9 GB went into a new file at 0.3-0.8 GB/s, then over the same pages at 4.5-4.9 GB/s
(bench/experiments/fresh_pages.py). A `Prefill` writes zeros into the archive's file on a thread
while the caller has nothing to write yet (`wcodec compress` during torch's import); the Writer
that takes it stops it and writes over those pages, and `finish` cuts the file to its length.
"""
from __future__ import annotations

import json
import mmap
import os
import secrets
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import xxhash

from . import errors
from .constants import (DATA_ALIGN, FORMAT_MAJOR, FORMAT_MINOR, MAGIC, MAX_HEADER_BYTES,
                        PREAMBLE_SIZE, STREAM_ALIGN)

_PREAMBLE = struct.Struct("<8sHHIQQIIQQQ")
assert _PREAMBLE.size == PREAMBLE_SIZE
CHECKSUM_MINOR = 1                  # the minor version that added "xxh3" to blob records
XXH3_HEX = 16


@dataclass(frozen=True)
class Preamble:
    major: int
    minor: int
    header_offset: int
    header_length: int
    header_crc32: int
    data_offset: int
    file_length: int

    def pack(self) -> bytes:
        return _PREAMBLE.pack(MAGIC, self.major, self.minor, 0, self.header_offset,
                              self.header_length, self.header_crc32, 0, self.data_offset,
                              self.file_length, 0)


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def xxh3(data) -> str:
    """XXH3-64 of a blob, 16 lowercase hex digits (the GIL is released above 64 KiB)."""
    return xxhash.xxh3_64_hexdigest(data)


def checksums(data) -> dict:
    """The checksum fields of a blob record."""
    return {"crc32": crc32(data), "xxh3": xxh3(data)}


class Summed(NamedTuple):
    """A blob whose CRC32 its producer has computed already (the GPU coder, where the bytes were)."""

    data: object
    crc32: int


def blob_checksums(blob) -> tuple[memoryview, dict]:
    """(bytes, checksums()) of a blob or a Summed blob: only the missing CRC32 is computed here."""
    if isinstance(blob, Summed):
        view = memoryview(blob.data).cast("B")
        return view, {"crc32": blob.crc32, "xxh3": xxh3(view)}
    view = memoryview(blob).cast("B")
    return view, checksums(view)


def checksum_fault(data, record: dict) -> str | None:
    """None when `data` matches its record's checksum: "xxh3" when present, else "crc32";
    otherwise the name of the checksum that fails. A malformed "xxh3" counts as failing."""
    want = record.get("xxh3")
    if want is not None:
        ok = isinstance(want, str) and len(want) == XXH3_HEX and xxh3(data) == want
        return None if ok else "XXH3-64"
    return None if crc32(data) == record.get("crc32") else "CRC32"


PREFILL_CHUNK = 64 << 20


def temp_path(path: str) -> str:
    """The name a file is written under before it is renamed to `path`: beside it (one file system,
    so the rename is atomic) and unique to this process and call, so that two writers of one path,
    or a user's own file of a fixed name, never meet. Created exclusively; a writer that fails
    removes it, a killed one leaves it (never a file at `path` that a reader accepts)."""
    return f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def refuse_directory(path: str | os.PathLike) -> None:
    """A CodecError where the destination `path` is a directory (the rename onto it would fail
    after all the work, naming the temporary file)."""
    if os.path.isdir(path):
        raise errors.CodecError(path, "is a directory")


class Prefill:
    """Zeros written into the Writer's file (temp_path(path)), up to `nbytes`, on a thread started
    now, until a Writer takes the file (`take`) or `discard` removes it. Best effort: an error (no
    such folder, a full disk) ends the filling quietly, and the Writer meets it itself."""

    def __init__(self, path: str | os.PathLike, nbytes: int):
        self.path = os.fspath(path)
        self.tmp, self.nbytes, self.filled, self.seconds = temp_path(self.path), nbytes, 0, 0.0
        self._stop, self._taken, self._fd = threading.Event(), False, None
        self._thread = threading.Thread(target=self._fill, name="wcodec-prefill", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        t0 = time.perf_counter()
        try:
            self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            zeros = memoryview(bytes(min(PREFILL_CHUNK, self.nbytes)))
            while self.filled < self.nbytes and not self._stop.is_set():
                self.filled += os.pwrite(self._fd, zeros[:self.nbytes - self.filled], self.filled)
        except OSError:
            pass
        self.seconds = time.perf_counter() - t0

    def _end(self) -> bool:
        """Stop the filling; whether the file was made."""
        self._stop.set()
        self._thread.join()
        if self._fd is None:
            return False
        os.close(self._fd)
        self._fd = None
        return True

    def take(self) -> bool:
        """Stop filling and hand the file over (True), or False where it could not be made."""
        self._taken = self._end()
        return self._taken

    def discard(self) -> None:
        """Stop filling; remove the file unless a Writer took it."""
        if not self._taken and self._end() and os.path.exists(self.tmp):
            os.unlink(self.tmp)

    def report(self) -> str:
        return f"compress prefill: {self.filled / 1e9:.2f} GB of {self.nbytes / 1e9:.2f} GB in {self.seconds:.2f} s"


class Writer:
    """Appends aligned blobs to a new archive; `finish(header)` writes the header and preamble.

    Writes to temp_path(path) and renames on success, so a failed compress leaves nothing and an
    existing file at `path` stays until the new one replaces it whole. Every OSError is a CodecError
    naming `path`. `prefill`: that file's Prefill (its pages are written over, not made anew)."""

    def __init__(self, path: str | os.PathLike, prefill: Prefill | None = None):
        self.path = os.fspath(path)
        if prefill is not None and prefill.path != self.path:
            raise ValueError(f"the prefill of {prefill.path} is not this writer's file {self.path}")
        refuse_directory(self.path)
        self._tmp = temp_path(self.path) if prefill is None else prefill.tmp
        try:
            self._f = open(self._tmp, "r+b" if prefill is not None and prefill.take() else "xb")
        except OSError as e:
            raise errors.CodecError(self.path, f"cannot create: {e.strerror or e}") from None
        self._pos = 0
        self._write(b"\0" * DATA_ALIGN)

    def _write(self, data) -> None:
        try:
            self._f.write(data)
        except OSError as e:
            raise errors.CodecError(self.path, f"cannot write: {e.strerror or e}") from None
        self._pos += len(data)

    def add(self, data, sums: dict | None = None) -> dict:
        """Write one blob (bytes-like); returns its {offset, length, crc32, xxh3} record. `sums`:
        the blob's checksums(), when the caller has made them already (on other threads)."""
        self._write(b"\0" * ((-self._pos) % STREAM_ALIGN))
        view = memoryview(data).cast("B")
        record = {"offset": self._pos, "length": len(view), **(sums or checksums(view))}
        self._write(view)
        return record

    def finish(self, header: dict) -> int:
        """Write the header (its "version" set to the preamble's) and the preamble."""
        minor = max(FORMAT_MINOR, CHECKSUM_MINOR)
        header = {**header, "version": f"{FORMAT_MAJOR}.{minor}"}
        body = json.dumps(header, separators=(",", ":")).encode()
        if len(body) > MAX_HEADER_BYTES:
            raise errors.HeaderError(self.path, f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
        pre = Preamble(FORMAT_MAJOR, minor, self._pos, len(body), crc32(body), DATA_ALIGN, self._pos + len(body))
        self._write(body)
        try:
            self._f.seek(0)
            self._f.write(pre.pack())
            self._f.truncate(pre.file_length)      # a prefill may have made it longer
            self._f.close()
            os.replace(self._tmp, self.path)
        except OSError as e:
            raise errors.CodecError(self.path, f"cannot write: {e.strerror or e}") from None
        return pre.file_length

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:                         # its buffer's flush on a full disk: the file goes anyway
            pass
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)


@dataclass
class Reader:
    """A validated, memory-mapped archive: preamble and header checked, streams bounds-checked."""

    path: str
    preamble: Preamble
    header: dict
    buf: np.ndarray = field(repr=False)        # the whole file, uint8, read-only
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Reader":
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise errors.CodecError(path, f"cannot open: {e.strerror or e}") from None
        buf = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.zeros(0, np.uint8)
        pre = _read_preamble(path, buf)
        header = _read_header(path, buf, pre)
        return cls(path, pre, header, buf, mm)

    def stream(self, record: dict, what: str) -> np.ndarray:
        """The bytes of a stream record, after checking it lies inside the data region."""
        off, length = record.get("offset"), record.get("length")
        if not (isinstance(off, int) and isinstance(length, int)) or off < self.preamble.data_offset \
                or length < 0 or off + length > self.preamble.header_offset:
            raise errors.HeaderError(self.path, f"{what}: stream offset/length lie outside the data region")
        return self.buf[off:off + length]

    def checked_stream(self, record: dict, what: str, verify: bool = True) -> np.ndarray:
        data = self.stream(record, what)
        fault = checksum_fault(data, record) if verify else None
        if fault:
            raise errors.ChecksumError(self.path, f"{what}: stored stream fails its {fault} checksum")
        return data

    def files(self, verify: bool = True) -> dict[str, bytes]:
        return {name: self.checked_stream(rec, f"file {name!r}", verify).tobytes()
                for name, rec in self.header["files"].items()}

    def close(self) -> None:
        self.buf = np.zeros(0, np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:        # tensors still view the map; it closes when they go
                pass
            self._mmap = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_preamble(path: str, buf: np.ndarray) -> Preamble:
    if len(buf) < len(MAGIC) or bytes(buf[:len(MAGIC)]) != MAGIC:
        raise errors.NotAWcodecFile(path, "not a .wcodec file (bad magic)")
    if len(buf) < PREAMBLE_SIZE:
        raise errors.TruncatedFile(path, f"file of {len(buf)} bytes is shorter than the preamble")
    f = _PREAMBLE.unpack(bytes(buf[:PREAMBLE_SIZE]))
    pre = Preamble(f[1], f[2], f[4], f[5], f[6], f[8], f[9])
    if pre.major != FORMAT_MAJOR:
        raise errors.UnsupportedVersion(path, f"format version {pre.major}.{pre.minor} is not supported "
                                              f"(this reader reads {FORMAT_MAJOR}.x)")
    if f[3]:
        raise errors.UnsupportedVersion(path, f"preamble flags {f[3]:#x} name features this reader does not know")
    if f[7] or f[10]:
        raise errors.HeaderError(path, "preamble's reserved fields are not 0")
    if pre.file_length != len(buf):
        kind = errors.TruncatedFile if len(buf) < pre.file_length else errors.HeaderError
        raise kind(path, f"file is {len(buf)} bytes but its preamble says {pre.file_length}")
    if pre.header_length > MAX_HEADER_BYTES:
        raise errors.HeaderError(path, f"header of {pre.header_length} bytes exceeds {MAX_HEADER_BYTES}")
    if not (PREAMBLE_SIZE <= pre.data_offset <= pre.header_offset
            and pre.header_offset + pre.header_length == pre.file_length):
        raise errors.HeaderError(path, "preamble offsets are inconsistent")
    return pre


def _read_header(path: str, buf: np.ndarray, pre: Preamble) -> dict:
    body = buf[pre.header_offset:pre.header_offset + pre.header_length]
    if crc32(body) != pre.header_crc32:
        raise errors.ChecksumError(path, "header fails its CRC32")
    try:
        header = json.loads(body.tobytes().decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise errors.HeaderError(path, f"header repeats the key {e}: it would mean different things "
                                       "to different readers") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise errors.HeaderError(path, f"header is not valid JSON: {type(e).__name__}") from None
    if not isinstance(header, dict) or header.get("format") != "wcodec" \
            or not isinstance(header.get("tensors"), list) or not isinstance(header.get("files"), dict) \
            or not all(isinstance(rec, dict) for rec in header["files"].values()):
        raise errors.HeaderError(path, "header lacks format/tensors/files")
    return header


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object hook: a key twice in one object (`json` would keep the last) is a lie."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(repr(key))
            seen.add(key)
    return out
