// The C++ CPU twin of the float-codec decoder, and the op's schema.
// Mirrors codec/ (NumPy) step for step; decode_float.cu is its CUDA twin. On a CPU one thread
// decodes a whole segment: within a step the 32 lanes take words in lane order, and steps follow
// each other, so the word stream is simply read front to back.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define WCODEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,popcnt")))
#define WCODEC_AVX2 __attribute__((target("avx2,popcnt")))
#endif

#include "decode_common.h"

namespace wcodec {

// Build the decode tables of one table set (2^ctx_bits tables).
static int build_decode_tables(const uint8_t* exp, const TensorDesc& d, int64_t table0,
                               std::vector<DecodeTable>& set) {
  set.resize(size_t{1} << d.ctx_bits);
  for (size_t c = 0; c < set.size(); ++c) {
    const int st = build_decode_table(exp, d, table0 + static_cast<int64_t>(c), set[c]);
    if (st != kOk) return st;
  }
  return kOk;
}

// Decode one step (32 lanes, or fewer at a segment's end) and join the planes. `Checked` bounds
// every word read; the fast path is taken only when a whole step cannot run past the words.
template <int Dtype, int CtxBits, bool Checked, typename Word>
static inline void decode_step(int lanes, const uint8_t* hi, const uint8_t* lo, const DecodeTable* set,
                               const uint8_t* words, int64_t n_words, int64_t& used, uint32_t* x, Word* out) {
  for (int l = 0; l < lanes; ++l) {
    const uint32_t h = hi[l];
    const DecodeTable& t = set[context(h, CtxBits, Dtype)];
    const uint32_t sym = rans_step_packed(t.packed[x[l] & (kProbScale - 1)], x[l]);
    const uint32_t need = x[l] < kRansL;                               // renormalise: one word
    const uint32_t w = (!Checked || used < n_words) ? load_le<uint16_t>(words + 2 * used) : 0u;
    x[l] = need ? (x[l] << kRenormBits) | w : x[l];
    used += need;
    if constexpr (Dtype == kFP32)
      out[l] = join32(sym, h, load_le<uint16_t>(lo + 2 * l));
    else
      out[l] = join16(Dtype, sym, h);
  }
}

// Decode the lanes of one segment and join its planes into `out` (the segment's first element).
#if defined(__x86_64__)
// The same step on AVX-512: 32 lanes as two vectors of 16. The two table lookups are gathers;
// the renormalising words of a vector's lanes are one masked load of the next `count` words,
// expanded into the lanes that take them in lane order (vpexpandd) -- the format's word order.
template <int Dtype, int CtxBits, typename Word>
WCODEC_AVX512 static void decode_step_avx512(const uint8_t* hi, const uint8_t* lo, const DecodeTable* set,
                                             const uint8_t* words, int64_t n_words, int64_t& used,
                                             __m512i* x, Word* out) {
  const char* base = reinterpret_cast<const char*>(set);
  const __m512i low12 = _mm512_set1_epi32(kProbScale - 1), low16 = _mm512_set1_epi32(0xFFFF);
  for (int v = 0; v < 2; ++v) {
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + 16 * v)));
    const __m512i ctx = CtxBits ? _mm512_and_si512(_mm512_srli_epi32(h, (Dtype == kFP16 ? 8 : 7) - CtxBits),
                                                   _mm512_set1_epi32((1 << CtxBits) - 1))
                                : _mm512_setzero_si512();
    const __m512i table = _mm512_mullo_epi32(ctx, _mm512_set1_epi32(sizeof(DecodeTable)));
    const __m512i slot = _mm512_and_si512(x[v], low12);
    const __m512i sym = _mm512_and_si512(_mm512_i32gather_epi32(_mm512_add_epi32(table, slot), base, 1),
                                         _mm512_set1_epi32(0xFF));
    const __m512i fc_at = _mm512_add_epi32(_mm512_add_epi32(table, _mm512_set1_epi32(kProbScale)),
                                           _mm512_slli_epi32(sym, 2));
    const __m512i fc = _mm512_i32gather_epi32(fc_at, base, 1);
    x[v] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(fc, 16),
                                                                _mm512_srli_epi32(x[v], kProbBits)), slot),
                            _mm512_and_si512(fc, low16));                        // x = D(x)
    const __mmask16 need = _mm512_cmplt_epu32_mask(x[v], _mm512_set1_epi32(kRansL));
    const int count = _mm_popcnt_u32(need);
    const int avail = static_cast<int>(std::min<int64_t>(count, std::max<int64_t>(0, n_words - used)));
    const __m256i w16 = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << avail) - 1u), words + 2 * used);
    const __m512i w = _mm512_maskz_expand_epi32(need, _mm512_cvtepu16_epi32(w16));
    x[v] = _mm512_mask_or_epi32(x[v], need, _mm512_slli_epi32(x[v], kRenormBits), w);
    used += count;
    if constexpr (Dtype == kFP32) {
      const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 32 * v)));
      const __m512i j = _mm512_or_si512(
          _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x80)), 24), _mm512_slli_epi32(sym, 23)),
          _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x7F)), 16), l));
      _mm512_storeu_si512(out + 16 * v, j);
    } else {
      const __m512i j = Dtype == kFP16
          ? _mm512_or_si512(_mm512_slli_epi32(sym, 8), h)
          : _mm512_or_si512(_mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x80)), 8),
                                            _mm512_slli_epi32(sym, 7)), _mm512_and_si512(h, _mm512_set1_epi32(0x7F)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * v), _mm512_cvtepi32_epi16(j));
    }
  }
}

