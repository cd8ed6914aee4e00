"""How a model computes on the CPU (WCODEC_CPU_DTYPE).

A CPU without native bf16/fp16 arithmetic (no AVX512-BF16, no AMX: e.g. AVX2-only x86) runs
PyTorch's bf16 matmuls through a fallback several times slower than float32's BLAS once a step has
more than a few rows; with one or two rows the step is memory-bound instead, and bf16 weights are
read in half the time. Measured on this project's 2-core AVX2 EPYC, SmolLM2-135M, one decoding
step (docs/BENCHMARKS.md):

    rows   bf16 weights, bf16 matmuls   float32 weights   bf16 weights, float32 matmuls (mixed)
    1            47 ms                      84 ms                 -
    4           108 ms                       -                  136 ms
    29              -                      255 ms               281 ms

So without AVX-512 `auto` keeps the archive's bf16/fp16 weights and multiplies in float32 only in
calls of at least MIXED_ROWS rows, through one float32 scratch buffer per model (the weight of
each Linear is widened into it just before its matmul, and stays in cache): no second copy of the
weights, the batch-1 speed of bf16 and most of float32's speed at many rows. Both paths sum exact products in
float32 and round once to the weight's dtype, so they differ only in summation order.
A weight larger than CHUNK_FLOATS (the tied 49152 x 576 head) is widened and multiplied a block of
output rows at a time, so that the block is still in cache when the matmul reads it: the head at
32 rows took 65 ms widened whole (113 MB written, then read), 33 ms in blocks of ~2k rows.
Compressed-resident models (decoded into bf16 scratch buffers every forward) keep their dtype and
compute as decoded mode does under `auto`, so that both modes give the same tokens and logits bit
for bit on every CPU: linear16 where it runs (unpacked: the scratch is rewritten every forward),
else the mixed matmul, a Linear of GGUF blocks dequantizing chunks that start where the mixed
blocks do (float32 sums depend on the blocks: MKL's sgemm gives other bits for other splits of
the output rows). GPU models keep their dtype.

On an AVX-512 CPU `auto` sends every call of a bf16 Linear to the extension's `linear16`
(cuda_ext/csrc/linear16.cpp: float32 sums of exact products, one rounding): with AVX512-BF16 its
vdpbf16ps loop, where PyTorch's bf16 matmul of a row or a few reads the weight at 4-8 GB/s, a third
of what memory gives; without it (AVX-512 F/BW/VL, e.g. this project's Xeon, where PyTorch's bf16
matmul is its slow fallback) its FMA loop over the same blocks: each weight widened exactly, each
step s = fl(s + w x) in k order (cuda_ext/linear16.py is its reference). Every call, not only the
few-row ones: a row's sums must not depend on the rows beside it, or a request's tokens would
change with the batch it lands in. Its weights are packed once at load (`pack`: the blocks
transposed ahead, in place), so that a call only multiplies; linear16_loop says which loop runs,
and where it is "scalar" (no AVX-512, WCODEC_CPU_SIMD=0) `auto` does not take linear16. The
demo's paged engine on the 2-core Xeon without AVX512-BF16, ms (bench/experiments/cpu_modes.py,
2026-11-28; a decode step of R rows, and the prefill of one ~22-token prompt):

    rows      bf16 weights, bf16 matmuls (model)   mixed   linear16 (FMA loop)
    prefill              206                        292          84
    1                     68                         77          29
    4                    118                        115          42
    29                   320                        420         135

    auto      linear16 for bf16 on an AVX-512 CPU (vdpbf16ps with AVX512-BF16, else FMAs); else
              mixed (above) on a CPU without native bf16 (fp16: without AMX-FP16); else the
              archive's dtype
    model     the archive's dtype and PyTorch's matmuls, always
    float32   the whole model cast to float32 once, after its load (twice the bytes); compressed
              weights (no cast of blocks or scratch) as under `auto`
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F

import cuda_ext
from cuda_ext import ops

from . import llama, quantized
from .build import ServedModel

CpuDtype = Literal["auto", "model", "float32"]
HALF = (torch.bfloat16, torch.float16)
MIXED_ROWS = 6                   # rows of a call from which float32 matmuls win (table above)
CHUNK_FLOATS = 1 << 20           # float32 elements of a weight widened at a time (4 MiB)


def _native(dtype: torch.dtype) -> bool:
    """Whether this CPU has arithmetic for `dtype` (torch's own feature checks)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return cpu._is_amx_fp16_supported()
    return True


def linear16_kernel(dtype: torch.dtype) -> bool:
    """Whether linear16 runs a SIMD loop for `dtype` here (bf16 on an AVX-512 CPU: vdpbf16ps with
    AVX512-BF16, else FMAs), as the extension itself says: where it does, it packs too."""
    return dtype == torch.bfloat16 and os.environ.get("WCODEC_CPU_SIMD") != "0" and cuda_ext.available().cpp \
        and ops.has_ops(ops.LINEAR16_OPS + ops.PACKED_OPS, "cpu") and ops.has_ops(ops.LOOP_OPS) \
        and ops.linear16_loop(dtype) != "scalar"


def cpu_compute(served: ServedModel, setting: CpuDtype) -> str:
    """"model", "linear16", "mixed" or "float32": how `served` computes under `setting`."""
    return compute_for(served.device, served.weights, served.dtype, setting)


def compute_for(device: torch.device, weights: str, dtype: torch.dtype, setting: CpuDtype) -> str:
    """How a model of `dtype` held as `weights` on `device` computes under `setting` (before its
    load too: the memory budget's estimate). Compressed weights, decoded into scratch every
    forward, are not cast: they compute as decoded weights under `auto` (the same arithmetic in
    both modes)."""
    if widens(device, setting) and weights == "decoded" and dtype in HALF:
        return "float32"
    if device.type != "cpu" or setting == "model" or dtype not in HALF:
        return "model"
    if linear16_kernel(dtype):
        return "linear16"
    return "model" if _native(dtype) else "mixed"


def widens(device: torch.device, setting: CpuDtype) -> bool:
    """Whether a bf16/fp16 model held decoded on `device` is cast to float32 after its load."""
    return device.type == "cpu" and setting == "float32"


def widened_bytes(entries) -> int:
    """The bytes that cast adds, from the archive's header (the memory budget's estimate, before
    the load): each bf16/fp16 tensor's bytes once more, as `for_cpu` counts them after it."""
    return sum(e.nbytes for e in entries if e.torch_dtype in HALF)


@dataclass(frozen=True)
class Held:
    """A model as its load will hold it, from the archive's header: what `for_cpu` will meet (the
    memory budget's estimate, before the load; Loader.estimate_bytes)."""
    weights: str                 # as held: "decoded" or "compressed"
    dtype: torch.dtype           # ServedModel.dtype (with blocks: their scratch's)
    entries: list                # every tensor's header entry
    linears: list = ()           # the entries of llama.py's Linears' weights (a tied head: the table's)
    shared: list = ()            # those another module holds too (the table a head is tied to)
    blocks: list = ()            # those held as GGUF blocks (quantized.attach's BlockLinears)


def added_bytes(held: Held, device: torch.device, setting: CpuDtype) -> int:
    """The bytes `for_cpu` will add to a model held as `held`, by the load's own rules (the memory
    budget's estimate, before the load): the float32 cast's, linear16's packed copies of shared
    weights, the mixed matmul's float32 scratch where the block Linears' scratch cannot hold it."""
    how = compute_for(device, held.weights, held.dtype, setting)
    if how == "float32":
        return widened_bytes(held.entries)
    if how == "linear16":
        return sum(e.nbytes for e in held.shared if packable(e.shape, e.torch_dtype)) if packs(held.weights) else 0
    if how == "mixed":
        floats = max((scratch_floats(*e.shape) for e in held.linears), default=0)
        if held.blocks:
            size = quantized.scratch_numel([e.shape for e in held.blocks]) * held.dtype.itemsize
            chunk = _chunks_bytes([e.shape for e in held.blocks], held.dtype.itemsize)
            if _shared_start(0, size, chunk, floats) is not None:    # CPU tensors are 64-byte aligned (c10)
                return 0
        return floats * torch.float32.itemsize
    return 0


class Linear16(llama.Linear):
    """A bf16 Linear computed by the extension's linear16 (batch invariant). Packed (`pack`): its
    weight holds linear16's block layout in place (`packed`), or, where the weight is another
    module's too (a tied head: the embedding gathers its rows), a packed copy beside it (the
    buffer `packed_copy`: an unload's `model.to("meta")` frees it with the weights)."""
    packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copy = self._buffers.get("packed_copy")
        if copy is not None:
            return ops.linear16_packed(x, copy, self.bias)
        return self.matmul(x, self.weight, self.bias)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x times `weight`: its own, or the joined weight of its set (paged.fuse_projections: rows
        of packed blocks are packed blocks, so a set of packed Linears joins packed)."""
        return (ops.linear16_packed if self.packed else ops.linear16)(x, weight, bias)


def packable(shape, dtype: torch.dtype) -> bool:
    """Whether linear16_pack takes a weight of `shape` [out, in] and `dtype`: bf16, both multiples of 32."""
    return dtype == torch.bfloat16 and shape[0] % 32 == 0 and shape[1] % 32 == 0


def packs(weights: str) -> bool:
    """Whether a model held as `weights` is packed: decoded (compressed mode's scratch views are
    rewritten every forward)."""
    return weights == "decoded"


def pack(model: torch.nn.Module) -> int:
    """Pack every Linear16 weight that linear16_pack takes (bf16, out and in features multiples
    of 32): once, so that no call transposes its blocks again (1.7-2.2x the one-row speed on the
    demo's matrices, the same outputs bit for bit). In place, except a weight another module also
    holds, which gets a packed copy. Returns the copies' bytes. Nothing where linear16 has no SIMD
    loop (the extension packs only where it has one)."""
    if not linear16_kernel(torch.bfloat16):
        return 0
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    extra = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(m, Linear16) or not packable(w.shape, w.dtype):
            continue
        if holders[id(w)] > 1:
            m.register_buffer("packed_copy", ops.linear16_pack(w.detach().contiguous()), persistent=False)
            extra += m.packed_copy.nbytes
        else:
            m.weight = torch.nn.Parameter(ops.linear16_pack(w.detach().contiguous()), requires_grad=False)
            m.packed = True
    return extra


def joins_exactly(model: torch.nn.Module) -> bool:
    """Whether joining `model`'s projections (paged.fuse_projections) changes no output bit: its
    Linears are Linear16, whose every output is its own dot product, in the same order whatever
    rows sit beside it (tests/service/model/test_paged.py)."""
    return any(isinstance(m, Linear16) for m in model.modules())


def block_rows(in_features: int) -> int:
    """Output rows the mixed matmul widens at a time: whole rows up to CHUNK_FLOATS (a shape's
    blocks, whoever holds the weight)."""
    return max(1, CHUNK_FLOATS // in_features)


def mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scratch: torch.Tensor,
                 min_rows: int) -> torch.Tensor:
    """x [..., in] times a bf16/fp16 weight [out, in] -> [..., out]: in the weight's dtype below
    `min_rows` rows; else in float32, block_rows(in) output rows at a time from row 0, each block
    widened into `scratch` (float32, shared by the model: one forward at a time), rounded once."""
    if x.numel() < min_rows * x.shape[-1]:
        return F.linear(x, weight, bias)
    xf, step = x.float(), block_rows(weight.shape[1])
    parts = []
    for i in range(0, weight.shape[0], step):
        block = weight[i:i + step]
        w = scratch[:block.numel()].view(block.shape)
        w.copy_(block)                                                    # [rows, in] float32
        parts.append(F.linear(xf, w, None if bias is None else bias[i:i + step].float()))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, -1)).to(x.dtype)


class MixedMatmul(torch.nn.Module):
    """mixed_linear with a model's float32 scratch (a buffer: an unload's `model.to("meta")` frees
    it), shared by the model's Linears: (x, weight, bias) -> y."""

    def __init__(self, scratch: torch.Tensor, min_rows: int):
        super().__init__()
        self.register_buffer("scratch", scratch, persistent=False)
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return mixed_linear(x, weight, bias, self.scratch, self.min_rows)


class MixedLinear(llama.Linear):
    """A bf16/fp16 Linear computed by `mixed_linear`: in float32 in calls of `mixed.min_rows`
    rows or more, its weight widened into the model's shared scratch a block of rows at a time."""
    joinable = False                            # its forward is not a matmul of its own weight alone
    mixed: MixedMatmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixed(x, self.weight, self.bias)


def scratch_floats(out_features: int, in_features: int) -> int:
    """Floats a Linear [out, in] widens at a time: all of it, or its blocks of block_rows."""
    return min(out_features, block_rows(in_features)) * in_features


def _scratch_floats(linear: torch.nn.Module) -> int:
    return scratch_floats(linear.out_features, linear.in_features)


def _chunks_bytes(shapes, itemsize: int) -> int:
    """Bytes of the block Linears' shared scratch that their chunks take: a block of rows of the
    largest, in the scratch's dtype (`itemsize`)."""
    return max(scratch_floats(*shape) for shape in shapes) * itemsize


def _shared_start(base: int, size: int, chunk: int, floats: int) -> int | None:
    """Where `floats` float32 elements start in the block Linears' shared scratch (`size` bytes
    at address `base`): at the first 64-byte boundary past their `chunk` bytes; None where they
    do not fit."""
    start = -(-(base + chunk) // 64) * 64 - base
    return start if start + floats * torch.float32.itemsize <= size else None


def _float_scratch(model: torch.nn.Module, floats: int) -> tuple[torch.Tensor, int]:
    """`floats` float32 elements for mixed_linear, and the bytes they add: none where they fit in
    the shared scratch of `model`'s GGUF block Linears past their chunks (one block of rows each,
    written before the block is widened), else a buffer of their own.

        block Linears' scratch   [ chunk: a block of rows, bf16 | pad to 64 bytes | float32 block | free ]

    64-byte aligned as a buffer of its own is: BLAS may take another path, with other sums, for
    operands aligned otherwise.
    """
    blocks = [m for m in model.modules() if isinstance(m, quantized.BlockLinear)]
    if blocks:
        shared = blocks[0].scratch.view(torch.uint8)                      # one per model (quantized.attach)
        chunk = _chunks_bytes([(m.out_features, m.in_features) for m in blocks], blocks[0].scratch.element_size())
        start = _shared_start(shared.data_ptr(), shared.numel(), chunk, floats)
        if start is not None:
            return shared[start:start + floats * torch.float32.itemsize].view(torch.float32), 0
    scratch = torch.empty(floats, dtype=torch.float32)
    return scratch, scratch.nbytes


def _mix(model: torch.nn.Module, min_rows: int) -> int:
    """Turn every Linear of `model` into a MixedLinear, and multiply every Linear of GGUF blocks
    by mixed_linear a block at a time (decoded mode's blocks), all sharing one float32 scratch;
    returns the bytes it adds."""
    linears = [m for m in model.modules() if isinstance(m, (llama.Linear, quantized.BlockLinear))]
    scratch, added = _float_scratch(model, max((_scratch_floats(m) for m in linears), default=0))
    mixed = MixedMatmul(scratch, min_rows)
    for m in linears:
        if isinstance(m, llama.Linear):
            m.__class__ = MixedLinear
            m.mixed = mixed
    quantized.use_kernel(model, mixed, block_rows)
    return added


def for_cpu(served: ServedModel, setting: CpuDtype) -> ServedModel:
    """`served` set up to compute as `cpu_compute` says (in place), its bytes counted again."""
    how = cpu_compute(served, setting)
    if how == "linear16":
        for m in served.model.modules():
            if isinstance(m, llama.Linear):
                m.__class__ = Linear16
        quantized.use_kernel(served.model, ops.linear16)        # GGUF blocks kept: decoded mode's kernel
        packed = pack(served.model) if packs(served.weights) else 0
        return replace(served, weight_bytes=served.weight_bytes + packed)
    if how == "mixed":
        return replace(served, weight_bytes=served.weight_bytes + _mix(served.model, MIXED_ROWS))
    if how == "float32":
        widened = sum(t.nbytes for t in (*served.model.parameters(), *served.model.buffers()) if t.dtype in HALF)
        model = served.model.to(torch.float32)        # each parameter replaced: the old one is freed
        return replace(served, model=model, dtype=torch.float32, weight_bytes=served.weight_bytes + widened)
    return served
