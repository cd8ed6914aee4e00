"""fp8 checkpoints' matrices kept as their e4m3 bytes in compressed-resident mode on CUDA (W8A16),
as vLLM serves them: half of bf16's memory, and a decode step reads half the bytes.

* A load keeps each float8_e4m3fn Linear weight of a llama.py model with its scale grid (float32)
  where the fused op takes it (`block_of`: K a multiple of 16; a scale per tensor, per row, or
  per block of 128 columns and a multiple of 16 rows; no NaN byte); any other fp8 weight is
  dequantized as in decoded mode (fp8.py).
* `Fp8Linear` multiplies 1..64 rows of x with the fused op (cuda_ext.fp8: each weight decoded in
  registers, each block's float32 sum times its scale, one rounding: the checkpoint's own
  product); more rows (a prompt) dequantize the weight as decoded mode does (fp8.py's rounded
  bf16 weights, one launch) into a temporary and call cuBLAS. So a model's prompt steps give decoded mode's
  sums and its decode steps the fp8 product: the two modes' logits differ in their last bits.
* The op launches on the current stream with no host sync, so the engine's decode steps capture
  it in their CUDA graphs.

    weight8  uint8 [out, in]              the checkpoint's e4m3 bytes
    scale    float32 [ceil(out / bo), ceil(in / bi)]
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cuda_ext import fp8 as fp8_ops
from cuda_ext import ops

from ..errors import LoadFailed
from . import fp8, llama

DTYPE = torch.bfloat16           # the models whose fp8 weights are kept (the op's x)


@dataclass(frozen=True)
class Fp8Weight:
    """A kept matrix: its e4m3 bytes, its scale grid and the grid's block."""
    weight8: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.weight8.nbytes + self.scale.nbytes


def available(device: torch.device) -> bool:
    """Whether a load on `device` keeps fp8 matrices: CUDA, with the op built."""
    return device.type == "cuda" and ops.has_ops(fp8_ops.FP8_OPS, "cuda")


def block_of(name: str, shape, dtype: torch.dtype, scale_shape, s: fp8.Scheme) -> tuple[int, int] | None:
    """The block of scales a kept weight of `shape` with a scale of `scale_shape` has; None where
    the fused op does not take it (the weight is dequantized instead, which says what is wrong)."""
    if dtype != torch.float8_e4m3fn or s.dtype != DTYPE or len(shape) != 2 or not name.endswith(".weight") \
            or name == llama.EMBEDDING or shape[1] % 16:
        return None
    try:
        grid = fp8.grid_shape(name, tuple(shape), tuple(scale_shape))
        bo, bi = fp8.blocks(name, tuple(shape), grid, s.block)
    except LoadFailed:
        return None
    return (bo, bi) if grid[1] == 1 or (bi == fp8_ops.STEP and bo % 16 == 0) else None


def served_bytes(entries, s: fp8.Scheme) -> dict[str, int]:
    """name -> bytes held, for the budget's estimate: each weight `block_of` keeps at its e4m3
    bytes, its scale at float32's."""
    by_name = {e.name: e for e in entries}
    out = {}
    for e in entries:
        scale = by_name.get(f"{e.name.removesuffix('.weight')}.{s.scale_suffix}") if s.scale_suffix else None
        if scale is not None and block_of(e.name, e.shape, e.torch_dtype, scale.shape, s) is not None:
            out[e.name], out[scale.name] = e.numel, scale.numel * 4
    return out


def keeping(decode: Callable, s: fp8.Scheme, kept: dict[str, Fp8Weight]) -> Callable:
    """A pipeline DecodeFn that takes the weights `block_of` keeps (and their scales) out of each
    batch into `kept`; fp8.dequantizing then treats the rest."""
    def run(*args) -> dict[str, torch.Tensor]:
        tensors = decode(*args)
        for name in [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]:
            scale_name = f"{name.removesuffix('.weight')}.{s.scale_suffix}"
            scale, w = tensors.get(scale_name), tensors[name]
            block = None if scale is None else block_of(name, w.shape, w.dtype, scale.shape, s)
            w8 = w.view(torch.uint8)
            if block is None or bool(((w8 & 0x7F) == 0x7F).any()):        # fp8_ops.NAN_BYTES: dequantized
                continue
            grid = scale.float().reshape(fp8.grid_shape(name, tuple(w.shape), tuple(scale.shape))).contiguous()
            kept[name] = Fp8Weight(w8, grid, block)
            del tensors[name], tensors[scale_name]
        return tensors
    return run


