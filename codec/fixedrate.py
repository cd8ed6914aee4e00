"""The fixed-rate GPU form of a 2-D 16-bit weight (docs/FORMAT.md §6): the NumPy reference
encoder and decoder. Not the archive (codec/floatcodec.py) and not the rANS resident index
(codec/resident.py): this form is made at load, lives in GPU memory, and is read by the fused
matmul (cuda_ext/csrc/fixedrate.cu), which finds any weight's bytes without a prefix sum.

Read me first (the traps):
- A weight is a 16-bit word w; the coded field is bits 7..14 ("exponent" for bf16) and the byte
  plane keeps the other 8 bits: bits 0..6 of w in bits 1..7, and in bit 0 the sign of the *other*
  weight of its pair (weights 2j, 2j + 1). Crossed so that a pair's two words come back from their
  plane and field bytes by one byte permute and one 32-bit rotate (FORMAT.md §6). fp16 goes through
  the same split losslessly, but its field is then 5 exponent bits + 3 mantissa bits and escapes often.
- A code is 3 bits, and every code is a value: field = base + code (a window of 8 fields a tile
  of 128 weights). base <= 248 so that base + 7 fits a byte: 4 bases added to 4 codes in one u32
  never carry. A weight whose field is outside its tile's window is an escape: its code is 0, and
  the tile lists it apart, as a 16-bit entry (its position in the tile, its field), after the
  escapes of the tiles before it. The tile's word holds its base and its count of escapes.
- The codes are split into a 2-bit plane and a 1-bit plane, laid out so that the code of weight
  4q + b sits in byte lane b of a word (the kernel decodes 4 weights per 32-bit operation).
- Rows are padded to whole groups with code 0 and plane byte 0 (but for the sign bit of a real
  partner: an odd row's last weight); padding never escapes.
- The entries of a row's tiles are consecutive; esc_start gives the index of each escape block's
  (32 groups, 8 tiles) first entry, and a tile's first is that plus the counts of the block's tiles
  before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .constants import (
    FR_BLOCK_GROUPS,
    FR_CODES,
    FR_FIELD_SHIFT,
    FR_GROUP,
    FR_LO_WORDS,
    FR_MAX_BASE,
    FR_POS_MASK,
    FR_TILE,
)
from .errors import CodecError, UnsupportedTensor

GROUP = FR_GROUP
TILE = FR_TILE
BLOCK_GROUPS = FR_BLOCK_GROUPS
BLOCK_TILES = BLOCK_GROUPS * GROUP // TILE   # tiles of an escape block
CODES = FR_CODES
POS_MASK = FR_POS_MASK
FIELD_SHIFT = FR_FIELD_SHIFT
ESCAPE_NBYTES = 2               # an escape's entry
MAX_BASE = FR_MAX_BASE          # choose_bases never goes higher
LO_WORDS = FR_LO_WORDS
_CHUNK_TILES = 1 << 14          # tiles per NumPy pass when choosing bases


@dataclass
class FixedRate:
    """One [rows, cols] weight in the fixed-rate form. Arrays are row-major, one row per weight row."""
    rows: int
    cols: int
    dtype: str                  # "bfloat16" or "float16": how the decoded words are read
    plane: np.ndarray           # uint8 [rows, groups * 32]: bits 0..6 of each word << 1 | its partner's sign
    lo: np.ndarray              # uint32 [rows, groups * 2]: code words c0, c1 (pack_codes)
    hi: np.ndarray              # uint32 [rows, groups]: code word c2
    tile: np.ndarray            # uint16 [rows, tiles]: base | escapes << 8; tile t covers groups 4t .. 4t + 3
    esc: np.ndarray             # uint16 [n_escapes]: position in the tile | field << 8, row-major weight order
    esc_start: np.ndarray       # int32 [rows, blocks]: index in esc of each block's first escape

    @property
    def groups(self) -> int:
        return self.plane.shape[1] // GROUP

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.plane, self.lo, self.hi, self.tile, self.esc, self.esc_start))


def groups_for(cols: int) -> int:
    return -(-cols // GROUP)


def tiles_for(cols: int) -> int:
    return -(-groups_for(cols) * GROUP // TILE)


def blocks_for(cols: int) -> int:
    return -(-groups_for(cols) // BLOCK_GROUPS)


def fixed_nbytes(rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] weight's form without its escapes (two bytes each, on top):
    plane 32 + codes 8 + 4 + tile words 2/4 + escape starts 4/32 bytes a group of 32 weights,
    about 0.697 of bf16."""
    ng = groups_for(cols)
    return rows * (ng * GROUP + ng * LO_WORDS * 4 + ng * 4 + 2 * tiles_for(cols) + blocks_for(cols) * 4)