template <int Dtype, int CtxBits, typename Word>
WCODEC_AVX512 static int64_t decode_full_steps_avx512(const uint8_t* hi, const uint8_t* lo, const DecodeTable* set,
                                                      const uint8_t* words, int64_t n_words, int64_t& used,
                                                      uint32_t* x_lanes, int64_t full_steps, Word* out) {
  __m512i x[2] = {_mm512_loadu_si512(x_lanes), _mm512_loadu_si512(x_lanes + 16)};
  for (int64_t t = 0; t < full_steps; ++t)
    decode_step_avx512<Dtype, CtxBits>(hi + t * kLanes, Dtype == kFP32 ? lo + 2 * t * kLanes : nullptr, set,
                                       words, n_words, used, x, out + t * kLanes);
  _mm512_storeu_si512(x_lanes, x[0]);
  _mm512_storeu_si512(x_lanes + 16, x[1]);
  return full_steps * kLanes;
}

// The same step on AVX2 (no AVX-512): 32 lanes as four vectors of 8. AVX2 has no vpexpandd, so
// the words a vector's lanes take are spread by a permutation: kExpand8[mask] gives each lane that
// renormalises the rank of its word among the next popcount(mask) words.
struct Expand8 {
  alignas(32) int32_t idx[256][8];
  Expand8() {
    for (int m = 0; m < 256; ++m)
      for (int l = 0, r = 0; l < 8; ++l) idx[m][l] = ((m >> l) & 1) ? r++ : 0;
  }
};
static const Expand8 kExpand8;

// The next `count` (<= 8) words as u32 lanes, zeros past the stream's end: never a read beyond it.
WCODEC_AVX2 static inline __m256i next_words_avx2(const uint8_t* words, int64_t n_words, int64_t used) {
  if (used >= 0 && used + 8 <= n_words)
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words + 2 * used)));
  alignas(16) uint16_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t avail = std::min<int64_t>(8, std::max<int64_t>(0, n_words - used));
  if (avail > 0) memcpy(tail, words + 2 * used, 2 * avail);
  return _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

