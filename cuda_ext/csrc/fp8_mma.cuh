// What the W8A16 matmul's two kernels share (fp8_linear.cu: the layout of the mma's fragments, 1..16
// rows of x in cols_kernel, the host side; fp8_rows.cu: 17..64 rows in rows_kernel): the arguments,
// the decode of e4m3 pairs to bf16, a warp's strip of W, the mma of a half step, and
// where a sum goes. Internal linkage (an unnamed namespace), as fixedrate_mma.cuh: each kernel file
// compiles its own copy.
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "fp8.h"
#include "launch.cuh"

namespace wcodec {

struct Fp8Args {
  const uint8_t* w;
  const uint16_t* x;
  const float* scale;
  float* part;                                                      // [splits, nx, n] where splits > 1
  uint16_t* y;                                                      // [nx, n]
  int64_t n, k;
  int nx, steps, splits, bo, scale_cols;                             // scale_cols 1: applied after the sum
};

// 17..64 rows of x (fp8_rows.cu): rows_kernel on `grid` (CTAs of kWarps warps, 16 rows of W each, by
// ranges of K).
void launch_fp8_rows(const Fp8Args& a, dim3 grid, cudaStream_t stream);

namespace {

constexpr int kWarps = 8;                                           // a CTA's warps, both kernels
constexpr int kStages = 4;                                          // rows_kernel: steps of W and x in flight (splits_for's least)

// Bytes 0, 1 (kHigh: 2, 3) of v -> the bf16 pair of their e4m3 values (fp8.h): a permute, a rotate,
// a mask, a multiply.
template <bool kHigh>
__device__ __forceinline__ uint32_t fp8_pair(uint32_t v) {
  uint32_t p;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(p) : "r"(v), "n"(kHigh ? 0x3A2B : 0x1809));   // sign-replicate bytes 9, B
  p = __funnelshift_r(p, p, 4) & 0x87F087F0u;                       // s << 15 | mag << 4: the value * 2^-120
  uint32_t out;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(p), "r"(kBf16Two120 * 0x10001u), "r"(0x80008000u));
  return out;                                                        // * 2^120 + (-0): exact
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {  // i known at compile time
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// A warp's rows of W (lane (g, t): rows g, g + 8 from n0) and its CTA's range of K's steps [s0, s1).
struct Strip {
  const uint8_t* row_g;
  const uint8_t* row_h;
  const float* block_scale;                                         // its grid row (block scales)
  int s0, s1;
};

__device__ __forceinline__ Strip strip(const Fp8Args& a, int64_t n0) {
  const int g = (threadIdx.x & 31) >> 2, split = blockIdx.y;
  const int64_t last = a.n - 1;                                     // rows past n: row n - 1, never written
  return {a.w + std::min(n0 + g, last) * a.k, a.w + std::min(n0 + g + 8, last) * a.k,
          a.scale + (std::min(n0, last) / a.bo) * a.scale_cols,     // bo % 16 == 0 where block: one grid row
          static_cast<int>(static_cast<int64_t>(split) * a.steps / a.splits),
          static_cast<int>(static_cast<int64_t>(split + 1) * a.steps / a.splits)};
}

// Half h of a step's W, decoded: the A operands of its four mma (j = 0..3).
__device__ __forceinline__ void decode_half(const uint4 (&w)[4], int h, uint32_t (&a)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t wg = word(w[2 * h], j), wh = word(w[2 * h + 1], j);
    a[j][0] = fp8_pair<false>(wg), a[j][1] = fp8_pair<false>(wh);
    a[j][2] = fp8_pair<true>(wg), a[j][3] = fp8_pair<true>(wh);
  }
}

// c += the half's A times a tile of x as B: x's columns 64h + 16t .. as lo (8) and hi (8) bf16.
__device__ __forceinline__ void half_tile(const uint32_t (&a)[4][4], const uint4& lo, const uint4& hi, float (&c)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t b0 = j < 2 ? word(lo, 2 * j) : word(hi, 2 * j - 4);
    const uint32_t b1 = j < 2 ? word(lo, 2 * j + 1) : word(hi, 2 * j - 3);
    mma16816<true>(c, a[j][0], a[j][1], a[j][2], a[j][3], b0, b1);
  }
}

// A step's sums (c) into acc: added, or (block scales) times the step's scale.
template <int kNt>
__device__ __forceinline__ void add_step(const Fp8Args& a, const Strip& st, int s, const float (&c)[kNt][4],
                                         float (&acc)[kNt][4]) {
  const float sc = __ldg(st.block_scale + s);
#pragma unroll
  for (int m = 0; m < kNt; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[m][e] += sc * c[m][e];
}

// One sum of C (tile m: c0, c1 at W row g, x rows 8m + 2t, + 1; c2, c3 at W row g + 8): y (times the
// row's scale for a one-column grid, rounded) or the range's part.
__device__ __forceinline__ void put(const Fp8Args& a, int64_t n0, int lane, int m, int e, float sum) {
  const int64_t row = n0 + (lane >> 2) + (e >= 2 ? 8 : 0);
  const int xr = 8 * m + 2 * (lane & 3) + (e & 1);
  if (row >= a.n || xr >= a.nx) return;
  if (a.splits > 1) {
    a.part[(static_cast<int64_t>(blockIdx.y) * a.nx + xr) * a.n + row] = sum;
  } else {
    if (a.scale_cols == 1) sum *= __ldg(a.scale + row / a.bo);
    a.y[xr * a.n + row] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
  }
}

}  // namespace
}  // namespace wcodec