# ---- the split of a word ---------------------------------------------------------------------
#   word  15 14 ........ 7 6 ...... 0
#          s [  field 8  ] [ low 7  ]      field = (w >> 7) & 0xFF
#   plane byte of weight i = low 7 of w_i << 1 | s of w_(i ^ 1)      (pairs 2j, 2j + 1 cross signs)
# A pair's 32-bit word (w_2j + w_2j+1 << 16) is then the plane and field bytes interleaved,
#   f_2j+1 << 24 | p_2j+1 << 16 | f_2j << 8 | p_2j, rotated right by one bit.

def split_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """words: 16-bit, an even count along the last axis (pairs) -> plane bytes, fields."""
    w = words.astype(np.uint16)
    return (((w & 0x7F) << 1) | _partners(w >> 15)).astype(np.uint8), ((w >> 7) & 0xFF).astype(np.uint8)


def join_words(plane: np.ndarray, field: np.ndarray) -> np.ndarray:
    p, f = plane.astype(np.uint16), field.astype(np.uint16)
    return (_partners(p & 1) << 15) | (f << 7) | (p >> 1)


def _partners(a: np.ndarray) -> np.ndarray:
    """a with the two entries of each pair (2j, 2j + 1) of its last axis swapped."""
    out = np.empty_like(a)
    out[..., 0::2], out[..., 1::2] = a[..., 1::2], a[..., 0::2]
    return out


# ---- choose the base of each group -----------------------------------------------------------

def choose_bases(field: np.ndarray, valid: np.ndarray, window: int = CODES) -> np.ndarray:
    """field, valid: [tiles, n]. base = the smallest b in [0, 256 - window] whose window
    [b, b + window - 1] covers the most real weights of the tile. (`window` other than 8 and n
    other than 128 are for bench/fixedrate_ratio.py's sweep.)"""
    out = np.empty(field.shape[0], np.uint8)
    for s in range(0, field.shape[0], _CHUNK_TILES):
        f, v = field[s:s + _CHUNK_TILES], valid[s:s + _CHUNK_TILES]
        at = (np.arange(f.shape[0])[:, None] * 256 + f)[v]
        hist = np.bincount(at, minlength=f.shape[0] * 256).reshape(-1, 256)
        cs = np.concatenate([np.zeros((f.shape[0], 1), np.int64), hist.cumsum(axis=1)], axis=1)
        cover = cs[:, window:] - cs[:, :257 - window]                    # cover[:, b] = sum hist[b : b + window]
        out[s:s + _CHUNK_TILES] = cover.argmax(axis=1)                   # the first maximum: the smallest b
    return out


# ---- pack / unpack the codes -----------------------------------------------------------------
#   weight i = 4q + b (q = 0..7 the u32 word of the plane, b = 0..3 its byte lane); a group's three
#   code words c0 = lo[0], c1 = lo[1], c2 = hi; byte lane b of each holds code bits of weights 4q + b:
#   q = 0..5:  word q // 2, bits 8b + 3(q % 2) .. +2  = the whole code (a mask and a shift-add a u32)
#   q = 6:     c0, bits 8b + 6 .. 8b + 7             = code bits 0..1; c1, bit 8b + 6 = code bit 2
#   q = 7:     c2, bits 8b + 6 .. 8b + 7             = code bits 0..1; c1, bit 8b + 7 = code bit 2

