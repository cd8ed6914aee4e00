"""JIT-build only the encoder's sources (encode_prepare, encode_float and crc32, .cpp + .cu: the CUDA
coder takes its checksums with crc32_spans) and register their ops: a lent GPU's short call tests the
encoder without building the decoders (cuda_ext/build.py builds everything).
Import it before cuda_ext.encode.coder(): the coder takes ops that are already registered."""
from __future__ import annotations

import os

import torch
from torch.utils.cpp_extension import load

from cuda_ext.build import CSRC, CXX_FLAGS


def load_encoder() -> None:
    if torch._C._dispatch_has_kernel("wcodec::encode_planes"):
        return
    build = os.environ.get("WCODEC_EXT_CACHE", "/tmp/wcodec-ext") + "-encoder"
    os.makedirs(build, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources = [str(CSRC / f"{stem}{ext}") for stem in ("encode_prepare", "encode_float", "crc32") for ext in (".cpp", ".cu")]
    load(name="wcodec_encoder", sources=sources,
         build_directory=build, extra_cflags=CXX_FLAGS, extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
         extra_cuda_cflags=["-O3", "-lineinfo"], with_cuda=True, is_python_module=False, verbose=False)


if __name__ == "__main__":
    load_encoder()
    print("encoder ops:", torch._C._dispatch_has_kernel_for_dispatch_key("wcodec::encode_planes", "CUDA"))
