// y = x W^T + b on the CPU for a bf16/fp16 weight W [N, K] and x [..., K] of W's dtype: the served
// model's Linears (service/model/cpu_dtype.py).
//
// Why: PyTorch's bf16 matmul on the CPU reads a one-row call's weight at 4-8 GB/s on this project's
// AVX-512 machines, a third of what their memory gives (and without AVX512-BF16 it runs a slower
// fallback), and at batch 1 a decode step is those reads (docs/BENCHMARKS.md). Products of two 16-bit
// floats are exact; here they are summed in float32 and rounded once to W's dtype, so the result
// differs from PyTorch's only in the order of the sums. That order is fixed per output, whatever the
// call's rows or where row r sits in it, so a request's logits are the same alone and batched (the
// engine's batch invariance); that is why every call goes here, not only the one-row ones.
//
// Both SIMD loops read W in blocks of 32 weight rows x 32 k, transposed so that dword t * 2 + g of a
// block holds k-pair t (k = 2t, 2t + 1) of its 16 outputs 16 g .. 16 g + 15: the 16 outputs lie along
// a vector's lanes, and no sum is horizontal. `linear16_pack` transposes a weight's blocks once (at
// load); an unpacked call transposes each block into a thread's buffer before it multiplies, so both
// give the same bits. Three loops, one chosen per process:
//
//   bf16 on AVX512-BF16   dot_rows: vdpbf16ps; a lane adds its two products in turn (element
//                         2t + 1, then 2t; subnormals read and written as zero)
//   other AVX-512         fma_rows: each pair's two weights widened exactly (bf16: a mask or a
//                         16-bit shift; fp16: vcvtph2ps) and FMAed into the lane: s = fl(s + w_k x_k)
//                         for k = 0, 1, ..., K - 1, from s = +0, one rounding a step
//   no AVX-512            block_scalar (or WCODEC_CPU_SIMD=0): fma_rows's sums with std::fma, bit for
//                         bit (cuda_ext/linear16.py's reference too)
//
// A call's blocks are pieces of work for the caller and cpu_pool.h's helpers (not an OpenMP region:
// a one-row call is 30-1200 us, and a region a call waited on sleeping or descheduled workers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define WCODEC_LINEAR16_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define WCODEC_LINEAR16_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace wcodec {
namespace {

constexpr int64_t kPieceWork = 1 << 16;      // multiply-adds a piece of a call at least (cpu_pool.h)
constexpr int kBlockOuts = 32;               // outputs a block (two vectors' lanes)
constexpr int kTileRows = 12;                // rows of x a tile: 24 accumulators
constexpr int kBlockK = 32;                  // k a transposed chunk of a block (16 pairs)

inline int64_t block_dwords(int64_t k_len) { return (k_len + kBlockK - 1) / kBlockK * 16 * kBlockOuts; }

bool bf16_dot_allowed() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

bool simd_allowed() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                          !(std::getenv("WCODEC_CPU_SIMD") && std::string(std::getenv("WCODEC_CPU_SIMD")) == "0");
  return yes;
#else
  return false;
#endif
}

inline float widen_scalar(uint16_t v, bool half) {
  if (half) return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// out = n 16-bit floats widened to float32
void widen_all(const uint16_t* in, int64_t n, bool half, std::vector<float>& out) {
  out.resize(n);
  for (int64_t i = 0; i < n; ++i) out[i] = widen_scalar(in[i], half);
}

// the weight's dtype from float32, rounded to nearest even (c10's conversions; a NaN stays a NaN)
inline uint16_t round_scalar(float v, bool half) {
  return half ? c10::Half(v).x : c10::BFloat16(v).x;
}

struct Problem {
  const float* x;         // [rows, k] float32 (the FMA loops)
  const uint16_t* x16;    // [rows, k] in the weight's dtype
  const uint16_t* w;      // [n, k], or packed (linear16_pack)
  const uint16_t* bias;   // [n] in the weight's dtype, or null
  uint16_t* y;            // [rows, n] in the weight's dtype: round(sum + bias), one rounding
  int64_t rows, k, n;
  bool half;
};

// weight rows [o0, o1) against every row of x: fma_rows's sums, s = fl(s + w_k x_k) in k order
void block_scalar(const Problem& p, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r = 0; r < p.rows; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < p.k; ++k) sum = std::fma(widen_scalar(p.w[o * p.k + k], p.half), p.x[r * p.k + k], sum);
      if (p.bias) sum += widen_scalar(p.bias[o], p.half);
      p.y[r * p.n + o] = round_scalar(sum, p.half);
    }
}

