// The fixed-rate GPU form (codec/fixedrate.py, docs/FORMAT.md §6): constants and the per-group
// steps shared by the C++ twin (fixedrate.cpp) and the kernels (fixedrate.cu). The Python module is
// the specification; each function here names the step it mirrors. The constants mirror
// codec/constants.py's FR_* (tests/cuda_ext/test_fixedrate_twin.py checks them).
//
//   word  15 14 ........ 7 6 ...... 0
//          s [  field 8  ] [ low 7  ]      field = (w >> 7) & 0xFF
//   plane byte of weight i = low 7 of w_i << 1 | s of w_(i ^ 1): a pair's signs cross, so that its
//   32-bit word is its bytes interleaved (f1 p1 f0 p0) rotated right by one bit (join4 in fixedrate_gemv.cuh)
//   weight i = 4q + b of a group, its code words c0 = lo[0], c1 = lo[1], c2 = hi (byte lane b):
//     q = 0..5:  c[q / 2] bits 8b + 3(q % 2) .. +2 = the code
//     q = 6:     c0 bits 8b + 6 .. 8b + 7          = code bits 0..1;  c1 bit 8b + 6 = code bit 2
//     q = 7:     c2 bits 8b + 6 .. 8b + 7          = code bits 0..1;  c1 bit 8b + 7 = code bit 2
//   field = base + code (code 0..7); a field outside the tile's window [base, base + 7] is an escape:
//   code 0, and an entry (position in the tile | field << 8) in the tile's run of the escape array.
//   tile word = base | escapes << 8.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FR_HD __host__ __device__ __forceinline__
#else
#define FR_HD inline
#endif