template <int Dtype, int CtxBits>
WCODEC_AVX2 static inline __m256i decode_vector_avx2(const uint8_t* hi, const DecodeTable* set, const uint8_t* words,
                                                     int64_t n_words, int64_t& used, __m256i& x, __m256i& h) {
  static_assert(sizeof(DecodeTable) % 4 == 0, "tables are indexed in u32s");
  const int* base = reinterpret_cast<const int*>(set[0].packed);
  h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi)));
  const __m256i ctx = CtxBits ? _mm256_and_si256(_mm256_srli_epi32(h, (Dtype == kFP16 ? 8 : 7) - CtxBits),
                                                 _mm256_set1_epi32((1 << CtxBits) - 1))
                              : _mm256_setzero_si256();
  const __m256i table = _mm256_mullo_epi32(ctx, _mm256_set1_epi32(sizeof(DecodeTable) / 4));
  const __m256i slot = _mm256_and_si256(x, _mm256_set1_epi32(kProbScale - 1));
  const __m256i v = _mm256_i32gather_epi32(base, _mm256_add_epi32(table, slot), 4);      // one packed entry
  const __m256i sym = _mm256_and_si256(_mm256_srli_epi32(v, kLutSymShift), _mm256_set1_epi32(0xFF));
  const __m256i freq = _mm256_add_epi32(_mm256_srli_epi32(v, kLutFreqShift), _mm256_set1_epi32(1));
  x = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srli_epi32(x, kProbBits)),
                       _mm256_and_si256(v, _mm256_set1_epi32(kProbScale - 1)));          // x = D(x)
  const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(x, kRenormBits), _mm256_setzero_si256());   // x < L
  const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(need));
  const __m256i w = _mm256_permutevar8x32_epi32(next_words_avx2(words, n_words, used),
                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(kExpand8.idx[mask])));
  x = _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, kRenormBits), w), need);
  used += _mm_popcnt_u32(static_cast<unsigned>(mask));
  return sym;
}

// planes.join of 8 lanes, as u32
template <int Dtype>
WCODEC_AVX2 static inline __m256i join_avx2(__m256i sym, __m256i h, const uint8_t* lo) {
  const __m256i sign = _mm256_and_si256(h, _mm256_set1_epi32(0x80)), mant = _mm256_and_si256(h, _mm256_set1_epi32(0x7F));
  if constexpr (Dtype == kFP16) return _mm256_or_si256(_mm256_slli_epi32(sym, 8), h);
  if constexpr (Dtype == kBF16)
    return _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi32(sign, 8), _mm256_slli_epi32(sym, 7)), mant);
  const __m256i l = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
  return _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi32(sign, 24), _mm256_slli_epi32(sym, 23)),
                         _mm256_or_si256(_mm256_slli_epi32(mant, 16), l));
}

template <int Dtype, int CtxBits, typename Word>
WCODEC_AVX2 static int64_t decode_full_steps_avx2(const uint8_t* hi, const uint8_t* lo, const DecodeTable* set,
                                                  const uint8_t* words, int64_t n_words, int64_t& used,
                                                  uint32_t* x_lanes, int64_t full_steps, Word* out) {
  __m256i x[4];
  for (int v = 0; v < 4; ++v) x[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_lanes + 8 * v));
  for (int64_t t = 0; t < full_steps; ++t) {
    __m256i joined[4];
    for (int v = 0; v < 4; ++v) {
      __m256i h;
      const __m256i sym = decode_vector_avx2<Dtype, CtxBits>(hi + t * kLanes + 8 * v, set, words, n_words, used, x[v], h);
      joined[v] = join_avx2<Dtype>(sym, h, Dtype == kFP32 ? lo + 2 * (t * kLanes + 8 * v) : nullptr);
    }
    Word* o = out + t * kLanes;
    if constexpr (Dtype == kFP32) {
      for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 8 * v), joined[v]);
    } else {                                          // pack pairs to u16; packus interleaves 128-bit halves
      for (int v = 0; v < 4; v += 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 8 * v),
                            _mm256_permute4x64_epi64(_mm256_packus_epi32(joined[v], joined[v + 1]), 0xD8));
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(x_lanes + 8 * v), x[v]);
  return full_steps * kLanes;
}

// WCODEC_CPU_SIMD=0 forces the scalar path (tests run both).
static bool simd_allowed() {
  return !(std::getenv("WCODEC_CPU_SIMD") && std::string(std::getenv("WCODEC_CPU_SIMD")) == "0");
}
static bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && simd_allowed();
  return yes;
}
static bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && simd_allowed();
  return yes;
}
#endif

