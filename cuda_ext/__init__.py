"""wcodec's decoders behind one entry point: CUDA kernels (device="cuda"), the C++ CPU twin
(device="cpu", when built), else the NumPy reference in codec/. Imports go service -> cuda_ext
-> codec; codec never imports this package.

    available()                       which path is live, and why
    decode_plan(plan, data)           decode a batch whose streams are in `data` (on any device)
    load(path, device=...)            a whole archive -> LoadedModel with tensors on `device`
"""
from __future__ import annotations

import os

import torch

from codec.container import crc32
from codec.decode import Archive, LoadedModel
from codec.decode import load as reference_load
from codec.errors import ChecksumError

from . import plan as plans
from .build import Availability, ensure_loaded

__all__ = ["Availability", "available", "decode_plan", "load", "plans"]


def available() -> Availability:
    return ensure_loaded()


def _decode_float(p: plans.Plan, data: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
    avail = ensure_loaded()
    if data.device.type == "cuda" and not avail.cuda:
        raise RuntimeError(f"CUDA decoding unavailable: {avail.reason}")
    if avail.cpp:
        from .ops import decode_float
        return decode_float(data, p.desc, outputs, p.n_segments)
    from .ops import reference_decode_float
    return reference_decode_float(data, p.desc, outputs, p.n_segments)


def decode_plan(p: plans.Plan, data: torch.Tensor, path=None) -> dict[str, torch.Tensor]:
    """Decode every tensor of a plan. `data` (uint8, 1-D, on the target device) holds the archive
    bytes [p.start, p.end). Returns {name: tensor} on data's device; corrupt streams raise the
    codec's CorruptStreamError naming the file, the tensor and the segment."""
    outputs = [torch.empty(e.shape, dtype=e.torch_dtype, device=data.device) for e in p.float_entries]
    out = {}
    if p.float_entries:
        plans.raise_on_status(p, _decode_float(p, data, outputs), path)
        out.update((e.name, t) for e, t in zip(p.float_entries, outputs))
    for e, off in p.raw_entries:
        raw = data[off:off + e.nbytes]
        out[e.name] = raw.clone().view(e.torch_dtype).reshape(e.shape) if e.nbytes else \
            torch.empty(e.shape, dtype=e.torch_dtype, device=data.device)
    return out


def load(path: str | os.PathLike, device: str | torch.device = "cuda", *, verify: bool = True,
         workers: int | None = None) -> LoadedModel:
    """Decode a whole archive onto `device`: CUDA kernels, the C++ twin, or (on a CPU without the
    twin) the parallel NumPy reference. verify=True checks every stored stream's CRC32 (on the
    host) and, on the CPU, every decoded tensor's; per-segment statuses are always checked."""
    device = torch.device(device)
    if device.type == "cpu" and not ensure_loaded().cpp:
        return reference_load(path, verify=verify, workers=workers)
    with Archive.open(path) as archive:
        files = archive.reader.files(verify)
        p = plans.build(archive.entries, archive.path)
        if verify:
            for e in archive.entries:
                for rec in e.streams.values():
                    archive.reader.checked_stream(rec, f"tensor {e.name!r}", verify)
        data = torch.from_numpy(archive.reader.buf[p.start:p.end].copy()).to(device)
        tensors = decode_plan(p, data, archive.path)
        if verify and device.type == "cpu":
            _check_decoded(archive, tensors)
        state = {e.name: tensors[e.name] for e in archive.entries}
        return LoadedModel(state, files, archive.reader.header)


def _check_decoded(archive: Archive, tensors: dict[str, torch.Tensor]) -> None:
    for e in archive.entries:
        t = tensors[e.name]
        if e.nbytes and crc32(t.reshape(-1).view(torch.uint8).numpy()) != e.crc32:
            raise ChecksumError(archive.path, f"tensor {e.name!r}: decoded bytes fail their CRC32")
