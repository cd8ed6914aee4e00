"""Bit planes of the lossless float codec: which bits are entropy-coded, which are stored raw.

Per dtype, an element splits into a coded byte `sym` (the exponent, plus for fp16 the sign and two
mantissa bits), a raw byte `hi`, and for fp32 a raw little-endian u16 `lo`:

  bf16   15 14       7 6     0          sym = exponent[7:0]
         +--+---------+-------+          hi  = sign << 7 | mantissa[6:0]
         |s | exp (8) | m (7) |
         +--+---------+-------+

  fp16   15 14    10 9  8 7       0      sym = the high byte: sign, exponent[4:0], mantissa[9:8]
         +--+-------+----+--------+      hi  = mantissa[7:0]
         |s |exp (5)| m9m8| m7..m0 |
         +--+-------+----+--------+

  fp32   31 30      23 22     16 15       0     sym = exponent[7:0]
         +--+---------+---------+----------+     hi  = sign << 7 | mantissa[22:16]
         |s | exp (8) | m22..16 | m15..m0  |     lo  = mantissa[15:0]
         +--+---------+---------+----------+

  fp8    7 6          0                    sym = the whole byte (float8_e4m3fn, float8_e5m2)
         +-+-----------+                    no raw plane
         |s| exp | man |                    e4m3fn: exp 4, man 3; e5m2: exp 5, man 2
         +-+-----------+
         Coding the whole byte measured best on fp8 weights cast with per-row or per-128-block
         scales (docs/BENCHMARKS.md): 0.815 of the raw bytes for e4m3fn, against 0.823 with the
         sign and exponent coded and the mantissa raw (the byte's 256 values make one table).

Context: the exponent is coded with table ``ctx`` = the top `ctx_bits` mantissa bits that `hi`
holds (hi bits 6.. for bf16/fp32, hi bits 7.. for fp16). The decoder reads `hi` before it decodes
`sym`, so the context costs nothing to transmit. Every bit pattern (NaN payloads, +-Inf, -0,
denormals) splits and joins exactly: the planes are a bijection of the bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FloatLayout:
    name: str
    torch_dtype: torch.dtype
    word: type                 # unsigned integer view of one element
    itemsize: int
    ctx_top_bit: int           # index in `hi` of the highest mantissa bit


FLOAT_LAYOUTS = {
    "bfloat16": FloatLayout("bfloat16", torch.bfloat16, np.uint16, 2, 6),
    "float16": FloatLayout("float16", torch.float16, np.uint16, 2, 7),
    "float32": FloatLayout("float32", torch.float32, np.uint32, 4, 6),
    "float8_e4m3fn": FloatLayout("float8_e4m3fn", torch.float8_e4m3fn, np.uint8, 1, -1),
    "float8_e5m2": FloatLayout("float8_e5m2", torch.float8_e5m2, np.uint8, 1, -1),
}
WHOLE_BYTE = frozenset({"float8_e4m3fn", "float8_e5m2"})     # sym is the element; ctx_bits is 0


def split(layout: FloatLayout, u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Element words -> (sym u8, hi u8 | None, lo u16 | None)."""
    if layout.itemsize == 1:
        return u.astype(np.uint8, copy=False), None, None
    if layout.name == "float16":
        return (u >> 8).astype(np.uint8), (u & 0xFF).astype(np.uint8), None
    if layout.name == "bfloat16":
        sym = ((u >> 7) & 0xFF).astype(np.uint8)
        hi = (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)
        return sym, hi, None
    sym = ((u >> 23) & 0xFF).astype(np.uint8)
    hi = (((u >> 24) & 0x80) | ((u >> 16) & 0x7F)).astype(np.uint8)
    return sym, hi, (u & 0xFFFF).astype(np.uint16)


def join(layout: FloatLayout, sym: np.ndarray, hi: np.ndarray, lo: np.ndarray | None,
         out: np.ndarray | None = None) -> np.ndarray:
    """(sym, hi, lo) -> element words, the exact inverse of split; written into `out` if given."""
    w = layout.word
    out = np.empty(len(sym), dtype=w) if out is None else out
    if layout.itemsize == 1:
        out[:] = sym
        return out
    if layout.name == "float16":
        np.left_shift(sym, 8, out=out, dtype=w)
        return np.bitwise_or(out, hi, out=out)
    h = hi.astype(w)
    np.left_shift(sym, 23 if w is np.uint32 else 7, out=out, dtype=w)           # exponent
    np.bitwise_or(out, (h & 0x80) << (24 if w is np.uint32 else 8), out=out)    # sign
    np.bitwise_or(out, (h & 0x7F) << (16 if w is np.uint32 else 0), out=out)    # top mantissa
    return out if lo is None else np.bitwise_or(out, lo, out=out)


def context(layout: FloatLayout, hi: np.ndarray, ctx_bits: int) -> np.ndarray:
    """Table index within a table set for each element: the top `ctx_bits` mantissa bits in hi."""
    if ctx_bits == 0:
        return np.zeros(hi.shape, dtype=np.uint8)
    return (hi >> (layout.ctx_top_bit + 1 - ctx_bits)) & ((1 << ctx_bits) - 1)