#if defined(__x86_64__)
// 16 x 16 dwords: in[i] = row i's 16 k-pairs -> out[t] = k-pair t of rows 0..15
WCODEC_LINEAR16_AVX512 inline void transpose16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(v[i + j], v[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    v[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    v[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// the k-pairs of weight rows [o, o + outs) (outs <= 32; rows past them zero), transposed as the
// loops read them: pair t of output 16 g + i at wt[(t * 2 + g) * 16 + i], pairs past the last
// 32-k chunk zero. A dword's low half is k = 2t, its high half k = 2t + 1.
//
//   block (32 outputs x K)   [ pair 0: outputs 0-15 | outputs 16-31 ][ pair 1: ... ] ... [ pair K/2 - 1 ]
WCODEC_LINEAR16_AVX512 void pack_block(const uint16_t* w, int64_t k_len, int64_t o, int outs, uint32_t* wt) {
  for (int g = 0; g < 2; ++g)
    for (int64_t k = 0, c = 0; k < k_len; k += kBlockK, ++c) {
      const int kk = static_cast<int>(std::min<int64_t>(kBlockK, k_len - k));
      const __mmask32 m = kk == kBlockK ? ~__mmask32(0) : __mmask32((1u << kk) - 1);
      __m512i v[16];
      for (int i = 0; i < 16; ++i)
        v[i] = 16 * g + i < outs ? _mm512_maskz_loadu_epi16(m, w + (o + 16 * g + i) * k_len + k) : _mm512_setzero_si512();
      transpose16(v);
      for (int t = 0; t < 16; ++t) _mm512_storeu_si512(wt + ((c * 16 + t) * 2 + g) * 16, v[t]);
    }
}

// 16 values in the weight's dtype (lanes past `keep` zero) as float32, exactly
template <bool Half>
WCODEC_LINEAR16_AVX512 inline __m512 widen16(const uint16_t* ptr, __mmask16 keep) {
  const __m256i h = _mm256_maskz_loadu_epi16(keep, ptr);
  if constexpr (Half) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// outputs [o, o + 16) of row r (the lanes of `keep`): sums + bias (float32), rounded once to the
// weight's dtype as round_scalar rounds (bf16: u + 0x7FFF + the kept part's lowest bit, NaN 0x7FC0)
template <bool Half>
WCODEC_LINEAR16_AVX512 inline void store16(const Problem& p, __m512 sum, int64_t r, int64_t o, __mmask16 keep) {
  if (p.bias) sum = _mm512_add_ps(sum, widen16<Half>(p.bias + o, keep));
  __m256i h;
  if constexpr (Half) {
    h = _mm512_cvtps_ph(sum, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m512i u = _mm512_castps_si512(sum);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    h = _mm512_cvtepi32_epi16(b);
  }
  _mm256_mask_storeu_epi16(p.y + r * p.n + o, keep, h);
}

// bf16 on a CPU with AVX512-BF16: vdpbf16ps multiplies row r's k-pair t (broadcast) by vector t
// and adds each lane's two products to its float32 sum in turn (element 2t + 1, then 2t; round to
// nearest; subnormals read and written as zero). Output (r, o) is one lane summing k = 0, 1, ...
template <int Rows>
WCODEC_LINEAR16_BF16 void dot_rows(const Problem& p, const uint32_t* wt, int64_t o, int64_t r, __mmask16 keep0,
                                   __mmask16 keep1) {
  __m512 acc0[Rows], acc1[Rows];
  for (int j = 0; j < Rows; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
  const int64_t pairs = (p.k + 1) / 2;                   // an odd K's last element pairs with a zero
  for (int64_t t = 0; t < pairs; ++t) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wt + t * 32);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wt + t * 32 + 16);
    const bool whole = 2 * t + 1 < p.k;
    for (int j = 0; j < Rows; ++j) {
      int32_t pair = p.x16[(r + j) * p.k + 2 * t];
      if (whole) std::memcpy(&pair, p.x16 + (r + j) * p.k + 2 * t, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc0[j] = _mm512_dpbf16_ps(acc0[j], xv, w0);
      acc1[j] = _mm512_dpbf16_ps(acc1[j], xv, w1);
    }
  }
  for (int j = 0; j < Rows; ++j) {
    store16<false>(p, acc0[j], r + j, o, keep0);
    if (keep1) store16<false>(p, acc1[j], r + j, o + 16, keep1);
  }
}

// a vector of k-pairs -> its k = 2t (low halves) and k = 2t + 1 (high halves) as float32, exactly
template <bool Half>
WCODEC_LINEAR16_AVX512 inline void widen_pairs(__m512i v, __m512& even, __m512& odd) {
  if constexpr (Half) {
    even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  } else {
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  }
}

// a block's k-pair t into the accumulators of Rows rows of x (row j at x + j * k): k = 2t, then,
// with Both, k = 2t + 1 (an odd K's last pair has k = K - 1 alone)
template <bool Half, int Rows, bool Both>
WCODEC_LINEAR16_AVX512 __attribute__((always_inline)) inline void fma_pair(const uint32_t* wt, const float* x,
                                                                            int64_t k, int64_t t, __m512* acc0,
                                                                            __m512* acc1) {
  __m512 e0, d0, e1, d1;                                 // k = 2t and 2t + 1 of outputs 0-15, 16-31
  widen_pairs<Half>(_mm512_loadu_si512(wt + t * 32), e0, d0);
  widen_pairs<Half>(_mm512_loadu_si512(wt + t * 32 + 16), e1, d1);
  for (int j = 0; j < Rows; ++j) {
    const __m512 xe = _mm512_set1_ps(x[j * k + 2 * t]);
    acc0[j] = _mm512_fmadd_ps(e0, xe, acc0[j]);
    acc1[j] = _mm512_fmadd_ps(e1, xe, acc1[j]);
    if constexpr (Both) {
      const __m512 xo = _mm512_set1_ps(x[j * k + 2 * t + 1]);
      acc0[j] = _mm512_fmadd_ps(d0, xo, acc0[j]);
      acc1[j] = _mm512_fmadd_ps(d1, xo, acc1[j]);
    }
  }
}

// every other AVX-512 CPU (and fp16): rows [r, r + Rows) of x (float32) against a block's k-pairs;
// lane i of acc_g[j] is output 16 g + i of row r + j: s = fl(s + w_k x_k), k = 0, 1, ... in order
template <bool Half, int Rows>
WCODEC_LINEAR16_AVX512 void fma_rows(const Problem& p, const uint32_t* wt, int64_t o, int64_t r, __mmask16 keep0,
                                     __mmask16 keep1) {
  __m512 acc0[Rows], acc1[Rows];
  for (int j = 0; j < Rows; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
  const float* x = p.x + r * p.k;
  const int64_t pairs = p.k / 2;
  for (int64_t t = 0; t < pairs; ++t) fma_pair<Half, Rows, true>(wt, x, p.k, t, acc0, acc1);
  if (p.k % 2) fma_pair<Half, Rows, false>(wt, x, p.k, pairs, acc0, acc1);
  for (int j = 0; j < Rows; ++j) {
    store16<Half>(p, acc0[j], r + j, o, keep0);
    if (keep1) store16<Half>(p, acc1[j], r + j, o + 16, keep1);
  }
}

enum Loop { kDot, kFmaBf16, kFmaHalf };

template <Loop L, int Rows>
void tile(const Problem& p, const uint32_t* wt, int64_t o, int64_t r, __mmask16 keep0, __mmask16 keep1) {
  if constexpr (L == kDot) dot_rows<Rows>(p, wt, o, r, keep0, keep1);
  else fma_rows<L == kFmaHalf, Rows>(p, wt, o, r, keep0, keep1);
}

// every row of x against one block's transposed k-pairs: outputs [o, o + outs)
template <Loop L>
void run_block(const Problem& p, const uint32_t* wt, int64_t o, int outs) {
  const auto lanes = [](int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(n, 0)) - 1); };
  const __mmask16 keep0 = lanes(outs), keep1 = lanes(outs - 16);
  int64_t r = 0;
  for (; r + kTileRows <= p.rows; r += kTileRows) tile<L, kTileRows>(p, wt, o, r, keep0, keep1);
  switch (p.rows - r) {
#define WCODEC_TILE_CASE(n) case n: tile<L, n>(p, wt, o, r, keep0, keep1); break;
    WCODEC_TILE_CASE(1) WCODEC_TILE_CASE(2) WCODEC_TILE_CASE(3) WCODEC_TILE_CASE(4) WCODEC_TILE_CASE(5)
    WCODEC_TILE_CASE(6) WCODEC_TILE_CASE(7) WCODEC_TILE_CASE(8) WCODEC_TILE_CASE(9) WCODEC_TILE_CASE(10)
    WCODEC_TILE_CASE(11)
#undef WCODEC_TILE_CASE
    default: break;
  }
}

// outputs [o0, o1) of an unpacked weight: each block transposed into this thread's buffer, then multiplied
template <Loop L>
void block_unpacked(const Problem& p, int64_t o0, int64_t o1) {
  thread_local std::vector<uint32_t> wt;
  wt.resize(block_dwords(p.k));
  for (int64_t o = o0; o < o1; o += kBlockOuts) {
    const int outs = static_cast<int>(std::min<int64_t>(kBlockOuts, o1 - o));
    pack_block(p.w, p.k, o, outs, wt.data());
    run_block<L>(p, wt.data(), o, outs);
  }
}

// a weight packed once (linear16_pack): block o / 32's pairs at packed + (o / 32) * block_dwords
template <Loop L>
void block_packed(const Problem& p, int64_t o0, int64_t o1) {
  const auto* packed = reinterpret_cast<const uint32_t*>(p.w);
  for (int64_t o = o0; o < o1; o += kBlockOuts)
    run_block<L>(p, packed + o / kBlockOuts * block_dwords(p.k), o,
                 static_cast<int>(std::min<int64_t>(kBlockOuts, o1 - o)));
}

template <Loop L>
void block_simd(const Problem& p, int64_t o0, int64_t o1, bool packed) {
  packed ? block_packed<L>(p, o0, o1) : block_unpacked<L>(p, o0, o1);
}
#endif

bool packable(const at::Tensor& weight) {
  return weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.size(0) % kBlockOuts == 0 &&
         weight.size(1) % kBlockK == 0;
}

at::Tensor linear16_impl(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         bool packed) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "linear16: the weight must be bfloat16 or float16, not ",
              dtype);
  TORCH_CHECK(x.scalar_type() == dtype, "linear16: x is ", x.scalar_type(), ", the weight ", dtype);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "linear16: the weight must be a contiguous [N, K] matrix");
  const int64_t k_len = weight.size(1), n_out = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k_len, "linear16: x's last dimension is ", x.size(-1),
              ", the weight's K is ", k_len);
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_out && bias->scalar_type() == dtype,
                        "linear16: bias must be [N] of the weight's dtype");
  const int64_t rows = k_len ? x.numel() / k_len : 0;

  auto out_shape = x.sizes().vec();
  out_shape.back() = n_out;
  const bool simd = simd_allowed(), dot = dtype == at::kBFloat16 && simd && bf16_dot_allowed();
  TORCH_CHECK(!packed || (simd && packable(weight)), "linear16_packed: needs AVX-512 and a bf16 weight of "
              "[N, K], N and K multiples of 32 (linear16_pack)");
  if (!k_len) {                                                   // sums of nothing: the bias
    auto y = at::zeros({rows, n_out}, x.options().dtype(at::kFloat));
    if (bias) y.add_(bias->to(at::kFloat));
    return y.to(dtype).view(out_shape);
  }
  auto y = at::empty(out_shape, x.options());                     // every output written below
  if (!rows || !n_out) return y;
  const auto x16 = x.is_contiguous() ? x : x.contiguous();
  const auto b16 = bias && !bias->is_contiguous() ? bias->contiguous() : bias.value_or(at::Tensor());
  const auto* x16p = reinterpret_cast<const uint16_t*>(x16.data_ptr());
  thread_local std::vector<float> xf;                             // x widened (the FMA and scalar loops)
  if (!dot) widen_all(x16p, rows * k_len, dtype == at::kHalf, xf);
  const Problem p{dot ? nullptr : xf.data(), x16p, reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                  b16.defined() ? reinterpret_cast<const uint16_t*>(b16.data_ptr()) : nullptr,
                  reinterpret_cast<uint16_t*>(y.data_ptr()), rows, k_len, n_out, dtype == at::kHalf};
  const int64_t blocks = (n_out + kBlockOuts - 1) / kBlockOuts;
  const int64_t piece = std::max<int64_t>(1, kPieceWork / (kBlockOuts * k_len * rows));     // blocks a piece
  const CpuPool::Span span{static_cast<const char*>(weight.data_ptr()), static_cast<int64_t>(weight.nbytes())};
  CpuPool::instance(at::get_num_threads() - 1).run((blocks + piece - 1) / piece, [&](int64_t c) {
    const int64_t o0 = c * piece * kBlockOuts, o1 = std::min((c + 1) * piece * kBlockOuts, n_out);
#if defined(__x86_64__)
    if (simd) {
      dot ? block_simd<kDot>(p, o0, o1, packed)
          : p.half ? block_simd<kFmaHalf>(p, o0, o1, packed) : block_simd<kFmaBf16>(p, o0, o1, packed);
      return;
    }
#endif
    block_scalar(p, o0, o1);
  }, span);
  return y;
}

