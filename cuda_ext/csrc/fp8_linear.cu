// The W8A16 matmul on tensor cores (fp8.h; the CPU twin and schemas are fp8_linear.cpp): y = x W^T
// for x of 1..64 bf16 rows (32 a launch: 1, 2 or 4 n8 tiles of x) and W's float8_e4m3fn bytes, each
// weight decoded to bf16 in registers (nothing written back), mma.sync.m16n8k16 with float32 sums,
// one rounding; and fp8_dequantize, W times its scales rounded to bf16 (a prompt's matmul: cuBLAS).
// * A CTA takes 16 rows of W (the mma's A: lane (g, t) = (lane / 4, lane % 4) rows g and g + 8) and
//   a range of K's steps of kFp8Step columns; its kWarps warps take the range's steps in turn (warp
//   w steps w, w + kWarps, ...), so neighbouring warps read neighbouring bytes of a row.
// * In a step, lane t loads 16 bytes of each of its rows at columns 16t and 64 + 16t: word j (0..3)
//   of a load holds k = 16t + 4j .. + 3, which mma j takes as its k slots 2t, 2t + 1 (bytes 0, 1)
//   and 2t + 8, 2t + 9 (bytes 2, 3): a permutation of k inside the step that x (B: x row g, the n8
//   tile's column g) follows, so that x's words go to the mma as loaded (words 2j and 2j + 1 of its
//   16 columns 16t ..).
// * A block scale (bi = kFp8Step) multiplies each step's sums; a grid of one column multiplies
//   the final sum. The warps' sums are added in warp order through shared memory; where K is cut
//   across CTAs (few rows of W), each range's float32 sums go to a buffer that sum_kernel adds in
//   range order. The cut depends on W's shape and the device alone, so a row of x gets the same
//   bits in any batch.
// * Programmatic dependent launch (launch.cuh): a warp requests its first step of W before it
//   waits for the grid ahead; W is written only at load.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <algorithm>

#include "fp8.h"
#include "launch.cuh"

namespace wcodec {
namespace {

constexpr int kWarps = 8;

struct Fp8Args {
  const uint8_t* w;
  const uint16_t* x;
  const float* scale;
  float* part;                                                      // [splits, nx, n] where splits > 1
  uint16_t* y;                                                      // [nx, n]
  int64_t n, k;
  int nx, steps, splits, bo, scale_cols;                             // scale_cols 1: applied after the sum
};

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

__device__ __forceinline__ uint4 ld_stream(const void* p) {        // W: read once, not kept in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {  // i known at compile time
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int kNt>                                                  // n8 tiles of x: 1 (1..8 rows), 2, 4
struct Step {
  uint4 w[4];                                                       // rows g, g + 8 at columns 16t, then 64 + 16t
  uint4 x[kNt][4];                                                  // x rows g (+ 8): columns 16t .. 16t + 15, 64 + ..
};

template <int kNt>
__device__ __forceinline__ void load_w(const Fp8Args& a, const uint8_t* row_g, const uint8_t* row_h, int s, Step<kNt>& st) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t c = static_cast<int64_t>(s) * kFp8Step + 64 * h + 16 * t;
    const bool in = c < a.k;                                        // K % 16 == 0: a lane's 16 bytes are in or out
    st.w[2 * h] = in ? ld_stream(row_g + c) : make_uint4(0, 0, 0, 0);
    st.w[2 * h + 1] = in ? ld_stream(row_h + c) : make_uint4(0, 0, 0, 0);
  }
}

template <int kNt>
__device__ __forceinline__ void load_x(const Fp8Args& a, int s, Step<kNt>& st) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int m = 0; m < kNt; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t c = static_cast<int64_t>(s) * kFp8Step + 64 * h + 16 * t;
      const int r = g + 8 * m;
      const bool in = r < a.nx && c < a.k;
      const uint4* p = reinterpret_cast<const uint4*>(a.x + r * a.k + c);
      st.x[m][2 * h] = in ? __ldg(p) : make_uint4(0, 0, 0, 0);
      st.x[m][2 * h + 1] = in ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
    }
}

// A step's 8 mma a tile of x: W's words decoded as A, x's as B.
template <int kNt>
__device__ __forceinline__ void step_mma(const Step<kNt>& st, float (&c)[kNt][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t wg = word(st.w[2 * h], j), wh = word(st.w[2 * h + 1], j);
      const uint32_t a0 = fp8_pair<false>(wg), a2 = fp8_pair<true>(wg);
      const uint32_t a1 = fp8_pair<false>(wh), a3 = fp8_pair<true>(wh);
#pragma unroll
      for (int m = 0; m < kNt; ++m) {
        const uint4& lo = st.x[m][2 * h];
        const uint4& hi = st.x[m][2 * h + 1];
        const uint32_t b0 = j < 2 ? word(lo, 2 * j) : word(hi, 2 * j - 4);
        const uint32_t b1 = j < 2 ? word(lo, 2 * j + 1) : word(hi, 2 * j - 3);
        mma16816<true>(c[m], a0, a1, a2, a3, b0, b1);
      }
    }
}

