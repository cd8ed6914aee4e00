// The encoder's full steps on AVX-512 (encode_float.cpp): 32 lanes as two vectors of 16, the same
// arithmetic as rans_encode_step (encode_common.h), so the same bytes.
//   * the table entry of each lane is one gather of freq << 16 | cum, and one of 1.0 / freq per 8 lanes;
//   * x / freq in float64: x * (1 / freq) is within 2^-20 of x / freq (x < 2^32), so its floor is
//     the quotient or one below it (only when x / freq is an integer): one compare corrects it;
//   * words: rANS encodes IN REVERSE, so lanes 16-31 go first; a vector's emitting lanes are
//     compressed in lane order and stored just below ptr, which leaves each step's words in
//     increasing lane order, steps front to back (the decoder's order).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdlib>
#include <string>

#include "encode_common.h"

#define WCODEC_ENC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,popcnt")))

namespace wcodec {

inline bool encode_simd_allowed() {                   // WCODEC_CPU_SIMD=0 forces the scalar path
  const char* v = std::getenv("WCODEC_CPU_SIMD");
  return !(v && std::string(v) == "0");
}
inline bool encode_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          encode_simd_allowed();
  return yes;
}

// sym and table index (ctx << 8 | sym) of 16 elements starting at element i (planes.split).
template <int Dtype>
WCODEC_ENC_AVX512 static inline __m512i simd_index(const uint8_t* in, int64_t i, int cb) {
  __m512i u, sym, hi;
  if constexpr (Dtype == kU8) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
  } else if constexpr (Dtype == kFP32) {
    u = _mm512_loadu_si512(in + 4 * i);
    sym = _mm512_and_si512(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(0xFF));
    hi = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x7F));     // mantissa bits only
  } else {
    u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 2 * i)));
    sym = Dtype == kFP16 ? _mm512_srli_epi32(u, 8) : _mm512_and_si512(_mm512_srli_epi32(u, 7), _mm512_set1_epi32(0xFF));
    hi = _mm512_and_si512(u, _mm512_set1_epi32(Dtype == kFP16 ? 0xFF : 0x7F));
  }
  const int top = Dtype == kFP16 ? 7 : 6;
  const __m512i ctx = cb ? _mm512_and_si512(_mm512_srli_epi32(hi, top + 1 - cb), _mm512_set1_epi32((1 << cb) - 1))
                         : _mm512_setzero_si512();
  return _mm512_or_si512(_mm512_slli_epi32(ctx, 8), sym);
}

// x = C(s, x) for 16 lanes, after emitting their words below ptr (see the file's comment).
WCODEC_ENC_AVX512 static inline __m512i simd_encode(__m512i x, __m512i idx, const uint32_t* fc_table,
                                                    const double* inv_table, uint16_t*& ptr) {
  const __m512i fc = _mm512_i32gather_epi32(idx, fc_table, 4);
  const __m512i f = _mm512_srli_epi32(fc, 16);
  const __mmask16 emit = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(x, 32 - kProbBits), f);
  const int count = _mm_popcnt_u32(emit);
  ptr -= count;
  _mm256_mask_storeu_epi16(ptr, static_cast<__mmask16>((1u << count) - 1u),
                           _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(emit, x)));
  x = _mm512_mask_srli_epi32(x, emit, x, kRenormBits);
  const __m512d lo = _mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_castsi512_si256(x)),
                                   _mm512_i32gather_pd(_mm512_castsi512_si256(idx), inv_table, 8));
  const __m512d hi = _mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(x, 1)),
                                   _mm512_i32gather_pd(_mm512_extracti64x4_epi64(idx, 1), inv_table, 8));
  __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvttpd_epu32(lo)), _mm512_cvttpd_epu32(hi), 1);
  __m512i r = _mm512_sub_epi32(x, _mm512_mullo_epi32(q, f));
  const __mmask16 over = _mm512_cmpge_epu32_mask(r, f);                     // floor came out one low
  q = _mm512_mask_add_epi32(q, over, q, _mm512_set1_epi32(1));
  r = _mm512_mask_sub_epi32(r, over, r, f);
  return _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(q, kProbBits), r),
                          _mm512_and_si512(fc, _mm512_set1_epi32(0xFFFF)));
}

// Steps full_steps - 1 down to 0 of a segment (every lane present), element 0 at `in`.
template <int Dtype>
WCODEC_ENC_AVX512 static void encode_full_steps_avx512(const uint8_t* in, int64_t full_steps, int cb,
                                                       const uint32_t* fc_table, const double* inv_table,
                                                       uint32_t* x_lanes, uint16_t*& ptr) {
  __m512i x0 = _mm512_loadu_si512(x_lanes), x1 = _mm512_loadu_si512(x_lanes + 16);
  for (int64_t t = full_steps - 1; t >= 0; --t) {                     // last step first
    x1 = simd_encode(x1, simd_index<Dtype>(in, t * kLanes + 16, cb), fc_table, inv_table, ptr);
    x0 = simd_encode(x0, simd_index<Dtype>(in, t * kLanes, cb), fc_table, inv_table, ptr);
  }
  _mm512_storeu_si512(x_lanes, x0);
  _mm512_storeu_si512(x_lanes + 16, x1);
}

}  // namespace wcodec
#endif