def _code_bits() -> tuple[np.ndarray, np.ndarray]:
    """Where bit k (0..2) of weight i's code lies: its word (0, 1: lo; 2: hi) and shift, [32, 3]."""
    i = np.arange(GROUP)[:, None]
    k = np.arange(3)[None, :]
    q, b = i // 4, i % 4
    whole = q < 6
    word = np.where(whole, q // 2, np.where(k < 2, 2 * (q - 6), 1))
    shift = 8 * b + np.where(whole, 3 * (q % 2) + k, np.where(k < 2, 6 + k, q))
    return word, shift.astype(np.uint32)


def pack_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes: uint8 [groups, 32] -> lo uint32 [groups, 2], hi uint32 [groups]."""
    word, shift = _code_bits()
    c = codes.astype(np.uint32)
    words = np.zeros((len(codes), LO_WORDS + 1), np.uint32)
    for k in range(3):
        bits = ((c >> k) & 1) << shift[:, k]                              # [g, 32]
        for w in range(LO_WORDS + 1):
            words[:, w] |= np.bitwise_or.reduce(bits[:, word[:, k] == w], axis=1)
    return words[:, :LO_WORDS], words[:, LO_WORDS]


def unpack_codes(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """lo [groups, 2], hi [groups] -> codes uint8 [groups, 32]."""
    word, shift = _code_bits()
    words = np.concatenate([lo, hi[:, None]], axis=1).astype(np.uint32)    # [g, 3]
    codes = np.zeros((len(words), GROUP), np.uint32)
    for k in range(3):
        codes |= ((words[:, word[:, k]] >> shift[:, k]) & 1) << k
    return codes.astype(np.uint8)


# ---- encoder and decoder ---------------------------------------------------------------------

def _as_words(weight: np.ndarray) -> np.ndarray:
    if weight.ndim != 2 or weight.dtype.itemsize != 2:
        raise UnsupportedTensor(None, f"the fixed-rate form takes a 2-D 16-bit weight, not {weight.dtype} {weight.shape}")
    return weight.view(np.uint16)


def encode(weight: np.ndarray, dtype: str = "bfloat16") -> FixedRate:
    """weight: a 2-D array of 16-bit words (bf16/fp16 bits viewed as uint16/int16) -> FixedRate."""
    words = _as_words(weight)
    rows, cols = words.shape
    ng, nt = groups_for(cols), tiles_for(cols)
    padded = np.zeros((rows, nt * TILE), np.uint16)
    padded[:, :cols] = words
    valid = np.zeros((rows, nt * TILE), bool)
    valid[:, :cols] = True
    plane, field = split_words(padded)
    base = choose_bases(field.reshape(-1, TILE), valid.reshape(-1, TILE)).reshape(rows, nt)
    delta = field.astype(np.int16) - np.repeat(base, TILE, axis=1)
    escaped = valid & ((delta < 0) | (delta >= CODES))
    codes = np.where(valid & ~escaped, delta, 0).astype(np.uint8)[:, :ng * GROUP]
    lo, hi = pack_codes(codes.reshape(-1, GROUP))
    counts = escaped.reshape(rows, nt, TILE).sum(axis=2)
    pos = np.broadcast_to(np.arange(nt * TILE, dtype=np.uint16) % TILE, escaped.shape)[escaped]
    esc = (pos | field[escaped].astype(np.uint16) << FIELD_SHIFT).astype(np.uint16)
    tile = (base.astype(np.uint16) | counts.astype(np.uint16) << 8).astype(np.uint16)
    return FixedRate(rows, cols, dtype, plane[:, :ng * GROUP], lo.reshape(rows, ng * LO_WORDS),
                     hi.reshape(rows, ng), tile, esc, _escape_starts(counts, rows, ng))


def _per_block(counts: np.ndarray, blocks: int) -> np.ndarray:
    """counts [rows, tiles] -> int64 [rows, blocks, BLOCK_TILES], the last block padded with 0."""
    padded = np.zeros((counts.shape[0], blocks * BLOCK_TILES), np.int64)
    padded[:, :counts.shape[1]] = counts
    return padded.reshape(counts.shape[0], blocks, BLOCK_TILES)


def _escape_starts(counts: np.ndarray, rows: int, ng: int) -> np.ndarray:
    """counts [rows, tiles] -> the index of each block's first entry (an exclusive prefix sum)."""
    nb = -(-ng // BLOCK_GROUPS)
    per_block = _per_block(counts, nb).sum(axis=2).reshape(-1)
    starts = np.cumsum(per_block) - per_block
    if per_block.sum() >= 2 ** 31:
        raise UnsupportedTensor(None, "too many escapes for int32 escape starts")
    return starts.astype(np.int32).reshape(rows, nb)


def tile_starts(fr: FixedRate) -> np.ndarray:
    """int64 [rows, tiles]: the index in esc of each tile's first entry, as a kernel finds it: its
    block's esc_start plus the counts of the block's tiles before it."""
    counts = (fr.tile >> 8).astype(np.int64)
    per_block = _per_block(counts, fr.esc_start.shape[1])
    within = np.cumsum(per_block, axis=2) - per_block + fr.esc_start[:, :, None]
    return within.reshape(fr.rows, per_block.shape[1] * BLOCK_TILES)[:, :counts.shape[1]]


def decode(fr: FixedRate) -> np.ndarray:
    """FixedRate -> uint16 [rows, cols], the exact words that were encoded."""
    codes = unpack_codes(fr.lo.reshape(-1, LO_WORDS), fr.hi.reshape(-1)).reshape(fr.rows, fr.plane.shape[1])
    base = (fr.tile & 0xFF).astype(np.uint16)
    field = np.repeat(base, TILE, axis=1)[:, :codes.shape[1]] + codes
    counts = (fr.tile >> 8).astype(np.int64).reshape(-1)
    starts = tile_starts(fr).reshape(-1)
    total = int(counts.sum())
    first = np.repeat(np.cumsum(counts) - counts, counts)
    idx = np.repeat(starts, counts) + np.arange(total) - first       # each entry's index in esc
    if total and (idx.min() < 0 or idx.max() >= fr.esc.size):
        raise CodecError(None, "escape index past the escape array")
    entries = fr.esc[idx].astype(np.int64)
    t = np.repeat(np.arange(counts.size), counts)                     # each entry's tile, row-major
    col = t % fr.tile.shape[1] * TILE + (entries & POS_MASK)
    if total and (col.max() >= codes.shape[1] or (entries & ~(POS_MASK | 0xFF << FIELD_SHIFT)).any()):
        raise CodecError(None, "an escape entry outside its row's groups")
    field[t // fr.tile.shape[1], col] = entries >> FIELD_SHIFT
    return join_words(fr.plane, field.astype(np.uint8))[:, :fr.cols]
