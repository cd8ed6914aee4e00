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


def synchronize(device: torch.device) -> None:
    """torch.cuda.synchronize(device), never during another thread's capture."""
    with LOCK:
        torch.cuda.synchronize(device)
