// The fused y = x W^T for 1..16 rows of x, W in the fixed-rate form (fixedrate_gemv.cuh has the
// decode steps). A warp takes R rows of W and walks their escape blocks (1024 weights a row a
// step), lane l decoding group l of each into registers; every weight is used for all B rows of x
// (float32 accumulation, one rounding at the end, as the reference in fixedrate.cpp). x is read
// through L1 (it is reused by every row); W bypasses it. Split-K inside the CTA when rows are few.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fixedrate_gemv.cuh"

namespace wcodec {
namespace {

constexpr int kTargetWarps = 8192;      // enough warps in flight for a 132-SM part: split K below it

template <bool kBf16>
__device__ __forceinline__ float2 pair_to_float2(uint32_t w) {
  if constexpr (kBf16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  }
}

// Eight weights (words 2qq, 2qq + 1 of the group) as floats.
template <bool kBf16>
__device__ __forceinline__ void eight_weights(const FrGroup& t, const uint32_t f[8], int qq, float w[8]) {
  uint32_t p[4];
  join4(plane_word(t, 2 * qq), f[2 * qq], p[0], p[1]);
  join4(plane_word(t, 2 * qq + 1), f[2 * qq + 1], p[2], p[3]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = pair_to_float2<kBf16>(p[i]);
    w[2 * i] = v.x, w[2 * i + 1] = v.y;
  }
}

// acc[r][bb] += w[r][0..7] . x[bb][k .. k+8] for every row of x.
template <bool kBf16, int B, int R>
__device__ __forceinline__ void dot8(const uint16_t* __restrict__ x, int64_t kp, int64_t k, bool valid, int nx,
                                     const float (&w)[R][8], float (&acc)[R][B]) {
#pragma unroll
  for (int bb = 0; bb < B; ++bb) {
    if (bb >= nx) break;
    const uint4 xv = valid ? __ldg(reinterpret_cast<const uint4*>(x + bb * kp + k)) : make_uint4(0, 0, 0, 0);
    const float2 x0 = pair_to_float2<kBf16>(xv.x), x1 = pair_to_float2<kBf16>(xv.y);
    const float2 x2 = pair_to_float2<kBf16>(xv.z), x3 = pair_to_float2<kBf16>(xv.w);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = acc[r][bb];
      s = fmaf(w[r][0], x0.x, s), s = fmaf(w[r][1], x0.y, s), s = fmaf(w[r][2], x1.x, s), s = fmaf(w[r][3], x1.y, s);
      s = fmaf(w[r][4], x2.x, s), s = fmaf(w[r][5], x2.y, s), s = fmaf(w[r][6], x3.x, s), s = fmaf(w[r][7], x3.y, s);
      acc[r][bb] = s;
    }
  }
}

// Sum each accumulator over the warp, then over the CTA's split-K warps; write y [nx, rows].
template <bool kBf16, int B, int R>
__device__ __forceinline__ void reduce_store(const FrArrays& a, float (&acc)[R][B], int64_t row0, int splits, int nx,
                                             uint16_t* __restrict__ y) {
  __shared__ float red[kFrWarps][R][B];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int bb = 0; bb < B; ++bb) {
      float v = acc[r][bb];
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
      if (lane == 0) red[warp][r][bb] = v;
    }
  __syncthreads();
  if (warp % splits != 0) return;
  for (int i = lane; i < R * B; i += 32) {
    const int r = i / B, bb = i % B;
    float s = 0.f;
    for (int j = 0; j < splits; ++j) s += red[warp + j][r][bb];
    if (row0 + r < a.rows && bb < nx) y[bb * a.rows + row0 + r] = from_float<kBf16>(s);
  }
}

template <bool kBf16, int B, int R>
__global__ void __launch_bounds__(32 * kFrWarps) gemv_kernel(FrArrays a, const uint16_t* __restrict__ x, int nx,
                                                             int splits, uint16_t* __restrict__ y) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = (blockIdx.x * static_cast<int64_t>(kFrWarps / splits) + warp / splits) * R;
  const int64_t kp = a.groups * kFrGroup;
  __shared__ uint4 stage[32 * kFrWarps][2];
  int32_t starts[R];                    // lane l: esc_start of block l of each row (blocks 32 on: loaded when due)
#pragma unroll
  for (int r = 0; r < R; ++r)
    starts[r] = lane < a.blocks ? a.esc_start[min(row0 + r, a.rows - 1) * a.blocks + lane] : 0;
  float acc[R][B] = {};
  for (int64_t blk = warp % splits; blk < a.blocks; blk += splits) {
    uint32_t f[R][8];
    FrGroup t[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = min(row0 + r, a.rows - 1);
      const int32_t start = blk < 32 ? __shfl_sync(0xffffffffu, starts[r], static_cast<int>(blk))
                                     : a.esc_start[row * a.blocks + blk];
      t[r] = block_fields(a, row, blk, start, stage[threadIdx.x], f[r]);
    }
    const int64_t gr = blk * kFrBlockGroups + lane, k0 = gr * kFrGroup;
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
      float w[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) eight_weights<kBf16>(t[r], f[r], qq, w[r]);
      dot8<kBf16, B, R>(x, kp, k0 + 8 * qq, gr < a.groups, nx, w, acc);
    }
  }
  reduce_store<kBf16, B, R>(a, acc, row0, splits, nx, y);
}

template <bool kBf16, int B, int R>
void launch(const FrArrays& a, const uint16_t* x, int nx, uint16_t* y, cudaStream_t stream) {
  const int64_t row_groups = (a.rows + R - 1) / R;
  int splits = 1;
  while (splits < kFrWarps && row_groups * splits < kTargetWarps && splits * 2 <= a.blocks) splits *= 2;
  const int64_t ctas = (row_groups + kFrWarps / splits - 1) / (kFrWarps / splits);
  gemv_kernel<kBf16, B, R><<<static_cast<unsigned>(ctas), 32 * kFrWarps, 0, stream>>>(a, x, nx, splits, y);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kBf16>
void launch_dtype(const FrArrays& a, const uint16_t* x, int nx, uint16_t* y, cudaStream_t stream) {
  if (nx <= 1) launch<kBf16, 1, 1>(a, x, nx, y, stream);
  else if (nx <= 2) launch<kBf16, 2, 1>(a, x, nx, y, stream);
  else if (nx <= 4) launch<kBf16, 4, 1>(a, x, nx, y, stream);
  else if (nx <= 8) launch<kBf16, 8, 2>(a, x, nx, y, stream);
  else launch<kBf16, 16, 4>(a, x, nx, y, stream);
}

}  // namespace

void launch_gemv(const FrArrays& a, const at::Tensor& x, const at::Tensor& y, cudaStream_t stream) {
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int nx = static_cast<int>(x.size(0));
  if (x.scalar_type() == at::kBFloat16) launch_dtype<true>(a, xp, nx, yp, stream);
  else launch_dtype<false>(a, xp, nx, yp, stream);
}

}  // namespace wcodec
