"""Work `wcodec compress` starts before torch imports, on a thread of its own.

`import torch` takes ~3 s on the H100 box and creating the CUDA context ~0.35 s after it. The
context is the device's primary context, which the CUDA runtime (torch's) retains when it first
needs the device; the driver API can create it earlier. So a thread loads libcuda and retains the
primary context of device 0 (the device `--device cuda` means) through ctypes, whose foreign calls
release the GIL: it runs beside the import instead of after it. It is an optimisation only: with
no driver or no device (this CPU machine) every failure is ignored, and torch later finds and
reports the same state itself. The reference retained is kept for the life of the process (a
release would destroy the context before torch retains it)."""
from __future__ import annotations

import ctypes
import threading

CUDA_SUCCESS = 0
LIBCUDA = "libcuda.so.1"


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
