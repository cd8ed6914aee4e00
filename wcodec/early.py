"""Work `wcodec compress` starts before torch imports, on threads of its own (`start`): the CUDA
context, and the archive file's page cache (codec/container.Prefill: zeros written into the file
the writer then writes over, the pages of a new file being the costly part of writing it).

`import torch` takes ~3 s on the H100 box and creating the CUDA context ~0.35 s after it. The
context is the device's primary context, which the CUDA runtime (torch's) retains when it first
needs the device; the driver API can create it earlier. So a thread loads libcuda and retains the
primary context of device 0 (the device `--device cuda` means) through ctypes, whose foreign calls
release the GIL: it runs beside the import instead of after it. It is an optimisation only: with
no driver or no device (this CPU machine) every failure is ignored, and torch later finds and
reports the same state itself. The reference retained is kept for the life of the process (a
release would destroy the context before torch retains it)."""
from __future__ import annotations

import argparse
import ctypes
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from codec.container import Prefill

CUDA_SUCCESS = 0
LIBCUDA = "libcuda.so.1"
PREFILL_RATIO = 0.7        # of the source's bytes: a lossless bf16 archive is ~0.665 of its source
PREFILL_MIN_CPUS = 8       # the prefill takes a core beside the import: on 2 it slowed the command


def start(args: argparse.Namespace) -> Prefill | None:
    """Start the early work of a parsed `compress`: the CUDA context unless --device cpu, and the
    prefill of a lossless archive where there are PREFILL_MIN_CPUS (WCODEC_EARLY_CUDA=0: no early
    context; WCODEC_PREFILL=0 or 1: no prefill, or one anyway; to time both ways). Returns the
    prefill, which the caller hands to the writer or discards."""
    if args.device != "cpu" and os.environ.get("WCODEC_EARLY_CUDA") != "0":
        start_cuda_context()
    if not _prefill_wanted(args.codec, os.environ.get("WCODEC_PREFILL")):
        return None
    from codec.container import Prefill  # numpy's import: after the CUDA thread starts
    return Prefill(args.dst, int(PREFILL_RATIO * source_bytes(args.src)))


def _prefill_wanted(codec: str, flag: str | None) -> bool:
    if codec != "lossless" or flag == "0":
        return False
    return flag == "1" or len(os.sched_getaffinity(0)) >= PREFILL_MIN_CPUS


def source_bytes(src: str) -> int:
    """The bytes of a checkpoint's tensor files (0 where there are none to be seen)."""
    path = Path(src)
    try:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        return sum(f.stat().st_size for f in files)
    except OSError:
        return 0


def retain_primary_context(device: int = 0, lib: str = LIBCUDA) -> bool:
    """cuInit and cuDevicePrimaryCtxRetain of `device`; False where the driver or device is not there."""
    try:
        cuda = ctypes.CDLL(lib)
    except OSError:
        return False
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    return (cuda.cuInit(0) == CUDA_SUCCESS
            and cuda.cuDeviceGet(ctypes.byref(dev), device) == CUDA_SUCCESS
            and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == CUDA_SUCCESS)


def start_cuda_context() -> threading.Thread:
    """retain_primary_context() on a daemon thread, started now (the caller may join it or not)."""
    thread = threading.Thread(target=retain_primary_context, name="wcodec-cuda-context", daemon=True)
    thread.start()
    return thread
