"""Early pins: the start-up load's page-locked ring buffers made from the process's first second,
on a thread, while Python imports torch and the service. No torch here.

A CUDA load copies its batches to the GPU through a ring of page-locked host buffers (ring.py).
Made after torch's import, the CUDA context and the buffers (0.8-1.1 s for a 7B's four, H200 box)
were the start-up's critical path to the first token: the decode waited for them while the early
read had its bytes in memory already. Here CUDA's runtime library -- the very file torch loads,
from the nvidia runtime wheel -- is opened by ctypes: cudaSetDevice makes the device's primary
context, which torch then finds and uses, and cudaHostAlloc page-locks the buffers. After torch's
import the early load adopts them (`take`: views that PINNED keeps for the process, as it keeps
its own). Whatever is missing (no runtime library: a CPU-only torch; no GPU; an error) leaves the
buffers to the early load, as before: nothing here fails a start."""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import os
import re
import threading

from ..timeline import Timeline

log = logging.getLogger("wcodec.service")

HOST_ALLOC_PORTABLE = 1            # cudaHostAllocPortable: page-locked for every context


def runtime_library() -> str | None:
    """The CUDA runtime torch loads: libcudart.so.<its CUDA major> from the nvidia wheels (found
    without importing torch: its version.py is read as text), else torch/lib's own; None without."""
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is None or not torch_spec.submodule_search_locations:
        return None
    torch_dir = torch_spec.submodule_search_locations[0]
    try:
        with open(os.path.join(torch_dir, "version.py")) as f:
            found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"](\d+)\.", f.read(), re.M)
    except OSError:
        return None
    if found is None:                                   # a CPU-only torch
        return None
    name = f"libcudart.so.{found.group(1)}"
    nvidia = importlib.util.find_spec("nvidia")
    roots = list(nvidia.submodule_search_locations) if nvidia and nvidia.submodule_search_locations else []
    hits = [p for root in roots for p in sorted(glob.glob(os.path.join(root, "**", name), recursive=True))]
    hits += glob.glob(os.path.join(torch_dir, "lib", name))
    return hits[0] if hits else None


class EarlyPin:
    """`count` page-locked buffers of `nbytes` on CUDA device `device`, made on a thread from now."""

    def __init__(self, device: int, count: int, nbytes: int, timeline: Timeline):
        self.device, self.count, self.nbytes, self.timeline = device, count, nbytes, timeline
        self.pointers: list[int] = []
        self._taken, self._lock = False, threading.Lock()
        self._thread = threading.Thread(target=self._run, name="wcodec-early-pin", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        path = runtime_library()
        if path is None:
            return
        try:
            lib = ctypes.CDLL(path)
            with self.timeline.span(f"early pin: CUDA context ({os.path.basename(path)})"):
                self._check(lib.cudaSetDevice(self.device), "cudaSetDevice")
                self._check(lib.cudaFree(None), "cudaFree")          # the primary context, made now
            with self.timeline.span(f"early pin: {self.count} pinned buffers of {self.nbytes >> 20} MiB"):
                for _ in range(self.count):
                    ptr = ctypes.c_void_p()
                    self._check(lib.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes),
                                                  ctypes.c_uint(HOST_ALLOC_PORTABLE)), "cudaHostAlloc")
                    self.pointers.append(ptr.value)
        except (OSError, RuntimeError) as e:
            log.debug("early pin stopped: %s (the early load pins its ring itself)", e)

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} returned CUDA error {code}")

    def take(self) -> list:
        """The buffers made, once (after torch's import; waits for them): uint8 tensors viewing
        them, never freed (the process's pinned ring keeps them); [] on later calls."""
        self._thread.join()
        with self._lock:
            if self._taken:
                return []
            self._taken = True
        import torch
        return [torch.frombuffer((ctypes.c_uint8 * self.nbytes).from_address(p), dtype=torch.uint8)
                for p in self.pointers]


def cuda_index(device: str | None) -> int | None:
    """The CUDA device index of WCODEC_DEVICE ("cuda", "cuda:1"; None: cuda when there is one),
    None for another device."""
    if device is None or device == "cuda":
        return 0
    found = re.fullmatch(r"cuda:(\d+)", device)
    return int(found.group(1)) if found else None


def start_early_pin(reads: dict, settings, timeline: Timeline) -> EarlyPin | None:
    """The ring of the largest early read's load, when the device may be CUDA."""
    index = cuda_index(settings.device)
    if index is None or not reads:
        return None
    return EarlyPin(index, settings.load_ring_buffers, max(r.window for r in reads.values()), timeline)