template <int kNt>
__global__ void __launch_bounds__(32 * kWarps) fp8_linear_kernel(Fp8Args a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * 16;
  const int split = blockIdx.y;
  const int s0 = static_cast<int>(static_cast<int64_t>(split) * a.steps / a.splits);
  const int s1 = static_cast<int>(static_cast<int64_t>(split + 1) * a.steps / a.splits);
  const uint8_t* row_g = a.w + std::min(n0 + g, a.n - 1) * a.k;    // rows past n: row n - 1, never written
  const uint8_t* row_h = a.w + std::min(n0 + g + 8, a.n - 1) * a.k;
  const bool block = a.scale_cols > 1;
  const float* block_scale = a.scale + (n0 / a.bo) * a.scale_cols;  // bo % 16 == 0 where block: one grid row
  constexpr bool kXAhead = kNt <= 2;                                // x a step ahead too (4 tiles: 64 registers more)
  float acc[kNt][4] = {};
  int s = s0 + warp;
  Step<kNt> cur;
  if (s < s1) load_w(a, row_g, row_h, s, cur);
  pdl_wait();
  if (kXAhead && s < s1) load_x(a, s, cur);
  for (; s < s1; s += kWarps) {
    Step<kNt> next;
    if (s + kWarps < s1) {
      load_w(a, row_g, row_h, s + kWarps, next);
      if constexpr (kXAhead) load_x(a, s + kWarps, next);
    }
    if constexpr (!kXAhead) load_x(a, s, cur);
    if (block) {
      float c[kNt][4] = {};
      step_mma(cur, c);
      const float sc = __ldg(block_scale + s);
#pragma unroll
      for (int m = 0; m < kNt; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][e] += sc * c[m][e];
    } else {
      step_mma(cur, acc);
    }
    cur = next;
  }
  pdl_trigger();
  __shared__ float red[kWarps][kNt * 4][32];
#pragma unroll
  for (int m = 0; m < kNt; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp][4 * m + e][lane] = acc[m][e];
  __syncthreads();
  for (int i = threadIdx.x; i < kNt * 4 * 32; i += blockDim.x) {
    const int e = i / 32, l = i % 32;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][e][l];
    // C of tile m: c0, c1 (W row l / 4, x rows 2t, 2t + 1), c2, c3 (W row l / 4 + 8)
    const int64_t row = n0 + (l >> 2) + (e % 4 >= 2 ? 8 : 0);
    const int xr = 8 * (e / 4) + 2 * (l & 3) + (e & 1);
    if (row >= a.n || xr >= a.nx) continue;
    if (a.splits > 1) {
      a.part[(static_cast<int64_t>(split) * a.nx + xr) * a.n + row] = sum;
    } else {
      if (!block) sum *= __ldg(a.scale + row / a.bo);
      a.y[xr * a.n + row] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
    }
  }
}

// y = the ranges' sums added in range order (times the row's scale for a one-column grid), rounded once.
__global__ void sum_kernel(Fp8Args a) {
  const int64_t i = pdl_element();
  const int64_t total = a.nx * a.n;
  if (i >= total) return;
  float sum = 0.f;
  for (int r = 0; r < a.splits; ++r) sum += a.part[r * total + i];
  if (a.scale_cols == 1) sum *= __ldg(a.scale + (i % a.n) / a.bo);
  a.y[i] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
}

// K's ranges: enough CTAs for two an SM where W's rows alone give fewer, each range at least a step a warp.
int splits_for(int64_t ctas, int steps) {
  const int64_t want = 2 * static_cast<int64_t>(sm_count()) / std::max<int64_t>(ctas, 1);
  return static_cast<int>(std::clamp<int64_t>(want, 1, std::max(1, steps / kWarps)));
}

at::Tensor fp8_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t block_rows,
                           int64_t block_cols) {
  fp8_check_args(x, w, scale, block_rows, block_cols);
  const int64_t n = w.size(0), k = w.size(1), nx = x.size(0);
  TORCH_CHECK(nx >= 1 && nx <= kFp8MaxRows, "fp8_linear on CUDA takes 1..", kFp8MaxRows, " rows of x, got ", nx);
  // nx > kFp8LaunchRows: a launch per kFp8LaunchRows rows (a row's sums are the same in any of them)
  TORCH_CHECK(k % 16 == 0 && n >= 1, "fp8_linear on CUDA: K must be a multiple of 16 (got ", k, ")");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "fp8_linear on CUDA: x and W contiguous, 16-byte aligned");
  TORCH_CHECK(scale.size(1) == 1 || block_rows % 16 == 0, "fp8_linear on CUDA: block scales of a multiple of 16 rows");
  TORCH_CHECK(n < (int64_t{1} << 31) / 16 && k < (int64_t{1} << 31) / 2, "fp8_linear: W too large");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({nx, n}, x.options());
  const int64_t ctas = (n + 15) / 16;
  const int steps = static_cast<int>((k + kFp8Step - 1) / kFp8Step);
  const int splits = splits_for(ctas, steps);
  at::Tensor part;
  if (splits > 1) part = at::empty({splits, std::min<int64_t>(nx, kFp8LaunchRows), n}, x.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t r0 = 0; r0 < nx; r0 += kFp8LaunchRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kFp8LaunchRows, nx - r0));
    Fp8Args a{w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(x.data_ptr()) + r0 * k, scale.data_ptr<float>(),
              splits > 1 ? part.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()) + r0 * n, n, k,
              rows, steps, splits, static_cast<int>(std::min<int64_t>(block_rows, n)), static_cast<int>(scale.size(1))};
    const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(splits));
    launch_pdl(rows > 16 ? fp8_linear_kernel<4> : rows > 8 ? fp8_linear_kernel<2> : fp8_linear_kernel<1>, grid,
               dim3(32 * kWarps), stream, a);
    if (splits > 1)
      launch_pdl(sum_kernel, dim3(static_cast<unsigned>((rows * n + 255) / 256)), dim3(256), stream, a);
  }
  return y;
}

