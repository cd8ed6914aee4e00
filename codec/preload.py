"""Shared libraries loaded with the GIL released, so that a thread can map and relocate them while
the main thread runs Python. Standard library only: `wcodec serve` uses it before torch imports.

Python holds the GIL across every dlopen it makes itself: an extension module's import and
`ctypes.CDLL` alike (a thread counting in a loop beside a `ctypes.CDLL` of a 0.34 s library ran
at 2 % of its speed). A foreign call through ctypes releases it, so `dlopen_released` calls
libc's dlopen. A later dlopen of the same file (torch's import, `torch.ops.load_library`) finds
it loaded and only counts a reference. The handle is never closed: the library stays for the
life of the process, as it would have once imported.

Only a library whose static initialisers need no Python may be loaded this way (libc10,
libtorch_cpu, a TORCH_LIBRARY extension once torch is imported), and only in an order that
resolves its dependencies as the import would have (torch/__init__.py preloads some CUDA
libraries from the pip wheels before libtorch_cuda: that library is left to torch)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

RTLD_NOW, RTLD_LOCAL = os.RTLD_NOW, os.RTLD_LOCAL


def _libc_dlopen():
    try:
        fn = ctypes.CDLL(None).dlopen          # glibc >= 2.34: in libc itself
    except AttributeError:
        fn = ctypes.CDLL("libdl.so.2").dlopen
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_void_p
    return fn


def dlopen_released(path: str | os.PathLike, mode: int = RTLD_NOW | RTLD_LOCAL) -> bool:
    """dlopen `path` with the GIL released; False where it does not load (the caller's own load
    later reports why)."""
    try:
        return bool(_libc_dlopen()(os.fsencode(path), mode))
    except (OSError, AttributeError):
        return False


def start(libraries: Iterable[tuple[str | os.PathLike, int]], name: str = "wcodec-preload",
          span: Callable[[str], contextlib.AbstractContextManager] | None = None) -> threading.Thread:
    """dlopen_released each (file, mode) of `libraries` in order on a daemon thread, started now;
    one that does not load ends the preload (a later one may need it). `span(name)`: a context
    manager timing each library (a start-up timeline's)."""
    def run() -> None:
        for path, mode in libraries:
            with (span or _untimed)(f"dlopen {Path(path).name} (GIL released)"):
                if not dlopen_released(path, mode):
                    return
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _untimed(_: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()
