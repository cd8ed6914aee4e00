"""Early pins on a GPU: the buffers CUDA's runtime page-locks by ctypes are page-locked for torch,
and a non-blocking copy through them to the device and back is bit-exact (the start-up load copies
its batches so: scripts/gpu/run.sh cold-start runs it in `wcodec serve`)."""
from __future__ import annotations

import torch

from service.load.early_pin import EarlyPin, runtime_library
from service.timeline import Timeline


def test_early_buffers_are_page_locked_and_carry_bytes() -> None:
    assert runtime_library() is not None                                 # torch's own libcudart
    timeline = Timeline()
    buffers = EarlyPin(torch.cuda.current_device(), 2, 3 << 20, timeline).take()
    assert len(buffers) == 2 and all(b.is_pinned() and b.numel() == 3 << 20 for b in buffers)
    assert all(b.data_ptr() % 4096 == 0 for b in buffers)                # O_DIRECT reads into them
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    buffers[0].copy_(data)
    on_gpu = torch.empty(3 << 20, dtype=torch.uint8, device="cuda").copy_(buffers[0], non_blocking=True)
    buffers[1].copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffers[1], data)
    assert any("pinned buffers" in e.name for e in timeline.entries())
