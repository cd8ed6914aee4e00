"""The CUDA driver API through ctypes, for the start-up work done before torch is imported: the
device's primary context (the one the CUDA runtime, torch's, retains when it first needs the
device) and page-locking host memory in it. ctypes' foreign calls release the GIL, so these run
on threads beside the imports. Standard library only; every failure (no driver, no device, an
error) is an answer of None or False, never an exception: torch later finds and reports the same
state itself. A context retained here is kept for the life of the process (a release would
destroy it before torch retains it)."""
from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future

CUDA_SUCCESS = 0
LIBCUDA = "libcuda.so.1"


def _cuda(lib: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(lib)
    except OSError:
        return None


def primary_context(device: int = 0, lib: str = LIBCUDA) -> int | None:
    """cuInit and cuDevicePrimaryCtxRetain of `device`: the context's handle, or None."""
    cuda = _cuda(lib)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if cuda is None or cuda.cuInit(0) != CUDA_SUCCESS or cuda.cuDeviceGet(ctypes.byref(dev), device) != CUDA_SUCCESS \
            or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != CUDA_SUCCESS:
        return None
    return ctx.value


def start_primary_context(device: int = 0, lib: str = LIBCUDA, span=None) -> Future:
    """primary_context() on a daemon thread, started now; the future's result is its answer.
    `span(name)`: a context manager timing it (a start-up timeline's)."""
    result: Future = Future()

    def run() -> None:
        if span is None:
            result.set_result(primary_context(device, lib))
            return
        with span("CUDA context through the driver API"):
            result.set_result(primary_context(device, lib))
    threading.Thread(target=run, name="wcodec-cuda-context", daemon=True).start()
    return result


def page_lock(address: int, nbytes: int, ctx: int, lib: str | None = None) -> bool:
    """cuMemHostRegister [address, address + nbytes) in `ctx`, in one registration (an
    asynchronous copy must lie inside one: service/load/hostcache.py)."""
    return _call(lib, ctx, "cuMemHostRegister_v2", ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_uint(0))


def page_unlock(address: int, ctx: int, lib: str | None = None) -> bool:
    """cuMemHostUnregister of memory page_lock() locked in `ctx`."""
    return _call(lib, ctx, "cuMemHostUnregister", ctypes.c_void_p(address))


def _call(lib: str | None, ctx: int, name: str, *args) -> bool:
    """`name`(*args) with `ctx` current on this thread; False where anything fails. `lib`: None
    is LIBCUDA as it is now (tests point it at a stand-in)."""
    cuda = _cuda(lib or LIBCUDA)
    try:
        return cuda is not None and cuda.cuCtxSetCurrent(ctypes.c_void_p(ctx)) == CUDA_SUCCESS \
            and getattr(cuda, name)(*args) == CUDA_SUCCESS
    except AttributeError:                 # a driver without the function
        return False
