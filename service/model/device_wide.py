"""What must not run beside a CUDA graph's capture in this process. Each model's engine captures
its decode steps on its own stream and thread (engine/runner.py), but a device-wide
synchronize or empty_cache from any thread syncs the capturing stream too: CUDA refuses it
("operation not permitted when stream is capturing") and invalidates the capture. Two models on
one GPU did exactly this: one engine's capture began with torch.cuda.graph's synchronize while
the other's was capturing (H200, 2026-12-01). So captures, device-wide syncs and the memory's
release all hold LOCK: one at a time, a capture whole."""
from __future__ import annotations

import threading

import torch

LOCK = threading.RLock()
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every capture on `device` runs on (they hold LOCK), from CUDA's
    high-priority pool. torch.cuda.graph's own default comes from the default-priority pool,
    which the loader's copy and decode streams rotate through too: a load beside an engine's
    capture (a reload, or another model's load) got that very stream and waited on its events
    ("dependency created on uncaptured work in another stream", H200, 2026-12-01)."""
    with LOCK:
        if device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream(device, priority=-1)
        return _STREAMS[device]


def synchronize(device: torch.device) -> None:
    """torch.cuda.synchronize(device), never during another thread's capture."""
    with LOCK:
        torch.cuda.synchronize(device)