// Steps [t, stop) of a unit: AVX-512 for whole steps, the scalar loop for the rest.
template <int Dtype, int CtxBits, typename Word>
static void decode_steps(const uint8_t* hi, const uint8_t* lo, const DecodeTable* lut, const uint8_t* words,
                         int64_t n_words, int64_t& used, uint32_t* x, int64_t n, int64_t t, int64_t stop, Word* out) {
  int64_t j0 = t * kLanes;
  const int64_t end = std::min(stop * kLanes, n);
#if defined(__x86_64__)
  if (has_avx512() && end - j0 >= kLanes)
    j0 += decode_full_steps_avx512<Dtype, CtxBits>(hi + j0, Dtype == kFP32 ? lo + 2 * j0 : nullptr, lut, words,
                                                   n_words, used, x, (end - j0) / kLanes, out + j0);
  else if (has_avx2() && end - j0 >= kLanes)
    j0 += decode_full_steps_avx2<Dtype, CtxBits>(hi + j0, Dtype == kFP32 ? lo + 2 * j0 : nullptr, lut, words,
                                                 n_words, used, x, (end - j0) / kLanes, out + j0);
#endif
  for (; j0 < end; j0 += kLanes) {
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, end - j0));
    const uint8_t* lo_step = Dtype == kFP32 ? lo + 2 * j0 : nullptr;
    if (lanes == kLanes && used >= 0 && used + kLanes <= n_words)
      decode_step<Dtype, CtxBits, false>(kLanes, hi + j0, lo_step, lut, words, n_words, used, x, out + j0);
    else
      decode_step<Dtype, CtxBits, true>(lanes, hi + j0, lo_step, lut, words, n_words, used, x, out + j0);
  }
}

struct IndexView {                 // the resident index (kRecord writes it, kIndexed reads it)
  uint32_t* states;                // [entries, 32]
  uint32_t* words;                 // [entries]
};

// Decode steps [u.t0, u.t1) of one segment into `out` (the segment's first element) and check its
// end: L with every word used, or the next entry of the index.
template <int Dtype, int CtxBits, typename Word>
static int decode_unit(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u, int64_t mode,
                       int64_t entry_steps, const DecodeTable* lut, IndexView index, Word* out) {
  if (u.t0 >= u.t1) return kOk;                                    // a piece past a short segment's end
  const uint8_t* exp = data + d.exp_off;
  const uint8_t* hi = data + d.hi_off + u.seg * kSegmentSymbols;
  const uint8_t* lo = Dtype == kFP32 ? data + d.lo_off + 2 * u.seg * kSegmentSymbols : nullptr;
  const uint8_t* words = exp + ref.data + kStateBytes;
  uint32_t x[kLanes];
  int64_t used = u.entry >= 0 ? index.words[u.entry] : 0;
  for (int l = 0; l < kLanes; ++l)
    x[l] = u.entry >= 0 ? index.states[u.entry * kLanes + l] : load_le<uint32_t>(exp + ref.data + 4 * l);
  for (int64_t t = u.t0; t < u.t1;) {
    const int64_t stop = mode == kRecord ? std::min(u.t1, (t / entry_steps + 1) * entry_steps) : u.t1;
    if (mode == kRecord) {                                         // an entry point of the index
      const int64_t e = record_entry(d, entry_steps, u.seg, t);
      std::copy_n(x, kLanes, index.states + e * kLanes);
      index.words[e] = static_cast<uint32_t>(used);
    }
    decode_steps<Dtype, CtxBits>(hi, lo, lut, words, ref.words, used, x, ref.symbols, t, stop, out);
    t = stop;
  }
  const bool to_entry = u.end_entry >= 0;
  if (used != (to_entry ? static_cast<int64_t>(index.words[u.end_entry]) : ref.words)) return kWords;
  for (int l = 0; l < kLanes; ++l)
    if (x[l] != (to_entry ? index.states[u.end_entry * kLanes + l] : kRansL)) return kState;
  return kOk;
}

template <int Dtype, typename Word>
static int decode_unit_ctx(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u,
                           int64_t mode, int64_t entry_steps, const DecodeTable* lut, IndexView index, void* base) {
  Word* out = static_cast<Word*>(base) + u.seg * kSegmentSymbols;
  switch (d.ctx_bits) {
    case 0: return decode_unit<Dtype, 0>(data, d, ref, u, mode, entry_steps, lut, index, out);
    case 1: return decode_unit<Dtype, 1>(data, d, ref, u, mode, entry_steps, lut, index, out);
    default: return decode_unit<Dtype, 2>(data, d, ref, u, mode, entry_steps, lut, index, out);
  }
}

