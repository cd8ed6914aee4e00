"""wcodec's encoders behind one entry point: the CUDA op (device="cuda"), the C++ twin
(device="cpu", when built), else the NumPy reference in codec/ (the specification: all three
produce the same bytes).

    coder(device)                      the plane coder codec/encode.py takes (floatcodec.ReferenceCoder's
                                       interface): prepare a plane, encode a batch of planes
    best_device()                      "cuda" when the CUDA op and a GPU are there, else "cpu"

Only the float codec's planes go through the extension: the lossless float planes, fp8 bytes, and
the byte planes of the GGUF and int8 codecs. Splitting GGUF blocks into planes and the int8 codec's
quantisation stay in Python (codec/gguf_blocks.py, codec/int8.py).
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from codec import floatcodec, planes
from codec.container import Summed
from codec.floatcodec import FloatParams, Prepared
from codec.reads import BufferPool

from .build import ensure_loaded
from .plan import BYTES_CODE, DTYPE_CODES


def _registered(device_type: str) -> bool:
    """The encoder ops are registered for `device_type`, loading the extension if they are not yet
    (a process that registered them itself, e.g. a device check's encoder-only build, keeps its own)."""
    from .ops import ENCODE_OPS, has_ops
    if not has_ops(ENCODE_OPS, device_type):
        ensure_loaded()
    return has_ops(ENCODE_OPS, device_type)


def best_device() -> str:
    return "cuda" if torch.cuda.is_available() and _registered("cuda") else "cpu"


def coder(device: str | torch.device = "cpu"):
    """The extension's coder on `device`, or the NumPy reference where the extension (or its
    encoder ops) is not built. A CUDA device without the CUDA op is a RuntimeError."""
    device = torch.device(device)
    if device.type == "cuda":
        if not (torch.cuda.is_available() and _registered("cuda")):
            raise RuntimeError(f"CUDA encoding unavailable: {ensure_loaded().reason}")
        return ExtensionCoder(device)
    return ExtensionCoder(device) if _registered("cpu") else floatcodec.REFERENCE


class ExtensionCoder:
    """prepare_planes / encode_planes of the extension (cuda_ext/ops.py) on one device: a batch's
    planes are prepared in one call (on CUDA one wait for the whole batch, not one per plane).

    `device_sums` (on by default on CUDA, where crc32_spans is built): the CRC32s of each coded plane's input bytes, of its
    raw planes and of its exp stream are taken by crc32_spans where the bytes are, before they
    come back (Prepared.sums, container.Summed), instead of by zlib on the host.
    `staged` (on by default on CUDA): stage(), called by the reading thread, copies a batch's
    planes to the device on a side stream while the batch before is encoded (_Staging).
    `pinned` (on by default on CUDA): `buffers`, page-locked host buffers reused once unreferenced
    (codec/reads.py), which compress reads tensors into and this coder copies planes and streams
    back into: copies at full speed, asynchronous to the device, and no fresh pages."""

    threaded = True

    def __init__(self, device: torch.device, device_sums: bool | None = None, staged: bool | None = None,
                 pinned: bool | None = None):
        self.device = device
        self.device_sums = _sums_on_gpu(device) if device_sums is None else device_sums
        self._staging = _Staging(device) if (device.type == "cuda" if staged is None else staged) else None
        pin = device.type == "cuda" if pinned is None else pinned
        self.buffers = BufferPool(pinner=_Pinner()) if pin else None

    def stage(self, data: list[np.ndarray]) -> None:
        """Start copying planes that a later prepare_many will take (a no-op unless `staged`)."""
        if self._staging is not None:
            self._staging.put([np.ascontiguousarray(d).reshape(-1).view(np.uint8) for d in data])

    def _source(self, data: np.ndarray) -> torch.Tensor:
        host = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        staged = self._staging.take(host) if self._staging is not None else None
        if staged is not None:
            return staged
        src = torch.from_numpy(host)
        return src.to(self.device, non_blocking=True) if self.device.type == "cuda" else src

    def _prepare_many(self, items: list[tuple[planes.FloatLayout | None, np.ndarray, int]]) -> list[Prepared | None]:
        """(layout, elements, dtype code) of each plane -> its Prepared, or None where raw is cheaper."""
        if not items:
            return []
        from .ops import prepare_planes
        srcs = [self._source(data) for _, data, _ in items]
        out = prepare_planes(srcs, [code for _, _, code in items])
        choices = out[0].tolist()
        sums = self._plane_sums(srcs, out, choices) if self.device_sums else [None] * len(items)
        return [_prepared(layout, len(data), src, code, choice, *out[1 + 3 * i:4 + 3 * i], sums=s, pool=self.buffers)
                for i, ((layout, data, code), src, choice, s) in enumerate(zip(items, srcs, choices, sums))]

    def _plane_sums(self, srcs: list[torch.Tensor], out: list[torch.Tensor], choices: list) -> list[dict | None]:
        """{"source", "hi", "lo"} CRC32s of each coded plane (None for a plane left raw), in one copy."""
        named = [{"source": src, "hi": out[2 + 3 * i], "lo": out[3 + 3 * i]} if choice[0] else {}
                 for i, (src, choice) in enumerate(zip(srcs, choices))]
        named = [{k: t for k, t in d.items() if t.numel() or k == "source"} for d in named]
        crcs = iter(_crc32_each([t for d in named for t in d.values()]))
        return [{k: next(crcs) for k in d} or None for d in named]

    def prepare_many(self, items: list[tuple[planes.FloatLayout, np.ndarray]]) -> list[Prepared | None]:
        return self._prepare_many([(layout, u.view(np.uint8), BYTES_CODE) if layout.itemsize == 1   # fp8: whole bytes
                                   else (layout, u, DTYPE_CODES[layout.name]) for layout, u in items])

    def prepare(self, layout: planes.FloatLayout, u: np.ndarray) -> Prepared | None:
        return self.prepare_many([(layout, u)])[0]

    def prepare_bytes(self, sym: np.ndarray, layout: planes.FloatLayout | None = None) -> Prepared | None:
        return self._prepare_many([(layout, sym, BYTES_CODE)])[0]

    def encode_batch(self, batch: list[Prepared]) -> list[np.ndarray]:
        if not batch:
            return []
        from .ops import encode_planes
        streams = encode_planes([p.source[0] for p in batch], [p.source[1] for p in batch],
                                [p.source[2] for p in batch], [p.params.ctx_bits for p in batch],
                                [p.params.table_group for p in batch])
        if not self.device_sums:
            return [_to_host(s, self.buffers) for s in streams]
        crcs = _crc32_each(streams)
        return [Summed(_to_host(s, self.buffers), crc) for s, crc in zip(streams, crcs)]


class _Staging:
    """Planes copied to the device ahead of their batch, on a side stream (the reading thread's),
    taken once by _source on the encoding thread. An entry is keyed by its host array's address
    and size and holds that array, so the address cannot be reused while the entry exists."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self._ready: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor, object]] = {}

    def put(self, hosts: list[np.ndarray]) -> None:
        for host in hosts:
            if not host.nbytes:
                continue
            if self._stream is None:                   # CPU: the copy is the whole of it (tests)
                entry = (host, torch.from_numpy(host).clone(), None)
            else:
                with torch.cuda.stream(self._stream):
                    dev = torch.from_numpy(host).to(self.device, non_blocking=True)
                    entry = (host, dev, self._stream.record_event())
            with self._lock:
                self._ready[_address(host)] = entry

    def take(self, host: np.ndarray) -> torch.Tensor | None:
        """The staged copy of `host` (the current stream now waits for it), or None."""
        with self._lock:
            entry = self._ready.pop(_address(host), None)
        if entry is None:
            return None
        _, dev, copied = entry
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            dev.record_stream(stream)                  # freed later: not reused before this stream's work
        return dev

    def __len__(self) -> int:
        return len(self._ready)


class _Pinner:
    """Page-locks a BufferPool's host buffers (cudaHostRegister), for as long as the pool keeps them.
    A buffer CUDA refuses to register stays pageable and out of the pool: slower copies, same bytes."""

    def pin(self, a: np.ndarray) -> bool:
        return int(torch.cuda.cudart().cudaHostRegister(_address(a)[0], a.nbytes, 0)) == 0

    def unpin(self, a: np.ndarray) -> None:
        torch.cuda.cudart().cudaHostUnregister(_address(a)[0])


def _to_host(t: torch.Tensor, pool: BufferPool | None) -> np.ndarray:
    """`t` on the host: copied into one of `pool`'s buffers where there is a pool (pinned: the copy
    runs at full speed and faults in no fresh pages), else by .cpu()."""
    if pool is None or t.device.type == "cpu":
        return t.cpu().numpy()
    host = torch.from_numpy(pool.take(t.nbytes)).view(t.dtype).reshape(t.shape)
    host.copy_(t)
    return host.numpy()


def _sums_on_gpu(device: torch.device) -> bool:
    from .ops import CHECKSUM_OPS, has_ops
    return device.type == "cuda" and has_ops(CHECKSUM_OPS, "cuda")


def _address(host: np.ndarray) -> tuple[int, int]:
    return host.__array_interface__["data"][0], host.nbytes


def _crc32_each(data: list[torch.Tensor]) -> list[int]:
    """zlib.crc32 of each uint8 tensor, where it is (crc32_spans), fetched in one copy."""
    if not data:
        return []
    from .ops import crc32_spans
    crcs = [crc32_spans(t.reshape(-1), torch.tensor([[0, t.numel()]], dtype=torch.int64)) for t in data]
    return torch.cat(crcs).tolist()


def _prepared(layout: planes.FloatLayout | None, n: int, src: torch.Tensor, code: int, choice: list[int],
              freqs: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, sums: dict | None = None,
              pool: BufferPool | None = None) -> Prepared | None:
    """One plane's Prepared from prepare_planes' outputs (its planes copied to the host, into `pool`'s
    buffers where there is one)."""
    coded, ctx_bits, group = choice
    if not coded:
        return None
    params = FloatParams(n, ctx_bits, group)
    host = lambda t: _to_host(t, pool) if t.numel() else None   # noqa: E731
    lo_plane = host(lo)
    return Prepared(layout, params, host(freqs[:params.n_tables]).astype(np.uint32), None, host(hi),
                    None if lo_plane is None else lo_plane.view("<u2"), (src, code, freqs), sums)
