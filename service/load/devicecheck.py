"""Verification where the bytes land: a CUDA load checks every stream's CRC32 on the GPU, right
after the stream's batch is copied there and beside its decode (cuda_ext.crc32_spans), instead of
hashing 9 GB on the host's cores. Read me first.

* Why: hashing on the host competes with the host-to-device copies for memory bandwidth and with
  the server for the GIL, and on a host cache hit it was the largest cost after the copies
  (bench/experiments/probe_switch.py: a 7B switch's loader 0.26-0.35 s verified on the host, 0.18-0.27 s
  not). On the GPU, crc32_spans runs at 681 GB/s (H100, bench/crc_gpu.py: 4.3 GB in 700 spans;
  one host core: zlib 2.9 GB/s, XXH3 8.6 GB/s), so a 7B archive's 9 GB take ~13 ms.
* What is checked: the record's "crc32" (format 1.0 and later; docs/FORMAT.md §4), the same
  bytes the host would hash, after they reached device memory, so a flip in host RAM or on the
  way is caught too.
* When: the check is queued on the compute stream before the decode; its result is read when the
  batch is done. A stream that fails raises ChecksumError naming it, also when the decoder tripped
  over the same bytes first (a corrupt stream is reported as the checksum failure it is), and the
  model being loaded stays unloaded (the registry installs nothing that raised).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import cuda_ext
from codec import errors
from cuda_ext import ops

from .reading import Blob


@dataclass
class StreamChecks:
    """The CRC32s of one batch's blobs, queued on the current stream."""
    path: str
    blobs: list[Blob]
    crcs: torch.Tensor                     # int64 [blobs], on the device

    def raise_if_bad(self) -> None:
        """Wait for the checksums; ChecksumError naming the first blob that fails."""
        for blob, crc in zip(self.blobs, self.crcs.tolist()):
            if crc != blob.record.get("crc32"):
                raise errors.ChecksumError(self.path, f"{blob.what}: stored stream fails its CRC32 checksum "
                                                      "(verified on the GPU)")


def queue(blobs: list[Blob], data: torch.Tensor, start: int, path: str) -> StreamChecks:
    """Checksum `blobs` in `data`, the device copy of file bytes [start, start + data.numel()).
    Only after `available` said yes for this load: the op itself, no dispatch a batch."""
    spans = torch.tensor([[b.offset - start, b.length] for b in blobs], dtype=torch.int64).reshape(-1, 2)
    return StreamChecks(path, blobs, ops.crc32_spans(data, spans))


def available(device: torch.device, verify: bool) -> bool:
    """Whether a load onto `device` verifies its streams there (CUDA, with the extension's op)."""
    return verify and device.type == "cuda" and cuda_ext.checksums_on(device)


def on_host(device: torch.device, verify: bool) -> bool:
    """Whether a load onto `device` must verify its streams on the host instead, as it reads them."""
    return verify and not available(device, verify)