// fp8_dequantize: W [n, k] times its scales, rounded once to bf16 (fp8.h; service/model/fp8.py's
// dequantization, bit for bit): a thread 4 weights.
__global__ void dequantize_kernel(const uint8_t* w, const float* scale, int64_t n, int64_t k, int bo, int bi,
                                  int scale_cols, uint32_t* out) {
  const int64_t i = pdl_element(), quads = n * (k / 4);
  if (i >= quads) return;
  const int64_t row = i / (k / 4), col = i % (k / 4) * 4;
  const uint32_t v = *reinterpret_cast<const uint32_t*>(w + row * k + col);
  const float sc = __ldg(scale + (row / bo) * scale_cols + col / bi);   // bi % 4 == 0: one scale for the 4
  const uint32_t pairs[2] = {fp8_pair<false>(v), fp8_pair<true>(v)};
  uint32_t o[2];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const float lo = __uint_as_float(pairs[p] << 16) * sc, hi = __uint_as_float(pairs[p] & 0xFFFF0000u) * sc;
    o[p] = static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16;
  }
  reinterpret_cast<uint2*>(out)[i] = make_uint2(o[0], o[1]);
}

at::Tensor fp8_dequantize_cuda(const at::Tensor& w, const at::Tensor& scale, int64_t block_rows, int64_t block_cols) {
  fp8_check_grid(w, scale, block_rows, block_cols);
  TORCH_CHECK(w.is_contiguous() && w.size(1) % 4 == 0 && (scale.size(1) == 1 || block_cols % 4 == 0),
              "fp8_dequantize on CUDA: W contiguous, K and the block's columns multiples of 4");
  const c10::cuda::CUDAGuard guard(w.device());
  at::Tensor out = at::empty(w.sizes(), w.options().dtype(at::kBFloat16));
  const int64_t quads = w.numel() / 4;
  if (quads)
    launch_pdl(dequantize_kernel, dim3(static_cast<unsigned>((quads + 255) / 256)), dim3(256),
               c10::cuda::getCurrentCUDAStream(), w.data_ptr<uint8_t>(), scale.data_ptr<float>(), w.size(0), w.size(1),
               static_cast<int>(std::min<int64_t>(block_rows, w.size(0))),
               static_cast<int>(std::min<int64_t>(block_cols, w.size(1))), static_cast<int>(scale.size(1)),
               reinterpret_cast<uint32_t*>(out.data_ptr()));
  return out;
}

// fp8_to_bf16: a thread a 4-byte word (fp8_pair's steps), the tail byte by byte.
__global__ void to_bf16_kernel(const uint8_t* w, int64_t numel, uint32_t* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (4 * i + 3 < numel) {
    const uint32_t v = *reinterpret_cast<const uint32_t*>(w + 4 * i);
    out[2 * i] = fp8_pair<false>(v), out[2 * i + 1] = fp8_pair<true>(v);
  } else if (4 * i < numel) {
    for (int64_t j = 4 * i; j < numel; ++j) {
      const uint32_t p = fp8_pair<false>(w[j]);
      reinterpret_cast<uint16_t*>(out)[j] = static_cast<uint16_t>(p);
    }
  }
}

at::Tensor fp8_to_bf16_cuda(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && reinterpret_cast<uintptr_t>(w.data_ptr()) % 4 == 0,
              "fp8_to_bf16: w must be contiguous uint8 (e4m3 bytes), 4-byte aligned");
  const c10::cuda::CUDAGuard guard(w.device());
  at::Tensor out = at::empty(w.sizes(), w.options().dtype(at::kBFloat16));
  const int64_t words = (w.numel() + 3) / 4;
  if (words)
    to_bf16_kernel<<<static_cast<unsigned>((words + 255) / 256), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        w.data_ptr<uint8_t>(), w.numel(), reinterpret_cast<uint32_t*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) {
  m.impl("fp8_to_bf16", &fp8_to_bf16_cuda);
  m.impl("fp8_linear", &fp8_linear_cuda);
  m.impl("fp8_dequantize", &fp8_dequantize_cuda);
}

}  // namespace wcodec
