"""wcodec's decoders behind one entry point: CUDA kernels (device="cuda"), the C++ CPU twin
(device="cpu", when built), else the NumPy reference in codec/. Imports go service -> cuda_ext
-> codec; codec never imports this package.

    available()                       which path is live, and why
    decode_plan(plan, data)           decode a batch whose streams are in `data` (on any device); fp8
                                      and GGUF entries through cuda_ext/quant.py
    build_index(plan, data)           the same, also recording the resident index (codec/resident.py)
    Prepared(plan, data, outputs,...) one launch bound to caller-owned buffers: run() allocates nothing
    crc32_spans(data, spans)          zlib.crc32 of byte spans of `data`, on its device
    ops.linear16(x, weight, bias)     the CPU matmul of served bf16/fp16 Linears (batch invariant)
"""
from __future__ import annotations

import torch

from codec import resident

from . import plan as plans
from . import quant
from .build import Availability, ensure_loaded

__all__ = ["Availability", "DeviceIndex", "Prepared", "available", "build_index", "checksums_on", "crc32_spans",
           "decode_plan", "plans"]


def available() -> Availability:
    return ensure_loaded()


def _op():
    avail = ensure_loaded()
    if avail.cpp:
        from .ops import decode_pieces
        return decode_pieces
    from .ops import reference_decode_pieces
    return reference_decode_pieces


def checksums_on(device: torch.device) -> bool:
    """Whether crc32_spans runs on `device` itself (the extension is built with its op)."""
    avail = ensure_loaded()
    from .ops import CHECKSUM_OPS, has_ops
    return avail.cpp and (device.type != "cuda" or avail.cuda) and has_ops(CHECKSUM_OPS, device.type)


def crc32_spans(data: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """zlib.crc32 of each (offset, length) row of `spans` (CPU int64 [n, 2]) in the uint8 `data`,
    as int64 [n] on data's device, queued on the current stream: the extension's op, else zlib."""
    if checksums_on(data.device):
        from .ops import crc32_spans as op
        return op(data, spans)
    if data.device.type != "cpu":
        raise RuntimeError(f"crc32_spans on {data.device} needs the extension's CUDA kernels")
    from .ops import reference_crc32_spans
    return reference_crc32_spans(data, spans)


class Prepared:
    """One launch of decode work bound to caller-owned outputs: the device plan, the status buffer
    and (RECORD / INDEXED) the resident index are built once, so that run() only launches, on the
    current stream, with no allocation and no host-to-device copy (what a layer-ahead decode of
    compressed-resident weights needs). check() waits and raises the codec's typed error."""

    def __init__(self, p: plans.Plan, data: torch.Tensor, outputs: list[torch.Tensor], mode: int = plans.MODE_BULK,
                 index: "DeviceIndex | None" = None, path=None):
        avail = ensure_loaded()
        if data.device.type == "cuda" and not avail.cuda:
            raise RuntimeError(f"CUDA decoding unavailable: {avail.reason}")
        self.plan, self.data, self.outputs, self.mode, self.path = p, data, outputs, mode, path
        self.entry_steps = index.entry_steps if index is not None else 0
        self.status = plans.buffers(p, data.device, mode, self.entry_steps)[0]
        empty = torch.empty(0, dtype=torch.int32, device=data.device)
        self.index = index or DeviceIndex(0, empty, empty)
        self.device_plan = plans.device_plan(p, outputs, mode, self.entry_steps)
        self._op = _op()

    def run(self) -> None:
        if self.plan.float_entries:
            self._op(self.data, self.plan.desc, self.device_plan, self.outputs, self.index.states,
                     self.index.words, self.status, self.mode, self.entry_steps)

    def check(self) -> None:
        per = plans.units_per_segment(self.mode, self.entry_steps)
        plans.raise_on_status(self.plan, self.status, self.path, per)


class DeviceIndex:
    """The resident index of a plan's float tensors (codec/resident.py): int32 entry states
    [entries * 32] and words [entries], on the data's device."""

    def __init__(self, entry_steps: int, states: torch.Tensor, words: torch.Tensor):
        self.entry_steps, self.states, self.words = entry_steps, states, words

    @property
    def nbytes(self) -> int:
        return self.states.nbytes + self.words.nbytes


def _with_raw(p: plans.Plan, data: torch.Tensor, floats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {e.name: t for e, t in zip(p.float_entries, floats)}
    for e, off in p.raw_entries:
        raw = data[off:off + e.nbytes]
        out[e.name] = raw.clone().view(e.torch_dtype).reshape(e.shape) if e.nbytes else \
            torch.empty(e.shape, dtype=e.torch_dtype, device=data.device)
    return out


def decode_plan(p: plans.Plan, data: torch.Tensor, path=None) -> dict[str, torch.Tensor]:
    """Decode every tensor of a plan. `data` (uint8, 1-D, on the target device) holds the archive
    bytes [p.start, p.end). Returns {name: tensor} on data's device; corrupt streams raise the
    codec's CorruptStreamError naming the file, the tensor and the segment."""
    job = Prepared(p, data, plans.outputs(p, data.device), path=path)
    job.run()
    job.check()
    return _with_raw(p, data, job.outputs) | quant.decode(p, data, path)


def keep_blocks(p: plans.Plan, data: torch.Tensor, path=None) -> dict[str, quant.QuantBlocks]:
    """A plan of GGUF tensors, kept as their blocks (compressed-resident mode): coded planes
    decoded, raw ones copied out of `data`."""
    return quant.decode(p, data, path, keep_blocks=True)


def build_index(p: plans.Plan, data: torch.Tensor, entry_steps: int = resident.ENTRY_STEPS, path=None,
                outputs: list[torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], DeviceIndex]:
    """Decode a plan in full (into `outputs` when given) while recording its resident index.
    Returns ({name: tensor}, the index), from which Prepared(..., MODE_INDEXED, index) decodes
    any tensor again in pieces of entry_steps steps."""
    resident.pieces_per_segment(entry_steps)
    _, states, words = plans.buffers(p, data.device, plans.MODE_RECORD, entry_steps)
    index = DeviceIndex(entry_steps, states, words)
    job = Prepared(p, data, outputs if outputs is not None else plans.outputs(p, data.device), plans.MODE_RECORD,
                   index, path)
    job.run()
    job.check()
    return _with_raw(p, data, job.outputs) | quant.decode(p, data, path), index
