// GGUF quantized blocks for the C++ twin (decode_quant.cpp) and the CUDA kernels (decode_quant.cu).
// codec/gguf_blocks.py is the specification: block layouts and planes there, gguf's NumPy
// dequantizers (gguf/quants.py) for the arithmetic. tests/cuda_ext/test_constants.py checks the
// layout table below against codec/gguf_blocks.py.
//
// Read me first (the traps):
// * Bit-identical to gguf's NumPy float32 arithmetic means: the same operations in the same order
//   (d * sc first, then d * q - dm, never fused into an FMA: decode_quant.cpp is compiled with
//   -ffp-contract=off; on the GPU the products are PTX mul.rn without .ftz), and NaN results as x86
//   gives them (the first NaN operand, quieted; 0xFFC00000 for inf * 0), which f32_mul/add/sub
//   spell out so that a GPU (canonical NaN) gives the same bits.
// * f16 -> f32 is numpy's (exact; NaN payload kept). f32 -> bf16 / f16 are torch's CPU casts on
//   AVX2 / AVX-512 (round to nearest even; NaN -> 0xFFFF for bf16, the F16C rule for f16: sign,
//   quiet bit, top payload bits), which is what the dense path (`--gguf dense`) stores.
// * Every byte pattern is a valid block: there is nothing to check in block data.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define GB_HD __host__ __device__ __forceinline__
#else
#define GB_HD inline
#endif

namespace wcodec {
namespace gguf {

// ---- block layouts: a plane is a contiguous span of each block's bytes --------------------------
constexpr int kMaxPlanes = 7;
constexpr int kMaxTypeSize = 210;                 // Q6_K
constexpr int kMaxBlockSize = 256;                // QK_K
struct Span { int start, width; };
struct BlockLayout {
  int code;                                       // GGMLQuantizationType
  int block_size, type_size, n_planes;
  Span planes[kMaxPlanes];
};
// name     code  weights bytes planes (start, width), in codec/gguf_blocks.py order
constexpr BlockLayout kLayouts[] = {
    {2, 32, 18, 3, {{0, 1}, {1, 1}, {2, 16}}},                                   // Q4_0: d_lo d_hi qs
    {3, 32, 20, 5, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 16}}},                   // Q4_1: d m qs
    {6, 32, 22, 4, {{0, 1}, {1, 1}, {2, 4}, {6, 16}}},                           // Q5_0: d qh qs
    {7, 32, 24, 6, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 4}, {8, 16}}},           // Q5_1: d m qh qs
    {8, 32, 34, 3, {{0, 1}, {1, 1}, {2, 32}}},                                   // Q8_0: d qs
    {12, 256, 144, 6, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 12}, {16, 128}}},     // Q4_K: d dmin scales qs
    {13, 256, 176, 7, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 12}, {16, 32}, {48, 128}}},  // Q5_K: d dmin scales qh qs
    {14, 256, 210, 5, {{0, 128}, {128, 64}, {192, 16}, {208, 1}, {209, 1}}},    // Q6_K: ql qh scales d
};
constexpr int kLayoutCount = sizeof(kLayouts) / sizeof(kLayouts[0]);

GB_HD const BlockLayout* find_layout(int64_t code) {
  for (int i = 0; i < kLayoutCount; ++i)
    if (kLayouts[i].code == code) return &kLayouts[i];
  return nullptr;
}

// ---- numbers --------------------------------------------------------------------------------------
GB_HD uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
GB_HD float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
GB_HD bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// numpy's npy_halfbits_to_floatbits: exact, NaN payload kept (not quieted).
GB_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = h & 0x7C00u, sig = h & 0x03FFu;
  if (exp == 0x7C00u) return bits_f32(sign | 0x7F800000u | (sig << 13));         // inf, NaN
  if (exp != 0) return bits_f32(sign | ((static_cast<uint32_t>(h & 0x7FFFu) + 0x1C000u) << 13));
  if (sig == 0) return bits_f32(sign);                                             // +-0
  int e = 0;                                                                        // denormal: normalise
  sig <<= 1;
  while ((sig & 0x0400u) == 0) sig <<= 1, ++e;
  return bits_f32(sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((sig & 0x03FFu) << 13));
}

