"""The `wcodec` command line and Python API, on top of `service`, `cuda_ext` and `codec`; nothing
imports it.

    wcodec.load(path, device)   a whole archive onto a device through the pipelined loader
                                (service/load/pipeline.py): CUDA kernels, else the C++ twin, else NumPy
    wcodec.entry.main           the `wcodec` console script: `serve` (wcodec/serve.py) is dispatched
                                before anything heavy is imported; every other command goes to wcodec/cli.py
    wcodec.bench                the benchmark's measuring code"""
from __future__ import annotations

from codec import __version__

__all__ = ["__version__", "load"]


def load(path, device="cuda", *, verify: bool = True):
    """A whole archive -> codec.decode.LoadedModel (state_dict, files, config) with tensors on `device`.
    CUDA where torch sees no GPU is a RuntimeError that says so (it was pin_memory's, about allocators)."""
    import torch

    from service.load.pipeline import load_archive
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"wcodec.load: device {str(device)!r}, but torch sees no CUDA GPU ('cpu' decodes "
                           "with the C++ twin)")
    return load_archive(path, device, verify=verify)
