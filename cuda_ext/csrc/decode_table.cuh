// The rANS decode table of one frequency table, built by one warp in shared memory: shared by
// the CUDA decoders (decode_float.cu, decode_quant.cu). Device code only.
#pragma once
#include <cstdint>

#include "decode_common.h"

namespace wcodec {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// ---- build the decode table ---------------------------------------------------------------------
// Two steps, so that a whole block can share the work of filling 4096 slots a table:
// parse_cum (one warp a table) reads the bitmap and frequencies into cum[257]; fill_region (any
// warp) writes a run of slots. Lane l owns symbols [8l, 8l + 8): their presence bits are byte l of the
// bitmap. Returns kOk / kTable; an unused (all-zero) table becomes the identity (symbol 0 owns all M
// slots, so x stays x).
__device__ inline int parse_cum(const uint8_t* exp, const TensorDesc& d, int64_t j, uint32_t* cum_s) {
  const int lane = threadIdx.x & 31;
  const int64_t base = 12 * segment_count(d);
  const int64_t start = load_le<uint32_t>(exp + base + 4 * j);
  const int64_t end = load_le<uint32_t>(exp + base + 4 * (j + 1));
  bool ok = start >= directory_bytes(d) && end >= start + kTableBitmapBytes && end <= d.exp_len;
  const uint32_t bits = ok ? exp[start + lane] : 0u;
  uint32_t before = __popc(bits);                                    // exclusive scan of counts
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(kFullMask, before, o);
    if (lane >= o) before += v;
  }
  before -= __popc(bits);
  uint32_t freq[8], sum = 0;
  for (int k = 0, seen = 0; k < 8; ++k) {
    freq[k] = 0;
    if (!((bits >> k) & 1)) continue;
    const int64_t pos = start + kTableBitmapBytes + 2 * (before + seen++);
    if (pos + 2 > end) { ok = false; continue; }
    freq[k] = load_le<uint16_t>(exp + pos);
    ok = ok && freq[k] != 0;
    sum += freq[k];
  }
  uint32_t cum = sum;                                                // exclusive scan of sums
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(kFullMask, cum, o);
    if (lane >= o) cum += v;
  }
  const uint32_t total = __shfl_sync(kFullMask, cum, 31);
  cum -= sum;
  ok = __all_sync(kFullMask, ok) && (total == kProbScale || total == 0);
  if (!ok) return kTable;
  for (int k = 0; k < 8; ++k) {
    cum_s[8 * lane + k] = total ? cum : (lane || k ? kProbScale : 0u);
    cum += freq[k];
  }
  if (lane == 0) cum_s[256] = kProbScale;
  __syncwarp();
  return kOk;
}

// Slots [a, b) of the table whose cum[257] parse_cum wrote, filled by one warp (a and b warp-
// uniform). The symbol owning a slot is the last s with cum[s] <= slot (an absent symbol shares
// its cum with the next one, so it owns none); within s's run an entry is `base + slot`. The warp
// walks the runs that meet [a, b) in order, its lanes writing 32 consecutive slots at a time
// (conflict-free): a run costs a few uniform instructions and its slots one add and one store each.
// (Before, each thread filled its own 32 slots and searched for their symbols: the warps diverged
// on every run's end, and the fill cost 2.5 instructions a decoded step, ncu.)
__device__ inline void fill_region(const uint32_t* cum_s, uint32_t* lut, uint32_t a, uint32_t b) {
  const uint32_t lane = threadIdx.x & 31;
  uint32_t s = 0;
  for (uint32_t hi = 255; s < hi;) {                                 // the symbol owning slot a
    const uint32_t mid = (s + hi + 1) >> 1;
    if (cum_s[mid] <= a) s = mid; else hi = mid - 1;
  }
  for (; a < b; ++s) {
    const uint32_t c = cum_s[s], cn = cum_s[s + 1];
    if (cn <= a) continue;                                           // absent: an empty run
    const uint32_t end = cn < b ? cn : b, base = lut_entry(cn - c, s, 0) - c;
    for (uint32_t slot = a + lane; slot < end; slot += 32) lut[slot] = base + slot;
    a = end;
  }
}

// One warp parses and fills a whole table (the byte-plane decoder, decode_quant.cu).
__device__ inline int build_decode_table(const uint8_t* exp, const TensorDesc& d, int64_t j, uint32_t* lut,
                                         uint32_t* cum_s) {
  const int st = parse_cum(exp, d, j, cum_s);
  if (st != kOk) return st;
  fill_region(cum_s, lut, 0, kProbScale);
  __syncwarp();
  return kOk;
}

}  // namespace wcodec