class Fp8Linear(torch.nn.Module):
    """y = x W^T (+ b), W [out, in] kept as e4m3 bytes and a scale grid (buffers, so that an
    unload's `model.to("meta")` frees them)."""

    def __init__(self, w: Fp8Weight, bias: torch.nn.Parameter | None):
        super().__init__()
        self.out_features, self.in_features = w.weight8.shape
        self.block, self.dtype = w.block, DTYPE
        self.register_buffer("weight8", w.weight8, persistent=False)
        self.register_buffer("scale", w.scale, persistent=False)
        self.bias = bias                         # a Linear's: on meta until the load assigns it

    @staticmethod
    def join(parent: torch.nn.Module, name: str, parts: tuple[Fp8Linear, ...]) -> None:
        """paged.fuse_projections for Fp8Linears: the parts stacked into one, `parent.{name}_linear`
        (a grid of one column becomes a scale a row; block grids stack where each part's rows are
        whole blocks), the parts' buffers become row views of it; once."""
        if hasattr(parent, f"{name}_linear") or any(type(p) is not Fp8Linear for p in parts) \
                or len({(p.in_features, p.bias is None, p.scale.shape[1] == 1) for p in parts}) != 1:
            return
        rows = parts[0].scale.shape[1] == 1
        if not rows and (len({p.block for p in parts}) != 1 or any(p.out_features % p.block[0] for p in parts)):
            return
        scales = [p.scale.repeat_interleave(p.block[0], 0)[:p.out_features] if rows else p.scale for p in parts]
        block = (1, parts[0].in_features) if rows else parts[0].block
        joined = Fp8Weight(torch.cat([p.weight8 for p in parts]), torch.cat(scales), block)
        bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        parent.add_module(f"{name}_linear", Fp8Linear(joined, bias))
        for p, w, s in zip(parts, joined.weight8.split([p.out_features for p in parts]),
                           joined.scale.split([len(s) for s in scales])):
            p.weight8, p.scale, p.block = w, s, block

    def dequantized(self) -> torch.Tensor:
        """W in the model's dtype, as decoded mode holds it (fp8.py's rounding; on CUDA one launch)."""
        if self.weight8.is_cuda:
            return fp8_ops.dequantize(self.weight8, self.scale, self.block)
        return fp8.dequantized_grid(self.weight8.view(torch.float8_e4m3fn), self.scale, self.block, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                            # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if x.is_cuda and fp8_ops.fits(rows, self.weight8, x.dtype):
            y = fp8_ops.linear(x.contiguous(), self.weight8, self.scale, self.block)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized(), self.bias)


def attach(model: torch.nn.Module, kept: dict[str, Fp8Weight]) -> tuple[int, dict[str, torch.Tensor]]:
    """Put Fp8Linears in place of the llama.py Linears whose weights were `kept` (in `model`, still
    on meta). Returns their device bytes and, dequantized, the kept weights no such Linear takes
    (a model of transformers' classes)."""
    held, rest = 0, {}
    for name, w in kept.items():
        owner, attr, module = None, "", None
        if isinstance(model, llama.LlamaForCausalLM):
            owner, attr = llama.owner_of(model, name.removesuffix(".weight"))
            module = getattr(owner, attr, None)
        if type(module) is llama.Linear:
            setattr(owner, attr, Fp8Linear(w, module.bias))
            held += w.nbytes
        else:
            rest[name] = fp8.dequantized_grid(w.weight8.view(torch.float8_e4m3fn), w.scale, w.block, DTYPE)
    return held, rest
