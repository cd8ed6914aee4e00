"""Frequency tables: normalisation (encoder), serialisation, parsing and decode lookup tables.

Read me first
-------------
* A table maps the 256 byte symbols to frequencies that sum to exactly M = 2**PROB_BITS; every
  symbol that occurs keeps a frequency >= 1, so every symbol stays codable.
* How the encoder normalises is NOT part of the format; the decoder only checks the invariants
  (sum == M, present symbols have freq >= 1).
* The encoder's costs are integers: bits in units of 2**-LOG2_FRAC_BITS, from the table LOG2 of
  round(log2(f) * 2**LOG2_FRAC_BITS). NumPy's float64 log2 is not the C library's (its SIMD
  builds differ from libm in the last bit), so float costs made different tables on different
  CPUs; integer costs make the same bytes in NumPy, the C++ twin and the kernels, anywhere.
* Serialised layout (little-endian), 4-byte aligned:

      +-------------------------------+------------------------------------+-----+
      | u32 bitmap[8]  (bit s%32 of   | u16 freq[popcount(bitmap)]         | pad |
      |  word s//32 = symbol s used)  |  in increasing symbol order        | 0-2 |
      +-------------------------------+------------------------------------+-----+
* Decode lookup table (LUT) of a table: for each slot in [0, M):
      SYM[slot]  = s        with cum[s] <= slot < cum[s] + freq[s]
      FREQ[slot] = freq[s]
      BIAS[slot] = slot - cum[s]
  so one decode step is ``x = FREQ[slot] * (x >> P) + BIAS[slot]`` with no search.
"""
from __future__ import annotations

import math

import numpy as np

from .constants import LOG2_FRAC_BITS, PROB_BITS, PROB_SCALE, TABLE_BITMAP_BYTES

_SYMBOLS = np.arange(256, dtype=np.int64)
# LOG2[f] = round(log2(f) * 2**LOG2_FRAC_BITS) for f in [1, M + 1] (LOG2[0] = 0, never used). Every
# value lies far from a rounding boundary (tests/codec/test_tables.py), so any faithful log2 gives
# this table: cuda_ext/csrc/encode_common.h builds the same one.
LOG2 = np.array([0] + [round(math.log2(f) * (1 << LOG2_FRAC_BITS)) for f in range(1, PROB_SCALE + 2)], np.int64)
_NEVER = np.iinfo(np.int64).max