at::Tensor linear16_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return linear16_impl(x, weight, bias, false);
}

at::Tensor linear16_packed_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return linear16_impl(x, packed, bias, true);
}

// W [N, K] in the layout an unpacked call transposes each of its blocks into, once: the same bytes
// (N and K multiples of 32, so no padding), and the same sums, bit for bit, with no transposes per call
at::Tensor linear16_pack_cpu(const at::Tensor& weight) {
  TORCH_CHECK(packable(weight) && weight.is_contiguous(),
              "linear16_pack: the weight must be a contiguous bf16 [N, K], N and K multiples of 32");
  TORCH_CHECK(simd_allowed(), "linear16_pack: this CPU has no AVX-512 (or WCODEC_CPU_SIMD=0)");
  auto out = at::empty_like(weight);
  const int64_t k_len = weight.size(1), blocks = weight.size(0) / kBlockOuts;
#if defined(__x86_64__)
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* packed = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      pack_block(w, k_len, b * kBlockOuts, kBlockOuts, packed + b * block_dwords(k_len));
  });
#endif
  return out;
}

// the loop linear16 runs for `dtype` in this process: "vdpbf16ps", "fma" or "scalar" (the caller's
// one source: service/model/cpu_dtype.py packs weights and picks linear16 where it is not "scalar")
std::string linear16_loop(c10::ScalarType dtype) {
  if (!simd_allowed()) return "scalar";
  return dtype == at::kBFloat16 && bf16_dot_allowed() ? "vdpbf16ps" : "fma";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("linear16_loop(ScalarType dtype) -> str", &linear16_loop);
  m.def("linear16(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("linear16_packed(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("linear16_pack(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("linear16", &linear16_cpu);
  m.impl("linear16_packed", &linear16_packed_cpu);
  m.impl("linear16_pack", &linear16_pack_cpu);
}

}  // namespace wcodec
