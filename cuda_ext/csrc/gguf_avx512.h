// GGUF blocks -> float32 on AVX-512, 16 weights a vector, straight from the planes (gguf_cpu.h
// says when this path runs). Each kernel does gguf_blocks.h's operations in its order:
//   Q4_0  d * (q - 8)         Q4_1  (d * q) + m          Q8_0  x * d
//   Q5_0  d * (q - 16)        Q5_1  (d * q) + m          (q = nibble | qh bit << 4)
//   Q4_K  (d * sc) * q - (dmin * m), per sub-block of 32 (Q5_K: q |= qh bit i << 4)
//   Q6_K  (d * scales[w / 16]) * (q - 32)
// A product or sum of two non-NaN float32 is the same bits from a vector lane as from a scalar
// (round to nearest even; -ffp-contract=off keeps the products unfused), and vcvtph2ps widens an
// f16 exactly as numpy does except for a signalling NaN (quieted): only NaN weights may differ,
// and those blocks are redone by the scalar path (gguf_cpu.h).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdlib>
#include <string>

#include "gguf_cpu.h"

#define WCODEC_GGUF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

namespace wcodec {
namespace gguf {

inline bool has_avx512() {                          // WCODEC_CPU_SIMD=0 forces the scalar path
  static const bool yes = [] {
    const char* v = std::getenv("WCODEC_CPU_SIMD");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") && !(v && std::string(v) == "0");
  }();
  return yes;
}

// ---- pieces ---------------------------------------------------------------------------------------
WCODEC_GGUF_AVX512 inline float half_at(const uint8_t* lo, const uint8_t* hi, int64_t b) {   // f16 lo | hi << 8
  return _cvtsh_ss(static_cast<unsigned short>(lo[b] | (hi[b] << 8)));
}
WCODEC_GGUF_AVX512 inline __m512i bytes16(const uint8_t* p) {                  // 16 bytes -> 16 int32
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
WCODEC_GGUF_AVX512 inline __m512i nibbles(__m512i bytes, int shift) {         // (byte >> shift) & 15
  return _mm512_and_si512(_mm512_srli_epi32(bytes, shift), _mm512_set1_epi32(15));
}
WCODEC_GGUF_AVX512 inline __m512 to_f32(__m512i q) { return _mm512_cvtepi32_ps(q); }
WCODEC_GGUF_AVX512 inline uint32_t le32(const uint8_t* p) { uint32_t u; memcpy(&u, p, 4); return u; }

// ---- one block -> y.put(j, weights j .. j + 15), per type ---------------------------------------
template <int Code>
struct SimdBlock;

template <>
struct SimdBlock<2> {                                          // Q4_0: d_lo d_hi qs
  template <typename Sink>
  WCODEC_GGUF_AVX512 static void run(const Planes& p, int64_t b, Sink& y) {
    const __m512 d = _mm512_set1_ps(half_at(p.p[0], p.p[1], b));
    const __m512i qs = bytes16(p.p[2] + 16 * b), eight = _mm512_set1_epi32(8);
    y.put(0, _mm512_mul_ps(d, to_f32(_mm512_sub_epi32(nibbles(qs, 0), eight))));
    y.put(16, _mm512_mul_ps(d, to_f32(_mm512_sub_epi32(nibbles(qs, 4), eight))));
  }
};
template <>
struct SimdBlock<3> {                                          // Q4_1: d_lo d_hi m_lo m_hi qs
  template <typename Sink>
  WCODEC_GGUF_AVX512 static void run(const Planes& p, int64_t b, Sink& y) {
    const __m512 d = _mm512_set1_ps(half_at(p.p[0], p.p[1], b)), m = _mm512_set1_ps(half_at(p.p[2], p.p[3], b));
    const __m512i qs = bytes16(p.p[4] + 16 * b);
    y.put(0, _mm512_add_ps(_mm512_mul_ps(d, to_f32(nibbles(qs, 0))), m));
    y.put(16, _mm512_add_ps(_mm512_mul_ps(d, to_f32(nibbles(qs, 4))), m));
  }
};
// Q5: weight j's fifth bit is bit j of the u32 qh: a lane mask.
WCODEC_GGUF_AVX512 inline __m512i with_bit4(__m512i q, __mmask16 bits) {
  return _mm512_mask_or_epi32(q, bits, q, _mm512_set1_epi32(16));
}
template <>
struct SimdBlock<6> {                                          // Q5_0: d_lo d_hi qh qs
  template <typename Sink>
  WCODEC_GGUF_AVX512 static void run(const Planes& p, int64_t b, Sink& y) {
    const __m512 d = _mm512_set1_ps(half_at(p.p[0], p.p[1], b));
    const uint32_t qh = le32(p.p[2] + 4 * b);
    const __m512i qs = bytes16(p.p[3] + 16 * b), sixteen = _mm512_set1_epi32(16);
    const __m512i lo = with_bit4(nibbles(qs, 0), static_cast<__mmask16>(qh));
    const __m512i hi = with_bit4(nibbles(qs, 4), static_cast<__mmask16>(qh >> 16));
    y.put(0, _mm512_mul_ps(d, to_f32(_mm512_sub_epi32(lo, sixteen))));
    y.put(16, _mm512_mul_ps(d, to_f32(_mm512_sub_epi32(hi, sixteen))));
  }
};
template <>
struct SimdBlock<7> {                                          // Q5_1: d_lo d_hi m_lo m_hi qh qs
  template <typename Sink>
  WCODEC_GGUF_AVX512 static void run(const Planes& p, int64_t b, Sink& y) {
    const __m512 d = _mm512_set1_ps(half_at(p.p[0], p.p[1], b)), m = _mm512_set1_ps(half_at(p.p[2], p.p[3], b));
    const uint32_t qh = le32(p.p[4] + 4 * b);
    const __m512i qs = bytes16(p.p[5] + 16 * b);
    const __m512i lo = with_bit4(nibbles(qs, 0), static_cast<__mmask16>(qh));
    const __m512i hi = with_bit4(nibbles(qs, 4), static_cast<__mmask16>(qh >> 16));
    y.put(0, _mm512_add_ps(_mm512_mul_ps(d, to_f32(lo)), m));
    y.put(16, _mm512_add_ps(_mm512_mul_ps(d, to_f32(hi)), m));
  }
};
template <>
struct SimdBlock<8> {                                          // Q8_0: d_lo d_hi qs (int8)
  template <typename Sink>
  WCODEC_GGUF_AVX512 static void run(const Planes& p, int64_t b, Sink& y) {
    const __m512 d = _mm512_set1_ps(half_at(p.p[0], p.p[1], b));
    const uint8_t* qs = p.p[2] + 32 * b;
    for (int h = 0; h < 2; ++h) {
      const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h)));
      y.put(16 * h, _mm512_mul_ps(to_f32(x), d));
    }
  }
};

