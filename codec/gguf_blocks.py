"""GGUF quantized blocks kept as stored bytes: the block layouts, their planes, and the reference
dequantizer (the `gguf` package's own).

Read me first (the traps)
-------------------------
* A GGUF block holds `block_size` weights in `type_size` bytes: f16 scales, then packed quants
  (or quants first: Q6_K, Q3_K, Q2_K end with their scales). Every byte pattern is a valid block.
* Planes: the codec stores a tensor's blocks as a few byte PLANES, one per field of the block
  (``PLANES`` below); plane `p` of a tensor is ``blocks[:, offsets(p)]`` in block order. The
  planes partition the block's bytes, so split/join are exact inverses. f16 fields split into a
  low-byte plane (near-uniform mantissa bits: stored raw) and a high-byte plane (sign, exponent,
  two mantissa bits: well coded), as the float codec does for fp16.
* Rows: blocks never straddle rows (ggml needs ne[0] % block_size == 0), so a row permutation of
  the weights is a permutation of whole block rows. The encoder undoes llama.cpp's q/k row
  permutation on the blocks themselves: the stored blocks are in Hugging Face row order and
  dequantize straight into the served tensor.
* Dequantization is ``gguf.quants.dequantize`` (float32) then a cast to the compute dtype: the
  bits that `wcodec compress --gguf dense` stores and the served weights of a dense archive. The
  C++ twin (cuda_ext/csrc/gguf_blocks.h) repeats gguf's float32 operations in gguf's order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32                                    # weights per block of the legacy types
QK_K = 256                                 # weights per super-block of the K types


def _f16(name: str, at: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return ((f"{name}_lo", (at,)), (f"{name}_hi", (at + 1,)))


def _span(name: str, start: int, stop: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return ((name, tuple(range(start, stop))),)


@dataclass(frozen=True)
class BlockType:
    """One GGML quantization type: its block geometry and its planes (name -> byte offsets)."""

    name: str
    code: int                              # GGMLQuantizationType value (wcodec_constants.h GgmlType)
    block_size: int                        # weights per block
    type_size: int                         # bytes per block
    planes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def plane_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.planes)

    def plane_width(self, plane: str) -> int:
        return len(dict(self.planes)[plane])


def _type(name: str, code: int, block_size: int, type_size: int, *fields) -> BlockType:
    planes = tuple(p for f in fields for p in f)
    covered = sorted(o for _, offs in planes for o in offs)
    assert covered == list(range(type_size)), name           # the planes partition the block
    return BlockType(name, code, block_size, type_size, planes)


# Byte layouts from ggml-common.h (block_q4_0 ... block_q6_K).
BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    _type("Q4_0", 2, QK, 18, _f16("d", 0), _span("qs", 2, 18)),
    _type("Q4_1", 3, QK, 20, _f16("d", 0), _f16("m", 2), _span("qs", 4, 20)),
    _type("Q5_0", 6, QK, 22, _f16("d", 0), _span("qh", 2, 6), _span("qs", 6, 22)),
    _type("Q5_1", 7, QK, 24, _f16("d", 0), _f16("m", 2), _span("qh", 4, 8), _span("qs", 8, 24)),
    _type("Q8_0", 8, QK, 34, _f16("d", 0), _span("qs", 2, 34)),
    _type("Q4_K", 12, QK_K, 144, _f16("d", 0), _f16("dmin", 2), _span("scales", 4, 16), _span("qs", 16, 144)),
    _type("Q5_K", 13, QK_K, 176, _f16("d", 0), _f16("dmin", 2), _span("scales", 4, 16), _span("qh", 16, 48),
          _span("qs", 48, 176)),
    _type("Q6_K", 14, QK_K, 210, _span("ql", 0, 128), _span("qh", 128, 192), _span("scales", 192, 208),
          _f16("d", 208)),
)}


@dataclass(frozen=True)
class Blocks:
    """A quantized tensor as the encoder receives it: its blocks in row order (uint8 [n, type_size])."""

    block: BlockType
    data: np.ndarray


def split(bt: BlockType, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Blocks (uint8 [n_blocks, type_size]) -> {plane: uint8 [n_blocks * width]}."""
    return {name: np.ascontiguousarray(blocks[:, list(offs)]).reshape(-1) for name, offs in bt.planes}


def join(bt: BlockType, planes: dict[str, np.ndarray], n_blocks: int) -> np.ndarray:
    """The exact inverse of split: planes -> blocks (uint8 [n_blocks, type_size])."""
    blocks = np.empty((n_blocks, bt.type_size), dtype=np.uint8)
    for name, offs in bt.planes:
        blocks[:, list(offs)] = planes[name].reshape(n_blocks, len(offs))
    return blocks


def n_blocks(bt: BlockType, numel: int) -> int:
    return numel // bt.block_size


def dequantize(bt: BlockType, blocks: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Blocks in row order -> the served tensor: gguf's float32 dequantization, cast to `dtype`."""
    import gguf                            # only GGUF archives need the gguf package
    with np.errstate(all="ignore"):        # NaN / inf scales are data, not mistakes
        values = gguf.quants.dequantize(np.ascontiguousarray(blocks).reshape(-1), gguf.GGMLQuantizationType(bt.code))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).to(dtype)


def shape_fits(bt: BlockType, shape: tuple[int, ...]) -> bool:
    """Blocks tile the tensor row by row: a non-empty last dimension that whole blocks fill."""
    return len(shape) >= 1 and shape[-1] > 0 and shape[-1] % bt.block_size == 0 and all(d > 0 for d in shape)