// x86 NaN results: the first NaN operand, quieted; an invalid operation's default NaN.
GB_HD float x86_nan(float a, float b) {
  const uint32_t ua = f32_bits(a), ub = f32_bits(b);
  if (is_nan_bits(ua)) return bits_f32(ua | 0x00400000u);
  if (is_nan_bits(ub)) return bits_f32(ub | 0x00400000u);
  return bits_f32(0xFFC00000u);
}
#ifdef __CUDA_ARCH__
GB_HD float rn_mul(float a, float b) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
GB_HD float rn_add(float a, float b) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
GB_HD float rn_sub(float a, float b) { float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
#else
GB_HD float rn_mul(float a, float b) { return a * b; }   // -ffp-contract=off: never fused
GB_HD float rn_add(float a, float b) { return a + b; }
GB_HD float rn_sub(float a, float b) { return a - b; }
#endif
GB_HD float f32_mul(float a, float b) { const float r = rn_mul(a, b); return r != r ? x86_nan(a, b) : r; }
GB_HD float f32_add(float a, float b) { const float r = rn_add(a, b); return r != r ? x86_nan(a, b) : r; }
GB_HD float f32_sub(float a, float b) { const float r = rn_sub(a, b); return r != r ? x86_nan(a, b) : r; }

// torch's CPU cast f32 -> bf16 (AVX2 / AVX-512): round to nearest even, NaN -> 0xFFFF.
GB_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if (is_nan_bits(u)) return 0xFFFFu;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// torch's CPU cast f32 -> f16 (F16C vcvtps2ph): round to nearest even; NaN keeps its sign and top
// payload bits and is quieted. Finite values follow numpy's npy_floatbits_to_halfbits.
GB_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t exp = u & 0x7F800000u;
  uint32_t sig = u & 0x007FFFFFu;
  if (exp == 0x7F800000u) return sig ? (sign | 0x7E00u | static_cast<uint16_t>(sig >> 13)) : (sign | 0x7C00u);
  if (exp >= 0x47800000u) return sign | 0x7C00u;                                   // overflow -> inf
  if (exp <= 0x38000000u) {                                                         // f16 denormal or 0
    if (exp < 0x33000000u) return sign;                                             // under half the least
    const uint32_t shift = 126u - (exp >> 23);                                     // 14 .. 24
    sig |= 0x00800000u;
    uint32_t h = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;                               // nearest even
    return sign | static_cast<uint16_t>(h);
  }
  uint32_t h = ((exp - 0x38000000u) >> 13) | (sig >> 13);
  const uint32_t rem = sig & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;                           // may carry into inf
  return sign | static_cast<uint16_t>(h);
}

// ---- dequantize weight j of one block (ggml byte layout), in gguf/quants.py's operation order -----
// One struct per type: its constructor reads the block's f16 scales (exactly: f16 -> f32 is exact),
// its operator() computes weight j from them and the block's bytes, all() every weight and run() a
// run of consecutive weights (the K-quants' sub-block scales once per sub-block, by the same
// operations). A CPU loop builds one per block and calls all(); a GPU thread builds one for its
// run of 8 weights. Both give the same bits.
GB_HD uint16_t le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
GB_HD uint32_t q5_high(const uint8_t* qh, int j) {         // bit j of the u32 qh
  return (static_cast<uint32_t>(qh[j >> 3]) >> (j & 7)) & 1u;
}

template <typename T, int N>
struct PerWeight {                                          // all(): operator() for every weight
  GB_HD void all(const uint8_t* b, float* y) const {
    for (int j = 0; j < N; ++j) y[j] = static_cast<const T&>(*this)(b, j);
  }
  GB_HD void run(const uint8_t* b, int j0, int n, float* y) const {   // weights [j0, j0 + n)
    for (int j = 0; j < n; ++j) y[j] = static_cast<const T&>(*this)(b, j0 + j);
  }
};

