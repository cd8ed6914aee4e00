// Step functions shared by the C++ twin (decode_float.cpp) and the CUDA kernels
// (decode_float.cu). They mirror the NumPy reference in codec/ step for step:
//   read the directory (floatcodec.parse_exp) -> build the decode table (tables.parse/build_lut)
//   -> decode lanes (rans.decode) -> join planes (planes.join).
// Every read of archive data is bounds-checked here; a bad stream yields a Status, never a trap.
#pragma once
#include <cstdint>
#include <cstring>

#include "wcodec_constants.h"

#ifdef __CUDACC__
#define WC_HD __host__ __device__ __forceinline__
#else
#define WC_HD inline
#endif

namespace wcodec {

struct TensorDesc {             // one row of the int64 descriptor (DescField order)
  int64_t exp_off, exp_len, hi_off, lo_off, numel, ctx_bits, table_group, dtype, first_segment;
};

WC_HD TensorDesc load_desc(const int64_t* row) {
  return TensorDesc{row[kDescExpOff], row[kDescExpLen], row[kDescHiOff], row[kDescLoOff],
                    row[kDescNumel], row[kDescCtxBits], row[kDescTableGroup], row[kDescDtype],
                    row[kDescFirstSegment]};
}

WC_HD int64_t segment_count(const TensorDesc& d) { return (d.numel + kSegmentSymbols - 1) / kSegmentSymbols; }
WC_HD int64_t table_count(const TensorDesc& d) {
  return ((segment_count(d) + d.table_group - 1) / d.table_group) << d.ctx_bits;
}
WC_HD int64_t directory_bytes(const TensorDesc& d) { return 12 * segment_count(d) + 4 * (table_count(d) + 1); }

// Unaligned little-endian loads (x86 and CUDA are little-endian; memcpy keeps them legal).
template <typename T>
WC_HD T load_le(const uint8_t* p) {
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}

// ---- read the directory: where segment `seg` of a tensor lives in its exp stream ---------------
struct SegmentRef {
  int64_t data;      // byte offset of the segment (its 32 states) from the stream start
  int64_t words;     // 16-bit words that follow the states
  int64_t symbols;   // symbols of this segment
  int64_t table0;    // index of the first table of its set
};

// Returns kOk or kDirectory. `exp` is the stream, `len` its length.
WC_HD int read_segment(const uint8_t* exp, int64_t len, const TensorDesc& d, int64_t seg, SegmentRef* out) {
  const int64_t nseg = segment_count(d);
  if (d.exp_len < directory_bytes(d)) return kDirectory;
  const uint64_t off = load_le<uint64_t>(exp + 8 * seg);
  const int64_t words = load_le<uint32_t>(exp + 8 * nseg + 4 * seg);
  const int64_t tables_end = load_le<uint32_t>(exp + 12 * nseg + 4 * table_count(d));
  if (off > static_cast<uint64_t>(len) || off % kSegmentAlign != 0 ||
      static_cast<int64_t>(off) < tables_end || static_cast<int64_t>(off) + kStateBytes + 2 * words > len)
    return kDirectory;
  if (seg > 0) {  // in order, none overlapping the one before (codec/floatcodec.py _check_segments)
    const uint64_t prev = load_le<uint64_t>(exp + 8 * (seg - 1));
    const int64_t prev_words = load_le<uint32_t>(exp + 8 * nseg + 4 * (seg - 1));
    if (prev > off || static_cast<int64_t>(off - prev) < kStateBytes + 2 * prev_words) return kDirectory;
  }
  out->data = static_cast<int64_t>(off);
  out->words = words;
  out->symbols = (seg + 1 < nseg) ? kSegmentSymbols : d.numel - seg * kSegmentSymbols;
  out->table0 = (seg / d.table_group) << d.ctx_bits;
  return kOk;
}

// ---- units: what one warp (CUDA) or one task (C++) decodes ---------------------------------------
// kBulk / kRecord: unit u = segment u. kIndexed: unit u = piece u (codec/resident.py: segment
// u / P, steps [sub * K, min((sub + 1) * K, segment steps)), sub = u % P, P = kSegmentSteps / K).
struct Unit {
  int64_t seg;          // segment of the tensor
  int64_t t0, t1;       // steps [t0, t1) of that segment; empty when t0 >= t1
  int64_t entry;        // global index entry it starts from; -1: the segment's own stored states
                        // (every segment's first piece, so that each entry read is also checked
                        // as the end of the piece before it)
  int64_t end_entry;    // kIndexed: global entry it must end at; -1: at L, with every word used
  int64_t status;       // where its status goes
};

WC_HD int64_t pieces_per_segment(int64_t mode, int64_t entry_steps) {
  return mode == kIndexed ? kSegmentSteps / entry_steps : 1;
}
WC_HD int64_t unit_count(const TensorDesc& d, int64_t mode, int64_t entry_steps) {
  return segment_count(d) * pieces_per_segment(mode, entry_steps);
}
WC_HD int64_t segment_symbols(const TensorDesc& d, int64_t seg) {
  const int64_t rest = d.numel - seg * kSegmentSymbols;
  return rest < kSegmentSymbols ? rest : kSegmentSymbols;
}
WC_HD Unit unit_of(const TensorDesc& d, int64_t mode, int64_t entry_steps, int64_t u) {
  const int64_t per = pieces_per_segment(mode, entry_steps);
  const int64_t seg = u / per, sub = u % per;
  const int64_t steps = (segment_symbols(d, seg) + kLanes - 1) / kLanes;
  if (mode != kIndexed) return Unit{seg, 0, steps, -1, -1, d.first_segment + u};
  const int64_t t0 = sub * entry_steps, t1 = t0 + entry_steps < steps ? t0 + entry_steps : steps;
  const int64_t entry = d.first_segment * per + u;
  return Unit{seg, t0, t1, sub ? entry : -1, (sub + 1 < per && t1 < steps) ? entry + 1 : -1, entry};
}
// kRecord: the global index entry before step t (a multiple of entry_steps) of segment seg.
WC_HD int64_t record_entry(const TensorDesc& d, int64_t entry_steps, int64_t seg, int64_t t) {
  return (d.first_segment + seg) * (kSegmentSteps / entry_steps) + t / entry_steps;
}

// ---- build the decode table --------------------------------------------------------------------
// Table j's frequencies: bitmap of present symbols, then a u16 per present symbol.
// Writes freq[256]; returns kOk or kTable. Checks the table lies inside [dir_end, tables_end).
WC_HD int parse_table(const uint8_t* exp, int64_t len, const TensorDesc& d, int64_t j, uint32_t* freq) {
  const int64_t base = 12 * segment_count(d);
  const int64_t start = load_le<uint32_t>(exp + base + 4 * j);
  const int64_t end = load_le<uint32_t>(exp + base + 4 * (j + 1));
  if (start < directory_bytes(d) || end < start || end > len || end - start < kTableBitmapBytes) return kTable;
  int64_t pos = start + kTableBitmapBytes;
  uint32_t sum = 0;
  for (int s = 0; s < 256; ++s) {
    const bool present = (exp[start + s / 8] >> (s % 8)) & 1;
    freq[s] = 0;
    if (!present) continue;
    if (pos + 2 > end) return kTable;
    freq[s] = load_le<uint16_t>(exp + pos);
    pos += 2;
    if (freq[s] == 0) return kTable;
    sum += freq[s];
  }
  return (sum == kProbScale || sum == 0) ? kOk : kTable;
}

// The packed decode-table entry of tables.build_lut: (freq - 1) << 20 | sym << 12 | (slot - cum).
// One step is then one load: x = (freq - 1 + 1) * (x >> P) + bias.
constexpr int kLutSymShift = kProbBits, kLutFreqShift = kProbBits + 8;
WC_HD constexpr uint32_t lut_entry(uint32_t freq, uint32_t sym, uint32_t bias) {
  return ((freq - 1) << kLutFreqShift) | (sym << kLutSymShift) | bias;
}
WC_HD uint32_t rans_step_packed(uint32_t v, uint32_t& x) {
  x = ((v >> kLutFreqShift) + 1) * (x >> kProbBits) + (v & (kProbScale - 1));
  return (v >> kLutSymShift) & 0xFF;
}

// Decode table of one frequency table, as the C++ decoder holds it: the symbol owning
// each slot (u8, M entries) and, per symbol, freq << 16 | cum -- 5 KiB a table, which the AVX-512
// step and the quant twin read (two dependent loads) -- and the packed entry of each slot
// (lut_entry, as the NumPy reference and the kernels hold it, 16 KiB), which the scalar step reads
// with one load and the AVX2 step with one gather instead of two dependent ones: on this
// project's AVX2 EPYC that took the AVX2 twin from 1.10 to 1.56-1.59 GB/s a thread and the scalar
// one from 0.31 to 0.36 (bench/cpu_twin.py). All compute the same step. An all-zero table decodes
// as the identity (one symbol owning all M slots).
struct DecodeTable {
  uint8_t sym[kProbScale];
  uint32_t freq_cum[256];
  uint32_t packed[kProbScale];
};

// The launch plan's row of kernel block b: the last row whose first block is <= b (firsts ascending).
WC_HD int64_t plan_row(const int64_t* firsts, int64_t n, int64_t b) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (firsts[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Build the decode table of frequency table j (the C++ twins; the kernels build theirs with a warp,
// decode_table.cuh). An unused (all-zero) table becomes the identity.
inline int build_decode_table(const uint8_t* exp, const TensorDesc& d, int64_t j, DecodeTable& t) {
  uint32_t freq[256];
  const int st = parse_table(exp, d.exp_len, d, j, freq);
  if (st != kOk) return st;
  uint32_t cum = 0;
  for (uint32_t s = 0; s < 256; ++s) {
    memset(t.sym + cum, static_cast<int>(s), freq[s]);
    t.freq_cum[s] = (freq[s] << 16) | cum;
    for (uint32_t k = 0; k < freq[s]; ++k) t.packed[cum + k] = lut_entry(freq[s], s, k);
    cum += freq[s];
  }
  if (cum == 0) {
    memset(t.sym, 0, kProbScale);
    t.freq_cum[0] = kProbScale << 16;
    for (uint32_t slot = 0; slot < kProbScale; ++slot) t.packed[slot] = lut_entry(kProbScale, 0, slot);
  }
  return kOk;
}

// ---- decode lanes: one rANS step ---------------------------------------------------------------
// x = D(x): s = sym[x mod M];  x = freq[s] * (x >> P) + (x mod M) - cum[s].  Returns s; the
// caller renormalises (x < L -> x = x << 16 | next word).
WC_HD uint32_t rans_step(const uint8_t* sym, const uint32_t* freq_cum, uint32_t& x) {
  const uint32_t slot = x & (kProbScale - 1);
  const uint32_t s = sym[slot];
  const uint32_t fc = freq_cum[s];
  x = (fc >> 16) * (x >> kProbBits) + slot - (fc & 0xFFFF);
  return s;
}

// The context table of an element: the top ctx_bits mantissa bits held in its hi byte.
WC_HD constexpr uint32_t context(uint32_t hi, int64_t ctx_bits, int64_t dtype) {
  const int top = (dtype == kFP16) ? 7 : 6;
  return ctx_bits ? (hi >> (top + 1 - ctx_bits)) & ((1u << ctx_bits) - 1) : 0;
}

// ---- join planes (planes.join) -------------------------------------------------------------------
WC_HD constexpr uint16_t join16(int64_t dtype, uint32_t sym, uint32_t hi) {
  if (dtype == kFP16) return static_cast<uint16_t>((sym << 8) | hi);
  return static_cast<uint16_t>(((hi & 0x80) << 8) | (sym << 7) | (hi & 0x7F));   // bf16
}
WC_HD uint32_t join32(uint32_t sym, uint32_t hi, uint32_t lo) {
  return ((hi & 0x80) << 24) | (sym << 23) | ((hi & 0x7F) << 16) | lo;
}

}  // namespace wcodec