// Q4_K / Q5_K: d_lo d_hi dmin_lo dmin_hi scales [qh] qs. Sub-block i = 2k + (nibble) reads
// qs[32 k, 32 k + 32); its 32 weights are (d * sc) * q - (dmin * m).
template <bool Q5>
struct SimdK45 {
  template <typename Sink>
  WCODEC_GGUF_AVX512 static void run(const Planes& p, int64_t b, Sink& y) {
    const float d = half_at(p.p[0], p.p[1], b), dmin = half_at(p.p[2], p.p[3], b);
    const uint8_t* scales = p.p[4] + 12 * b;
    const uint8_t* qh = Q5 ? p.p[5] + 32 * b : nullptr;
    const uint8_t* qs = p.p[Q5 ? 6 : 5] + 128 * b;
    for (int i = 0; i < 8; ++i) {
      uint32_t sc, m;
      k_scale_min(scales, i, &sc, &m);
      const __m512 ds = _mm512_set1_ps(d * static_cast<float>(sc)), dm = _mm512_set1_ps(dmin * static_cast<float>(m));
      for (int h = 0; h < 2; ++h) {
        __m512i q = nibbles(bytes16(qs + 32 * (i >> 1) + 16 * h), 4 * (i & 1));
        if (Q5) {
          const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 16 * h));
          q = with_bit4(q, _mm_test_epi8_mask(bits, _mm_set1_epi8(static_cast<char>(1 << i))));
        }
        y.put(32 * i + 16 * h, _mm512_sub_ps(_mm512_mul_ps(ds, to_f32(q)), dm));
      }
    }
  }
};
template <>
struct SimdBlock<12> : SimdK45<false> {};
template <>
struct SimdBlock<13> : SimdK45<true> {};

