// The rANS decode table of one frequency table, built by one warp in shared memory: shared by
// the CUDA decoders (decode_float.cu, decode_quant.cu). Device code only.
#pragma once
#include <cstdint>

#include "decode_common.h"

namespace wcodec {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// ---- build the decode table (warp-parallel) ------------------------------------------------------
// Lane l owns symbols [8l, 8l + 8): their presence bits are byte l of the bitmap. The warp scans
// frequencies into cum[257] (scratch), then each lane fills 128 consecutive slots, walking the
// symbols. Returns kOk / kTable; an unused (all-zero) table becomes the identity.
__device__ inline int build_decode_table(const uint8_t* exp, const TensorDesc& d, int64_t j, uint32_t* lut,
                                  uint32_t* cum_s) {
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
  if (total == 0) {                                                  // identity: x stays x
    for (uint32_t slot = lane; slot < kProbScale; slot += 32) lut[slot] = lut_entry(kProbScale, 0, slot);
    __syncwarp();
    return kOk;
  }
  for (int k = 0; k < 8; ++k) cum_s[8 * lane + k] = cum, cum += freq[k];
  if (lane == 0) cum_s[256] = kProbScale;
  __syncwarp();
  // The symbol owning a slot is the last s with cum[s] <= slot: an absent symbol shares its cum
  // with the next one, so the walk never stops on it.
  uint32_t slot = (kProbScale / 32) * lane, s = 0;
  for (uint32_t lo = 0, hi = 255; lo < hi;) {
    const uint32_t mid = (lo + hi + 1) >> 1;
    if (cum_s[mid] <= slot) lo = mid; else hi = mid - 1;
    s = lo;
  }
  for (int k = 0; k < static_cast<int>(kProbScale / 32); ++k, ++slot) {
    while (cum_s[s + 1] <= slot) ++s;
    const uint32_t c = cum_s[s];
    lut[slot] = lut_entry(cum_s[s + 1] - c, s, slot - c);
  }
  __syncwarp();
  return kOk;
}

}  // namespace wcodec