namespace wcodec {

constexpr int kFrGroup = 32;          // GROUP: weights per group (one thread of the fused kernel)
constexpr int kFrTile = 128;          // TILE: weights sharing one base
constexpr int kFrTileGroups = kFrTile / kFrGroup;
constexpr int kFrBlockGroups = 32;    // BLOCK_GROUPS: groups per escape block (one warp)
constexpr int kFrCodes = 8;           // CODES: the window of fields a base covers
constexpr int kFrMaxBase = 248;       // MAX_BASE = 256 - CODES
constexpr int kFrPosMask = 0x7F;      // POS_MASK: an escape entry's position in its tile
constexpr int kFrFieldShift = 8;      // FIELD_SHIFT: an escape entry's field
constexpr int kFrBlockTiles = kFrBlockGroups / kFrTileGroups;
constexpr int kFrLoWords = 2;         // LO_WORDS
constexpr int kFrMaxRows = 64;        // rows of x the fused op takes (the tensor-core kernel)

// split_words: the plane byte of a word (its pair partner gives the sign bit) and its field.
FR_HD uint8_t fr_plane_byte(uint16_t w, uint16_t partner) {
  return static_cast<uint8_t>(((w & 0x7F) << 1) | (partner >> 15));
}
FR_HD uint8_t fr_field(uint16_t w) { return static_cast<uint8_t>((w >> 7) & 0xFF); }

// join_words: the word back from its plane byte, its partner's plane byte and its field.
FR_HD uint16_t fr_join(uint32_t p, uint32_t partner, uint32_t f) {
  return static_cast<uint16_t>(((partner & 1) << 15) | ((f & 0xFF) << 7) | ((p >> 1) & 0x7F));
}

// unpack_codes + base, 4 at a time: the fields of weights 4q .. 4q + 3, one per byte lane (base4: the
// tile's base in every byte; an escaped weight's field is base + 0). A whole code is a mask and a
// shift-add (LOP3, LEA.HI: two instructions for 4 fields; the layout of 2026-11-28 kept bits 0..1
// and bit 2 of every code in different words and took five). Codes 6 and 7 take their bit 2 from c1
// (from c2, the 33-40-row kernel spilled 40 bytes at its 168 registers).
FR_HD uint32_t fr_fields4(uint32_t c0, uint32_t c1, uint32_t c2, int q, uint32_t base4) {
  const uint32_t c = q < 2 ? c0 : q < 4 ? c1 : c2;
  switch (q) {
    case 0: case 2: case 4: return base4 + (c & 0x07070707u);
    case 1: case 3: case 5: return base4 + ((c & 0x38383838u) >> 3);
    case 6: return base4 + ((c0 & 0xC0C0C0C0u) >> 6) + ((c1 & 0x40404040u) >> 4);
    default: return base4 + ((c2 & 0xC0C0C0C0u) >> 6) + ((c1 & 0x80808080u) >> 5);
  }
}

// choose_bases, one tile of n real words: the smallest b in [0, 248] whose window [b, b + 7]
// covers the most fields (a histogram, then a sliding window sum).
FR_HD uint32_t fr_choose_base(const uint16_t* w, int n) {
  uint8_t hist[256];
  for (int i = 0; i < 256; ++i) hist[i] = 0;
  for (int i = 0; i < n; ++i) ++hist[fr_field(w[i])];             // n <= 128: no overflow
  int cover = 0, best_cover = -1;
  uint32_t best = 0;
  for (int i = 0; i < kFrCodes - 1; ++i) cover += hist[i];
  for (int b = 0; b <= kFrMaxBase; ++b) {
    cover += hist[b + kFrCodes - 1];                               // cover = sum hist[b .. b + 7]
    if (cover > best_cover) best_cover = cover, best = static_cast<uint32_t>(b);
    cover -= hist[b];
  }
  return best;
}

// Whether a field escapes its tile's window.
FR_HD bool fr_escapes(uint32_t field, uint32_t base) {
  return field - base >= static_cast<uint32_t>(kFrCodes);         // wraps when field < base
}

// pack_codes, one weight: its code's bits into the group's code words (c[0], c[1]: lo; c[2]: hi).
FR_HD void fr_pack_code(uint32_t code, int i, uint32_t (&c)[kFrLoWords + 1]) {
  const int q = i >> 2, lane = 8 * (i & 3);
  if (q < 6) {
    c[q >> 1] |= code << (lane + 3 * (q & 1));
  } else {
    c[q == 6 ? 0 : 2] |= (code & 3u) << (lane + 6);
    c[1] |= (code >> 2) << (lane + q);
  }
}

// encode, one group (n real words, the rest padding) given its tile's base: plane bytes and
// packed codes (an escape's code is 0); returns its escape count.
FR_HD int fr_encode_group(const uint16_t* w, int n, uint32_t base, uint8_t* plane, uint32_t* lo, uint32_t* hi) {
  uint32_t cw[kFrLoWords + 1] = {0, 0, 0};
  int escapes = 0;
  for (int i = 0; i < kFrGroup; ++i) {
    const uint32_t f = i < n ? fr_field(w[i]) : base;                 // padding: code 0, plane byte 0
    const bool esc = fr_escapes(f, base);
    const uint32_t code = esc ? 0u : f - base;
    plane[i] = fr_plane_byte(i < n ? w[i] : 0, (i ^ 1) < n ? w[i ^ 1] : 0);   // padding: 0 but a sign
    fr_pack_code(code, i, cw);
    escapes += esc;
  }
  lo[0] = cw[0], lo[1] = cw[1], *hi = cw[2];
  return escapes;
}

// encode, one tile of a row (n real words, up to 4 groups): plane bytes, codes and its word (base |
// escapes << 8). The entries are written apart (fr_tile_entries), once the tile's first is known.
FR_HD void fr_encode_tile(const uint16_t* w, int64_t n, int groups_left, uint8_t* plane, uint32_t* lo, uint32_t* hi,
                          uint16_t* tile) {
  const uint32_t b = fr_choose_base(w, static_cast<int>(n));
  int escapes = 0;
  for (int j = 0; j < kFrTileGroups && j < groups_left; ++j) {
    const int64_t left = n - j * kFrGroup;
    escapes += fr_encode_group(w + j * kFrGroup, static_cast<int>(left < kFrGroup ? left : kFrGroup), b,
                               plane + j * kFrGroup, lo + j * kFrLoWords, hi + j);
  }
  *tile = static_cast<uint16_t>(b | static_cast<uint32_t>(escapes) << 8);
}

// The index in esc of tile t's first entry in row r: its block's start plus the counts of the
// block's tiles before it (the tile words hold the counts in bits 8..15).
FR_HD int64_t fr_tile_start(const int32_t* esc_start, const uint16_t* tile, int64_t r, int64_t tiles, int64_t blocks,
                            int64_t t) {
  int64_t first = esc_start[r * blocks + t / kFrBlockTiles];
  for (int64_t s = t - t % kFrBlockTiles; s < t; ++s) first += tile[r * tiles + s] >> 8;
  return first;
}

// The entries of one tile (n real words, its base), in position order, from esc.
FR_HD void fr_tile_entries(const uint16_t* w, int64_t n, uint32_t base, uint16_t* esc) {
  for (int i = 0; i < n; ++i) {
    const uint32_t f = fr_field(w[i]);
    if (fr_escapes(f, base)) *esc++ = static_cast<uint16_t>(static_cast<uint32_t>(i) | f << kFrFieldShift);
  }
}

}  // namespace wcodec
