// The rANS decode table of one frequency table, built by one warp in shared memory: shared by
// the CUDA decoders (decode_float.cu, decode_quant.cu). Device code only.
#pragma once
#include <cstdint>

#include "decode_common.h"

namespace wcodec {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// ---- build the decode table ---------------------------------------------------------------------
// Two steps, so that a whole block can share the work of filling 4096 slots a table:
// parse_cum (one warp a table) reads the bitmap and frequencies into cum[257]; fill_lut (any thread)
// writes a run of slots. Lane l owns symbols [8l, 8l + 8): their presence bits are byte l of the
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

// Slots [a, b) of the table whose cum[257] parse_cum wrote (b - a a multiple of 4, a 16-byte
// aligned lut + a). The symbol owning a slot is the last s with cum[s] <= slot: an absent symbol
// shares its cum with the next one, so the walk never stops on it. Within one symbol's run an entry
// is `base + slot`, so a group of 4 slots inside one run (nearly all: a table holds a few dozen
// runs) costs four adds and one 16-byte store; a group that crosses a run's end walks slot by slot.
__device__ __forceinline__ void fill_slots(const uint32_t* cum_s, uint32_t* lut, uint32_t a, uint32_t b) {
  if (a >= b) return;
  uint32_t lo = 0;
  for (uint32_t hi = 255; lo < hi;) {
    const uint32_t mid = (lo + hi + 1) >> 1;
    if (cum_s[mid] <= a) lo = mid; else hi = mid - 1;
  }
  uint32_t s = lo, c = cum_s[s], cn = cum_s[s + 1];
  uint32_t base = lut_entry(cn - c, s, 0) - c;
  for (uint32_t slot = a; slot < b; slot += 4) {
    uint4 v;
    if (slot + 4 <= cn) {
      v = make_uint4(base + slot, base + slot + 1, base + slot + 2, base + slot + 3);
    } else {
      uint32_t e[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        while (slot + k >= cn) {
          c = cn, cn = cum_s[++s + 1];
          base = lut_entry(cn - c, s, 0) - c;
        }
        e[k] = base + slot + k;
      }
      v = make_uint4(e[0], e[1], e[2], e[3]);
    }
    *reinterpret_cast<uint4*>(lut + slot) = v;
  }
}

// A thread's run [a, b) of slots (b - a a multiple of 4), written from its (thread % groups)-th group
// of 4 slots on, then the groups before it: neighbouring threads' runs lie a multiple of 32 banks
// apart, so starting them all at their first group made every 16-byte store of a warp hit the same
// 4 banks (ncu: 30-way conflicts, the block waiting on its tables at the barrier).
__device__ __forceinline__ void fill_lut(const uint32_t* cum_s, uint32_t* lut, uint32_t a, uint32_t b) {
  const uint32_t mid = a + 4 * (threadIdx.x % ((b - a) / 4));
  fill_slots(cum_s, lut, mid, b);
  fill_slots(cum_s, lut, a, mid);
}

// One warp parses and fills a whole table (the byte-plane decoder, decode_quant.cu).
__device__ inline int build_decode_table(const uint8_t* exp, const TensorDesc& d, int64_t j, uint32_t* lut,
                                         uint32_t* cum_s) {
  const int st = parse_cum(exp, d, j, cum_s);
  if (st != kOk) return st;
  const uint32_t lane = threadIdx.x & 31, run = kProbScale / 32;
  fill_lut(cum_s, lut, lane * run, (lane + 1) * run);
  __syncwarp();
  return kOk;
}

}  // namespace wcodec
