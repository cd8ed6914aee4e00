// Step functions of the float-codec ENCODER shared by the C++ twin (encode_float.cpp) and the CUDA
// kernels (encode_float.cu). They mirror the NumPy reference in codec/ step for step:
//   split planes (planes.split) -> count symbols (floatcodec._fine_counts) -> choose the tables
//   (floatcodec._cheapest: tables.normalize, tables.cost_fixed) -> pack the encode entries
//   (tables.pack_encode) -> encode lanes (rans.encode) -> assemble the stream (floatcodec._assemble).
//
// Read me first (the traps):
// * rANS is LIFO: encode_segment walks a segment's steps BACKWARDS, last step first, so that the
//   decoder, reading forwards, gets the symbols in order.
// * Word order: the decoder takes a step's words in increasing lane order, steps front to back. The
//   encoder writes each word at --ptr, steps last to first and lanes 31 down to 0: the words then
//   lie in the decoder's order in [ptr, end) with no reordering pass.
// * Costs are integers (bits * 2^kLog2FracBits, table Log2): a float log2 differs between libm,
//   NumPy's SIMD builds and CUDA in the last bit, and would choose different tables.
#pragma once
#include <cmath>
#include <cstdint>

#include "decode_common.h"
#include "wcodec_constants.h"

namespace wcodec {

constexpr int kFineTables = 1 << kMaxCtxBits;          // fine counts: one row per full context
constexpr int64_t kFineBins = kFineTables * 256;
constexpr int64_t kSegmentOverheadBits = 8 * (kStateBytes + 12 + kSegmentAlign / 2);   // floatcodec
constexpr int64_t kNever = INT64_MAX;

// ---- split planes (planes.split) ----------------------------------------------------------------
//  bf16  sym = exp[7:0]            hi = sign << 7 | man[6:0]
//  fp16  sym = the high byte       hi = the low byte
//  fp32  sym = exp[7:0]            hi = sign << 7 | man[22:16]     lo = man[15:0]
//  u8    sym = the byte (fp8 whole byte, GGUF and int8 planes)     no hi, no lo
WC_HD int element_bytes(int64_t dtype) { return dtype == kFP32 ? 4 : dtype == kU8 ? 1 : 2; }

WC_HD void split_element(int64_t dtype, const uint8_t* in, int64_t i, uint32_t& sym, uint32_t& hi, uint32_t& lo) {
  if (dtype == kU8) {
    sym = in[i], hi = 0, lo = 0;
  } else if (dtype == kFP32) {
    const uint32_t u = load_le<uint32_t>(in + 4 * i);
    sym = (u >> 23) & 0xFF, hi = ((u >> 24) & 0x80) | ((u >> 16) & 0x7F), lo = u & 0xFFFF;
  } else {
    const uint32_t u = load_le<uint16_t>(in + 2 * i);
    if (dtype == kFP16) sym = u >> 8, hi = u & 0xFF;
    else sym = (u >> 7) & 0xFF, hi = ((u >> 8) & 0x80) | (u & 0x7F);
    lo = 0;
  }
}

// Which fine-count row an element lands in: its context at kMaxCtxBits (0 for a byte plane).
WC_HD uint32_t fine_context(int64_t dtype, uint32_t hi) {
  return dtype == kU8 ? 0 : context(hi, kMaxCtxBits, dtype);
}

// ---- choose the tables (floatcodec._cheapest) ---------------------------------------------------
struct Log2Table {                    // Log2[f] = round(log2(f) * 2^kLog2FracBits), f in [1, M + 1]
  int64_t v[kProbScale + 2];
};

inline void build_log2(Log2Table& t) {
  t.v[0] = 0;
  for (uint32_t f = 1; f < kProbScale + 2; ++f)
    t.v[f] = std::llround(std::log2(static_cast<double>(f)) * static_cast<double>(int64_t{1} << kLog2FracBits));
}

struct Choice {                       // the cheapest parameters of a plane
  bool coded;
  int64_t ctx_bits, table_group, cost;
};

// The table-group sizes tried: {min(g, n_seg) for g in TABLE_GROUPS} | {n_seg}, ascending, unique.
inline int candidate_groups(int64_t n_seg, int64_t* out) {
  int k = 0;
  for (int64_t g : kTableGroups) {
    const int64_t v = g < n_seg ? g : n_seg;
    if (k == 0 || out[k - 1] != v) out[k++] = v;
  }
  if (out[k - 1] != n_seg) out[k++] = n_seg;
  return k;
}

WC_HD int64_t serialized_size(const uint32_t* f) {       // tables.serialized_size
  int64_t k = 0;
  for (int s = 0; s < 256; ++s) k += f[s] != 0;
  return kTableBitmapBytes + ((2 * k + 3) / 4) * 4;
}

// ---- pack the encode entries (tables.pack_encode) and encode lanes (rans.encode) ---------------
struct EncodeEntry {                  // one symbol of one table
  uint32_t freq, cum;
  uint64_t rcp;                       // ceil(2^44 / freq): x / freq = (x * rcp) >> 44 for x < 2^32
};

inline void pack_encode(const uint32_t* f, EncodeEntry* out) {
  uint32_t cum = 0;
  for (int s = 0; s < 256; ++s) {
    const uint64_t rcp = f[s] ? ((uint64_t{1} << 44) + f[s] - 1) / f[s] : 0;
    out[s] = EncodeEntry{f[s], cum, rcp}, cum += f[s];
  }
}

// One encoder step of one lane: emit a word if x would overflow, then x = C(s, x).
//   emit  while x >= f << (32 - P): *--ptr = x & 0xFFFF, x >>= 16     (once at most, L = 2^16)
//   x = ((x / f) << P) + (x % f) + cum
WC_HD bool rans_emits(uint32_t x, const EncodeEntry& e) { return (x >> (32 - kProbBits)) >= e.freq; }

WC_HD uint32_t rans_encode_state(uint32_t x, const EncodeEntry& e) {       // x = C(s, x), x < f << 16
#ifdef __CUDA_ARCH__
  const uint32_t q = static_cast<uint32_t>(__umul64hi(static_cast<uint64_t>(x) << 20, e.rcp));
#else
  const uint32_t q = static_cast<uint32_t>((static_cast<unsigned __int128>(x) * e.rcp) >> 44);
#endif
  return (q << kProbBits) + (x - q * e.freq) + e.cum;
}

// Branch-free on the CPU: the word is always stored below ptr and ptr moves only if it counts (the
// caller leaves a lane's worth of room below each segment's words). The kernel places its words
// with a ballot instead (encode_float.cu).
inline void rans_encode_step(uint32_t& x, const EncodeEntry& e, uint16_t*& ptr) {
  const uint32_t emit = rans_emits(x, e);
  ptr[-1] = static_cast<uint16_t>(x & 0xFFFF);
  ptr -= emit;
  x = rans_encode_state(x >> (emit * kRenormBits), e);
}

// ---- assemble the stream (floatcodec._assemble) -------------------------------------------------
//  u64 seg_offset[n_seg] | u32 seg_words[n_seg] | u32 table_offset[n_tables + 1] | tables | segments
WC_HD int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }
WC_HD int64_t segment_bytes(int64_t words) { return align_up(kStateBytes + 2 * words, kSegmentAlign); }
WC_HD int64_t exp_directory_bytes(int64_t n_seg, int64_t n_tables) { return 12 * n_seg + 4 * (n_tables + 1); }

// Serialise one table (tables.serialize): bitmap, u16 freq of each present symbol, zero pad to 4.
inline int64_t serialize_table(const uint32_t* f, uint8_t* out) {
  for (int b = 0; b < kTableBitmapBytes; ++b) out[b] = 0;
  int64_t pos = kTableBitmapBytes;
  for (int s = 0; s < 256; ++s) {
    if (!f[s]) continue;
    out[s / 8] |= static_cast<uint8_t>(1u << (s % 8));
    out[pos] = f[s] & 0xFF, out[pos + 1] = f[s] >> 8;
    pos += 2;
  }
  while (pos % 4) out[pos++] = 0;
  return pos;
}

}  // namespace wcodec