static int decode_any(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u, int64_t mode,
                      int64_t entry_steps, const DecodeTable* lut, IndexView index, void* base) {
  switch (d.dtype) {
    case kBF16: return decode_unit_ctx<kBF16, uint16_t>(data, d, ref, u, mode, entry_steps, lut, index, base);
    case kFP16: return decode_unit_ctx<kFP16, uint16_t>(data, d, ref, u, mode, entry_steps, lut, index, base);
    default: return decode_unit_ctx<kFP32, uint32_t>(data, d, ref, u, mode, entry_steps, lut, index, base);
  }
}

// The data buffer, the descriptor rows and one output per row, as every op takes them.
void check_data_and_desc(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "data must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(desc.scalar_type() == at::kLong && desc.device().is_cpu() && desc.dim() == 2 &&
                  desc.size(1) == kDescFields && desc.is_contiguous(),
              "desc must be a contiguous CPU int64 tensor [n, ", int(kDescFields), "]");
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) == desc.size(0), "one output per descriptor row");
}

// Checks a caller's arguments (not archive data: that yields statuses). Returns the descriptors.
std::vector<TensorDesc> check_pieces_args(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                          const at::Tensor& entry_states, const at::Tensor& entry_words,
                                          const at::Tensor& status, int64_t mode, int64_t entry_steps) {
  check_data_and_desc(data, desc, outputs);
  TORCH_CHECK(mode >= kBulk && mode <= kIndexed, "mode must be 0 (bulk), 1 (record) or 2 (indexed)");
  TORCH_CHECK(mode == kBulk || (entry_steps >= kMinEntrySteps && entry_steps <= kSegmentSteps &&
                                (entry_steps & (entry_steps - 1)) == 0),
              "entry_steps must be a power of two in [", kMinEntrySteps, ", ", kSegmentSteps, "]");
  TORCH_CHECK(status.scalar_type() == at::kInt && status.is_contiguous() && status.device() == data.device(),
              "status must be a contiguous int32 tensor on data's device");
  std::vector<TensorDesc> out;
  int64_t entries = 0, statuses = 0;
  const int64_t size = data.numel();
  const int64_t per = mode == kBulk ? 1 : kSegmentSteps / entry_steps;
  for (int64_t i = 0; i < desc.size(0); ++i) {
    const TensorDesc d = load_desc(desc.data_ptr<int64_t>() + i * kDescFields);
    const at::Tensor& o = outputs[i];
    const auto want = d.dtype == kBF16 ? at::kBFloat16 : d.dtype == kFP16 ? at::kHalf : at::kFloat;
    TORCH_CHECK(d.dtype >= kBF16 && d.dtype <= kFP32 && o.scalar_type() == want, "output ", i, " has the wrong dtype");
    TORCH_CHECK(o.is_contiguous() && o.numel() == d.numel && d.numel > 0 && o.device() == data.device(),
                "output ", i, " must be contiguous, on data's device, with numel ", d.numel);
    TORCH_CHECK(d.ctx_bits >= 0 && d.ctx_bits <= kMaxCtxBits && d.table_group >= 1 && d.first_segment >= 0,
                "bad params in row ", i);
    TORCH_CHECK(d.exp_off >= 0 && d.exp_len >= 0 && d.exp_off + d.exp_len <= size && d.hi_off >= 0 &&
                    d.hi_off + d.numel <= size && (d.dtype != kFP32 || (d.lo_off >= 0 && d.lo_off + 2 * d.numel <= size)),
                "streams of row ", i, " lie outside data");
    const uintptr_t base = reinterpret_cast<uintptr_t>(data.data_ptr());
    TORCH_CHECK((base + d.exp_off) % 2 == 0 && (d.dtype != kFP32 || (base + d.lo_off) % 2 == 0),
                "the exp and lo streams of row ", i, " must start at even addresses (16-bit words); "
                "an archive places every stream 64-byte aligned");
    entries = std::max(entries, (d.first_segment + segment_count(d)) * per);
    statuses = std::max(statuses, (d.first_segment + segment_count(d)) * pieces_per_segment(mode, entry_steps));
    out.push_back(d);
  }
  TORCH_CHECK(status.numel() >= statuses, "status needs ", statuses, " entries");
  if (mode != kBulk) {
    TORCH_CHECK(entry_states.scalar_type() == at::kInt && entry_words.scalar_type() == at::kInt &&
                    entry_states.is_contiguous() && entry_words.is_contiguous() &&
                    entry_states.device() == data.device() && entry_words.device() == data.device(),
                "the index is two contiguous int32 tensors on data's device");
    TORCH_CHECK(entry_states.numel() >= entries * kLanes && entry_words.numel() >= entries,
                "the index needs ", entries, " entries");
  }
  return out;
}

