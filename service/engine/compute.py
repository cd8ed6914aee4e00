"""The dtype a model computes in on the CPU (WCODEC_CPU_DTYPE).

A CPU without native bf16/fp16 arithmetic (no AVX512-BF16, no AMX: e.g. AVX2-only x86) runs
PyTorch's bf16 matmuls through a fallback several times slower than float32's BLAS, and the gap
grows with the batch: on this project's 2-core AVX2 EPYC, a SmolLM2-135M decoding step at 32 rows
takes ~1.5 s in bf16 and ~0.2-0.3 s in float32 (docs/BENCHMARKS.md). Batching cannot help a model
that is already compute-bound at 8 rows, so there a decoded bf16/fp16 model is cast to float32
once, after its load, in place: twice the bytes, still one copy of the weights. Compressed-
resident models (decoded into bf16 scratch slots every forward) and GPU models keep their dtype.

    auto      float32 on a CPU without native bf16 (fp16: without AMX-FP16), else the archive's
    model     the archive's dtype, always
    float32   float32 on any CPU
"""
from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch

from ..modeling import ServedModel

CpuDtype = Literal["auto", "model", "float32"]


def _native(dtype: torch.dtype) -> bool:
    """Whether this CPU has arithmetic for `dtype` (torch's own feature checks)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return cpu._is_amx_fp16_supported()
    return True


def cpu_compute_dtype(served: ServedModel, setting: CpuDtype) -> torch.dtype:
    if served.device.type != "cpu" or served.resident != "decoded" or setting == "model":
        return served.dtype
    if served.dtype in (torch.bfloat16, torch.float16) and (setting == "float32" or not _native(served.dtype)):
        return torch.float32
    return served.dtype


def for_cpu(served: ServedModel, setting: CpuDtype) -> ServedModel:
    """`served` with its model cast to the compute dtype (in place), bytes counted again."""
    dtype = cpu_compute_dtype(served, setting)
    if dtype == served.dtype:
        return served
    model = served.model.to(dtype)                    # each parameter replaced: the old one is freed
    nbytes = served.weight_bytes * dtype.itemsize // served.dtype.itemsize
    return replace(served, model=model, dtype=dtype, weight_bytes=nbytes)