// Q6_K: ql qh scales d_lo d_hi. Weights 16 s .. 16 s + 15 (s = 8 h + 2 g + half) share
// d * scales[s]; their q: ql[64 h + 32 (g & 1) + 16 half + l] nibble g >> 1, qh[32 h + 16 half + l]
// bits 2 g, 2 g + 1.
template <>
struct SimdBlock<14> {
  template <typename Sink>
  WCODEC_GGUF_AVX512 static void run(const Planes& p, int64_t b, Sink& y) {
    const uint8_t *ql = p.p[0] + 128 * b, *qh = p.p[1] + 64 * b;
    alignas(64) float ds[16];                                  // d * scales[s]
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.p[2] + 16 * b)));
    _mm512_store_ps(ds, _mm512_mul_ps(_mm512_set1_ps(half_at(p.p[3], p.p[4], b)), to_f32(sc)));
    for (int s = 0; s < 16; ++s) {
      const int h = s >> 3, g = (s >> 1) & 3, half = s & 1;
      const __m512i lo = nibbles(bytes16(ql + 64 * h + 32 * (g & 1) + 16 * half), 4 * (g >> 1));
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(bytes16(qh + 32 * h + 16 * half), 2 * g),
                                          _mm512_set1_epi32(3));
      const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
      y.put(16 * s, _mm512_mul_ps(_mm512_set1_ps(ds[s]), to_f32(q)));
    }
  }
};

// ---- y -> the output dtype, 16 at a time ----------------------------------------------------------
WCODEC_GGUF_AVX512 inline void store16(OutF32, float* o, __m512 v) { _mm512_storeu_ps(o, v); }
WCODEC_GGUF_AVX512 inline void store16(OutF16, uint16_t* o, __m512 v) {          // F16C: torch's cast
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
WCODEC_GGUF_AVX512 inline void store16(OutBF16, uint16_t* o, __m512 v) {         // f32_to_bf16, 16 lanes
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}

// A block's weights, 16 at a time, straight to the output; NaN lanes noted unless Out maps
// every NaN to one value.
template <typename Out>
struct OutSink {
  typename Out::T* o;
  __mmask16 nan;
  WCODEC_GGUF_AVX512 void put(int j, __m512 v) {
    if (!Out::kNanFree) nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    store16(Out{}, o + j, v);
  }
};

// Blocks [b0, b1) into out (element 0 of block 0 at out); a block with a NaN weight is redone by
// scalar_block unless Out maps every NaN to one value.
template <int Code, typename Out>
WCODEC_GGUF_AVX512 void simd_range(const BlockLayout& l, const Planes& planes, int64_t b0, int64_t b1,
                                   typename Out::T* out) {
  for (int64_t b = b0; b < b1; ++b) {
    OutSink<Out> sink{out + b * l.block_size, 0};
    SimdBlock<Code>::run(planes, b, sink);
    if (sink.nan) scalar_block<Code, Out>(l, planes, b, sink.o);
  }
}

}  // namespace gguf
}  // namespace wcodec
#endif