static void decode_pieces_cpu(const at::Tensor& data, const at::Tensor& desc, const at::Tensor& /*plan*/,
                              at::TensorList outputs, const at::Tensor& entry_states, const at::Tensor& entry_words,
                              const at::Tensor& status, int64_t mode, int64_t entry_steps) {
  const std::vector<TensorDesc> descs =
      check_pieces_args(data, desc, outputs, entry_states, entry_words, status, mode, entry_steps);
  std::vector<int64_t> firsts;                                       // first unit of each tensor
  int64_t total = 0;
  for (const auto& d : descs) firsts.push_back(total), total += unit_count(d, mode, entry_steps);
  int32_t* st = status.data_ptr<int32_t>();
  const uint8_t* bytes = data.data_ptr<uint8_t>();
  const IndexView index{mode == kBulk ? nullptr : reinterpret_cast<uint32_t*>(entry_states.data_ptr()),
                        mode == kBulk ? nullptr : reinterpret_cast<uint32_t*>(entry_words.data_ptr())};
  const int64_t grain = mode == kIndexed ? kSegmentSteps / entry_steps : 1;   // a segment's pieces share tables
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    std::vector<DecodeTable> lut;
    int64_t cached_tensor = -1, cached_table = -1;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t = std::upper_bound(firsts.begin(), firsts.end(), g) - firsts.begin() - 1;
      const TensorDesc& d = descs[t];
      const uint8_t* exp = bytes + d.exp_off;
      const Unit u = unit_of(d, mode, entry_steps, g - firsts[t]);
      SegmentRef ref;
      if ((st[u.status] = read_segment(exp, d.exp_len, d, u.seg, &ref)) != kOk) continue;
      if (t != cached_tensor || ref.table0 != cached_table) {
        cached_tensor = -1;
        if ((st[u.status] = build_decode_tables(exp, d, ref.table0, lut)) != kOk) continue;
        cached_tensor = t, cached_table = ref.table0;
      }
      st[u.status] = decode_any(bytes, d, ref, u, mode, entry_steps, lut.data(), index, outputs[t].data_ptr());
    }
  });
}

#ifdef WCODEC_PYTHON_MODULE
// Built ahead of time as the Python module cuda_ext._C: importing it registers the ops above.
}  // namespace wcodec
#include <Python.h>
extern "C" PyObject* PyInit__C() {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "wcodec decoders (ops under torch.ops.wcodec)", -1, nullptr};
  return PyModule_Create(&def);
}
namespace wcodec {
#endif

// decode_pieces: decode the units of every tensor in `desc` into `outputs` (caller-owned), on the
// current stream, allocating nothing. `plan` is desc's device plan (cuda_ext.plan.device_plan;
// unused on the CPU). Modes and the index: wcodec_constants.h Mode, codec/resident.py.
TORCH_LIBRARY(wcodec, m) {
  m.def("decode_pieces(Tensor data, Tensor desc, Tensor plan, Tensor(a!)[] outputs, Tensor(b!) entry_states, "
        "Tensor(c!) entry_words, Tensor(d!) status, int decode_mode, int entry_steps) -> ()");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) { m.impl("decode_pieces", &decode_pieces_cpu); }

}  // namespace wcodec