def normalize(counts: np.ndarray) -> np.ndarray:
    """Counts [..., 256] -> frequencies [..., 256] (uint32) summing to M along the last axis.

    Symbols too rare for one slot in M get 1; the others share the rest of M in proportion to
    their counts (rounded down), and the slots left over -- or taken back, where the floor of 1
    overshoots -- go one at a time to the symbols where they cost least (cost is convex in each
    frequency, so this is optimal for the rounding). Rows with no counts stay all-zero (unused).
    Taking the floors' mass from the most frequent symbol alone cost fp8 weights 0.4 % of their
    size (docs/BENCHMARKS.md).
    """
    counts = np.asarray(counts, dtype=np.int64)
    c = counts.reshape(-1, 256)
    used = c > 0
    total = c.sum(axis=1, keepdims=True)
    rare = used & (c * PROB_SCALE < total)
    common = used & ~rare
    rest = PROB_SCALE - rare.sum(axis=1, keepdims=True)
    rest_total = np.maximum(np.where(common, c, 0).sum(axis=1, keepdims=True), 1)
    f = np.where(rare, 1, np.where(common, np.maximum(1, (c * rest) // rest_total), 0))
    while True:
        diff = np.where(total[:, 0] > 0, PROB_SCALE - f.sum(axis=1), 0)
        if not diff.any():
            return f.reshape(counts.shape).astype(np.uint32)
        _settle(f, c, diff)


def _settle(f: np.ndarray, c: np.ndarray, diff: np.ndarray) -> None:
    """One round: rows short of M gain a slot on each of their `diff` cheapest-to-grow symbols,
    rows over M lose one on each of their cheapest-to-shrink ones (at most one per symbol)."""
    grow = np.where(c > 0, c * (LOG2[f + 1] - LOG2[f]), -1)           # bits saved (fixed point); -1: unused
    shrink = np.where(f > 1, c * (LOG2[f] - LOG2[f - 1]), _NEVER)      # bits lost
    rank_grow = np.argsort(np.argsort(-grow, axis=1, kind="stable"), axis=1, kind="stable")
    rank_shrink = np.argsort(np.argsort(shrink, axis=1, kind="stable"), axis=1, kind="stable")
    up = (diff[:, None] > 0) & (rank_grow < diff[:, None]) & (c > 0)
    down = (diff[:, None] < 0) & (rank_shrink < -diff[:, None]) & (f > 1)
    f += up.astype(np.int64) - down.astype(np.int64)


def cost_fixed(counts: np.ndarray, freqs: np.ndarray) -> int:
    """Coded size of `counts` under `freqs` (same shape [..., 256]), tables excluded, in units of
    2**-LOG2_FRAC_BITS bits: sum of c * (P - log2 f), exact in int64 below 2**34 symbols."""
    c = np.asarray(counts, dtype=np.int64)
    f = np.asarray(freqs, dtype=np.int64)
    used = c > 0
    return int(np.sum(c[used] * ((PROB_BITS << LOG2_FRAC_BITS) - LOG2[f[used]])))


def cost_bits(counts: np.ndarray, freqs: np.ndarray) -> float:
    """Coded size in bits of `counts` under `freqs` (cost_fixed, as a float), tables excluded."""
    return cost_fixed(counts, freqs) / (1 << LOG2_FRAC_BITS)


def serialized_size(freqs: np.ndarray) -> np.ndarray:
    """Bytes each table [..., 256] takes when serialised (bitmap + u16 freqs, 4-aligned)."""
    k = np.count_nonzero(freqs, axis=-1)
    return TABLE_BITMAP_BYTES + ((2 * k + 3) // 4) * 4


def serialize(freqs: np.ndarray) -> bytes:
    """One table [256] -> bytes."""
    f = np.asarray(freqs, dtype=np.uint32)
    bits = np.packbits((f > 0).astype(np.uint8), bitorder="little")   # bit s%8 of byte s//8
    body = f[f > 0].astype("<u2").tobytes()
    pad = (-len(body)) % 4
    return bits.tobytes() + body + b"\0" * pad


def parse(buf: np.ndarray, offset: int, end: int) -> np.ndarray | str:
    """Parse one table from uint8 `buf[offset:end]`; returns freq[256] (uint32) or an error text."""
    if end - offset < TABLE_BITMAP_BYTES:
        return "table shorter than its bitmap"
    present = np.unpackbits(buf[offset:offset + TABLE_BITMAP_BYTES], bitorder="little").astype(bool)
    k = int(present.sum())
    body_end = offset + TABLE_BITMAP_BYTES + 2 * k
    if body_end > end:
        return "table frequencies run past the table's end"
    f = np.zeros(256, dtype=np.uint32)
    f[present] = buf[offset + TABLE_BITMAP_BYTES:body_end].view("<u2")
    if k and int(f[present].min()) == 0:
        return "a present symbol has frequency 0"
    if k and int(f.sum()) != PROB_SCALE:
        return f"frequencies sum to {int(f.sum())}, not {PROB_SCALE}"
    return f


def build_lut(freqs: np.ndarray) -> np.ndarray:
    """Tables [T, 256] -> one flat packed LUT of T * M uint32 entries (a decoder-side
    structure, not part of the format). Entry t * M + slot serves table t:

        31           20 19      12 11            0
        +---------------+----------+---------------+
        |  freq[s] - 1  |  sym s   | slot - cum[s] |
        +---------------+----------+---------------+

    so one decode step is one load: ``x = (freq - 1 + 1) * (x >> P) + bias``. All-zero rows
    (unused tables) become identity tables (freq = M, bias = slot): decoding through one leaves
    x unchanged and never renormalises, which is how padded lane positions decode as no-ops.
    """
    f = np.asarray(freqs, dtype=np.int64).reshape(-1, 256).copy()
    f[f.sum(axis=1) == 0, 0] = PROB_SCALE           # identity: symbol 0 owns every slot, cum 0
    cum = np.cumsum(f, axis=1) - f
    slot = np.tile(np.arange(PROB_SCALE, dtype=np.int64), len(f))
    sym = np.repeat(np.tile(_SYMBOLS, len(f)), f.ravel())
    freq = np.repeat(f.ravel(), f.ravel())
    bias = slot - np.repeat(cum.ravel(), f.ravel())
    return (((freq - 1) << LUT_FREQ_SHIFT) | (sym << LUT_SYM_SHIFT) | bias).astype(np.uint32)


def pack_encode(freqs: np.ndarray) -> np.ndarray:
    """Tables [..., 256] -> the encoder's packed entries ``freq << 12 | cum`` (uint32)."""
    f = np.asarray(freqs, dtype=np.uint32)
    return (f << PROB_BITS) | (np.cumsum(f, axis=-1, dtype=np.uint32) - f)


LUT_SYM_SHIFT = PROB_BITS          # sym sits above the bias ...
LUT_FREQ_SHIFT = PROB_BITS + 8     # ... and freq - 1 above the symbol
LUT_FIELD_MASK = PROB_SCALE - 1