struct Q4_0 : PerWeight<Q4_0, 32> {                         // d * (q - 8)
  float d;
  GB_HD explicit Q4_0(const uint8_t* b) : d(f16_to_f32(le16(b))) {}
  GB_HD float operator()(const uint8_t* b, int j) const {
    const int q = ((b[2 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0xF) - 8;
    return f32_mul(d, static_cast<float>(q));
  }
};
struct Q4_1 : PerWeight<Q4_1, 32> {                                               // (d * q) + m
  float d, m;
  GB_HD explicit Q4_1(const uint8_t* b) : d(f16_to_f32(le16(b))), m(f16_to_f32(le16(b + 2))) {}
  GB_HD float operator()(const uint8_t* b, int j) const {
    const int q = (b[4 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0xF;
    return f32_add(f32_mul(d, static_cast<float>(q)), m);
  }
};
struct Q5_0 : PerWeight<Q5_0, 32> {                                               // d * ((ql | qh << 4) - 16)
  float d;
  GB_HD explicit Q5_0(const uint8_t* b) : d(f16_to_f32(le16(b))) {}
  GB_HD float operator()(const uint8_t* b, int j) const {
    const int q = static_cast<int>(((b[6 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0xF) | (q5_high(b + 2, j) << 4)) - 16;
    return f32_mul(d, static_cast<float>(q));
  }
};
struct Q5_1 : PerWeight<Q5_1, 32> {                                               // (d * (ql | qh << 4)) + m
  float d, m;
  GB_HD explicit Q5_1(const uint8_t* b) : d(f16_to_f32(le16(b))), m(f16_to_f32(le16(b + 2))) {}
  GB_HD float operator()(const uint8_t* b, int j) const {
    const uint32_t q = ((b[8 + (j & 15)] >> (j < 16 ? 0 : 4)) & 0xF) | (q5_high(b + 4, j) << 4);
    return f32_add(f32_mul(d, static_cast<float>(q)), m);
  }
};
struct Q8_0 : PerWeight<Q8_0, 32> {                                               // x * d
  float d;
  GB_HD explicit Q8_0(const uint8_t* b) : d(f16_to_f32(le16(b))) {}
  GB_HD float operator()(const uint8_t* b, int j) const {
    return f32_mul(static_cast<float>(static_cast<int8_t>(b[2 + j])), d);
  }
};

// Q4_K / Q5_K 6-bit scales and mins of sub-block i (Q4_K.get_scale_min):
//   sc[i] = s[i] & 63,  m[i] = s[i + 4] & 63                                         (i < 4)
//   sc[i] = (s[i + 4] & 15) | ((s[i - 4] >> 2) & 48),  m[i] = (s[i + 4] >> 4) | ((s[i] >> 2) & 48)   (i >= 4)
GB_HD void k_scale_min(const uint8_t* s, int i, uint32_t* sc, uint32_t* m) {
  if (i < 4) {
    *sc = s[i] & 63u, *m = s[i + 4] & 63u;
  } else {
    *sc = (s[i + 4] & 15u) | ((s[i - 4] >> 2) & 48u);
    *m = (s[i + 4] >> 4) | ((s[i] >> 2) & 48u);
  }
}
// Q4_K (Q5_K with qh): weight w = 32 i + l of sub-block i: (d * sc) * q - (dmin * m).
// q: nibble (i & 1) of qs[32 (i / 2) + l], plus bit i of qh[l] << 4 (Q5_K).
template <bool Q5>
struct QK45 {
  float d, dmin;
  GB_HD explicit QK45(const uint8_t* b) : d(f16_to_f32(le16(b))), dmin(f16_to_f32(le16(b + 2))) {}
  GB_HD void scales(const uint8_t* b, int i, float* ds, float* dm) const {   // d * sc, dmin * m
    uint32_t sc, m;
    k_scale_min(b + 4, i, &sc, &m);
    *ds = f32_mul(d, static_cast<float>(sc)), *dm = f32_mul(dmin, static_cast<float>(m));
  }
  GB_HD float value(const uint8_t* b, int i, int l, float ds, float dm) const {
    const uint8_t* qs = b + (Q5 ? 48 : 16);
    uint32_t q = (qs[32 * (i >> 1) + l] >> (4 * (i & 1))) & 0xFu;
    if (Q5) q |= ((b[16 + l] >> i) & 1u) << 4;
    return f32_sub(f32_mul(ds, static_cast<float>(q)), dm);
  }
  GB_HD float operator()(const uint8_t* b, int w) const {
    float ds, dm;
    scales(b, w >> 5, &ds, &dm);
    return value(b, w >> 5, w & 31, ds, dm);
  }
  GB_HD void all(const uint8_t* b, float* y) const {
    for (int i = 0; i < 8; ++i) {
      float ds, dm;
      scales(b, i, &ds, &dm);
      for (int l = 0; l < 32; ++l) y[32 * i + l] = value(b, i, l, ds, dm);
    }
  }
  GB_HD void run(const uint8_t* b, int j0, int n, float* y) const {   // [j0, j0 + n) in one sub-block
    float ds, dm;
    scales(b, j0 >> 5, &ds, &dm);
    for (int j = 0; j < n; ++j) y[j] = value(b, j0 >> 5, (j0 & 31) + j, ds, dm);
  }
};
// Q6_K: weight w = 128 h + 32 g + l (h < 2, g < 4, l < 32):
//   ql nibble (g >> 1) of ql[64 h + 32 (g & 1) + l], qh bits 2g of qh[32 h + l]; q = (ql | qh << 4) - 32
//   y = (d * scales[w / 16]) * q
struct Q6_K {
  float d;
  GB_HD explicit Q6_K(const uint8_t* b) : d(f16_to_f32(le16(b + 208))) {}
  GB_HD float scale(const uint8_t* b, int s) const {                          // d * scales[s]
    return f32_mul(d, static_cast<float>(static_cast<int8_t>(b[192 + s])));
  }
  GB_HD float value(const uint8_t* b, int w, float ds) const {
    const int h = w >> 7, g = (w >> 5) & 3, l = w & 31;
    const uint32_t lo = (b[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 0xFu;
    const uint32_t hi = (b[128 + 32 * h + l] >> (2 * g)) & 3u;
    return f32_mul(ds, static_cast<float>(static_cast<int>(lo | (hi << 4)) - 32));
  }
  GB_HD float operator()(const uint8_t* b, int w) const { return value(b, w, scale(b, w >> 4)); }
  GB_HD void all(const uint8_t* b, float* y) const {
    for (int s = 0; s < 16; ++s) {
      const float ds = scale(b, s);
      for (int w = 16 * s; w < 16 * s + 16; ++w) y[w] = value(b, w, ds);
    }
  }
  GB_HD void run(const uint8_t* b, int j0, int n, float* y) const {   // [j0, j0 + n) under one scale
    const float ds = scale(b, j0 >> 4);
    for (int j = 0; j < n; ++j) y[j] = value(b, j0 + j, ds);
  }
};

// Weights [j0, j0 + n) of a block, n <= 16 and the run inside one (sub-)block scale (n = 8 at a
// multiple of 8 always is): the block's scales read once. The GPU's way; the same bits as all().
GB_HD void dequantize_run(int64_t code, const uint8_t* block, int j0, int n, float* y) {
  switch (code) {
    case 2: Q4_0(block).run(block, j0, n, y); return;
    case 3: Q4_1(block).run(block, j0, n, y); return;
    case 6: Q5_0(block).run(block, j0, n, y); return;
    case 7: Q5_1(block).run(block, j0, n, y); return;
    case 8: Q8_0(block).run(block, j0, n, y); return;
    case 12: QK45<false>(block).run(block, j0, n, y); return;
    case 13: QK45<true>(block).run(block, j0, n, y); return;
    case 14: Q6_K(block).run(block, j0, n, y); return;
    default: for (int j = 0; j < n; ++j) y[j] = 0.0f;
  }
}

// Every weight of a block. Returns false for a code this header has no dequantizer for.
GB_HD bool dequantize_block(int64_t code, const uint8_t* block, float* y) {
  switch (code) {
    case 2: Q4_0(block).all(block, y); return true;
    case 3: Q4_1(block).all(block, y); return true;
    case 6: Q5_0(block).all(block, y); return true;
    case 7: Q5_1(block).all(block, y); return true;
    case 8: Q8_0(block).all(block, y); return true;
    case 12: QK45<false>(block).all(block, y); return true;
    case 13: QK45<true>(block).all(block, y); return true;
    case 14: Q6_K(block).all(block, y); return true;
    default: return false;
  }
}

}  // namespace gguf
}  // namespace wcodec
