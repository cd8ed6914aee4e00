// The W8A16 matmul on tensor cores (fp8.h; the CPU twin and schemas are fp8_linear.cpp): y = x W^T
// for x of 1..64 bf16 rows and W's float8_e4m3fn bytes, each weight decoded to bf16 in registers
// (nothing written back), mma.sync.m16n8k16 with float32 sums, one rounding; and fp8_dequantize, W
// times its scales rounded to bf16 (a prompt's matmul: cuBLAS).
// * W is the mma's A: a warp takes 16 rows of W (lane (g, t) = (lane / 4, lane % 4): rows g and
//   g + 8) over steps of kFp8Step columns of K; x is B in n8 tiles (x row 8m + g: the tile's column g).
// * In a step, lane t loads 16 bytes of each of its rows at columns 16t and 64 + 16t: word j (0..3)
//   of a load holds k = 16t + 4j .. + 3, which mma j takes as its k slots 2t, 2t + 1 (bytes 0, 1)
//   and 2t + 8, 2t + 9 (bytes 2, 3): a permutation of k inside the step that x follows, so that x's
//   words go to the mma as loaded (words 2j and 2j + 1 of its 16 columns 16t ..).
// * Two kernels, by rows of x (fp8_mma.cuh holds what they share; rows_kernel is in fp8_rows.cu):
//   - 1..16 (cols_kernel): a CTA's 8 warps share 16 rows of W and take a range of K's steps in turn
//     (warp w steps w, w + 8, ...; neighbouring warps read neighbouring bytes of a row), each warp
//     loading its x from L2; their sums are added in warp order through shared memory.
//   - 17..64 (rows_kernel, four n8 tiles to 32 rows, eight above): each of a CTA's 8 warps owns 16
//     rows of W for the range, and the CTA stages each step of x once in shared memory, where
//     cols_kernel's warps read 4 bytes of x from L2 for each byte of W at 32 rows; W's steps come
//     through shared memory too (cp.async, 4 steps of both in flight, 3 at eight tiles so that two
//     CTAs fit an SM; each lane reads back its own 16-byte chunks). An 8B layer's seven matmuls at
//     32 rows: 1.25 (cols_kernel) -> 0.99 of cuBLAS's time, where holding W's next step in
//     registers instead gave 1.02; at 64 rows 1.40 (two launches of four tiles, reading W twice:
//     1.94; eight tiles with W in registers spilled: 2.03; with W staged 12 bytes spill, at 128
//     registers for two CTAs an SM). At 1-16 rows it took 0.77-0.86 against
//     cols_kernel's 0.67-0.77 (its CTAs of 128 rows need K cut for every matrix) (H200, 2026-12-01/02).
//   A row of x gets the same bits in any batch of 1..16 rows and in any batch of 17..64 (the two
//   sum in different orders, as cuBLAS's kernels chosen by M do).
// * A block scale (bi = kFp8Step) multiplies each step's sums; a grid of one column multiplies the
//   final sum. Where K is cut across CTAs (few CTAs for the SMs), each range's float32 sums go to a
//   buffer that sum_kernel adds in range order. The cut depends on W's shape, the kernel and the
//   device alone.
// * Programmatic dependent launch (launch.cuh): a warp requests its first step of W before it
//   waits for the grid ahead; W is written only at load.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "fp8_mma.cuh"

namespace wcodec {
namespace {

constexpr int kFewRows = 16;                                        // cols_kernel's rows of x at most

// cols_kernel's step s of the strip's W (read once: ld_stream): rows g, g + 8 at columns 16t, then 64 + 16t.
__device__ __forceinline__ void load_w(const Fp8Args& a, const Strip& st, int s, uint4 (&w)[4]) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t c = static_cast<int64_t>(s) * kFp8Step + 64 * h + 16 * t;
    const bool in = c < a.k;                                        // K % 16 == 0: a lane's 16 bytes are in or out
    w[2 * h] = in ? ld_stream(st.row_g + c) : make_uint4(0, 0, 0, 0);
    w[2 * h + 1] = in ? ld_stream(st.row_h + c) : make_uint4(0, 0, 0, 0);
  }
}

// cols_kernel's step s of x: rows g + 8m, columns 16t .., then 64 + 16t .. (x[m][2h], x[m][2h + 1]).
template <int kNt>
__device__ __forceinline__ void load_x(const Fp8Args& a, int s, uint4 (&x)[kNt][4]) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int m = 0; m < kNt; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t c = static_cast<int64_t>(s) * kFp8Step + 64 * h + 16 * t;
      const int r = g + 8 * m;
      const bool in = r < a.nx && c < a.k;
      const uint4* p = reinterpret_cast<const uint4*>(a.x + r * a.k + c);
      x[m][2 * h] = in ? __ldg(p) : make_uint4(0, 0, 0, 0);
      x[m][2 * h + 1] = in ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
    }
}

template <int kNt>
__device__ __forceinline__ void cols_step(const uint4 (&w)[4], const uint4 (&x)[kNt][4], float (&c)[kNt][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t a[4][4];
    decode_half(w, h, a);
#pragma unroll
    for (int m = 0; m < kNt; ++m) half_tile(a, x[m][2 * h], x[m][2 * h + 1], c[m]);
  }
}

template <int kNt>                                                  // n8 tiles of x: 1 (1..8 rows), 2 (9..16)
__global__ void __launch_bounds__(32 * kWarps) cols_kernel(Fp8Args a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * 16;
  const Strip st = strip(a, n0);
  float acc[kNt][4] = {};
  uint4 w[4], x[kNt][4];                                            // step s: W, then x (requested a step ahead)
  int s = st.s0 + warp;
  if (s < st.s1) load_w(a, st, s, w);
  pdl_wait();
  if (s < st.s1) load_x<kNt>(a, s, x);
  for (; s < st.s1; s += kWarps) {
    uint4 w_next[4], x_next[kNt][4];
    if (s + kWarps < st.s1) load_w(a, st, s + kWarps, w_next), load_x<kNt>(a, s + kWarps, x_next);
    if (a.scale_cols > 1) {
      float c[kNt][4] = {};
      cols_step<kNt>(w, x, c);
      add_step<kNt>(a, st, s, c, acc);
    } else {
      cols_step<kNt>(w, x, acc);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w[q] = w_next[q];
#pragma unroll
      for (int m = 0; m < kNt; ++m) x[m][q] = x_next[m][q];
    }
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
    for (int v = 0; v < kWarps; ++v) sum += red[v][e][l];
    put(a, n0, l, e / 4, e % 4, sum);
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

// K's ranges: enough CTAs for two an SM where W's rows alone give fewer, each range at least
// `least` steps (cols_kernel: a step a warp; rows_kernel: the staged steps).
int splits_for(int64_t ctas, int steps, int least) {
  const int64_t want = 2 * static_cast<int64_t>(sm_count()) / std::max<int64_t>(ctas, 1);
  return static_cast<int>(std::clamp<int64_t>(want, 1, std::max(1, steps / least)));
}

at::Tensor fp8_linear_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t block_rows,
                           int64_t block_cols) {
  fp8_check_args(x, w, scale, block_rows, block_cols);
  const int64_t n = w.size(0), k = w.size(1), nx = x.size(0);
  TORCH_CHECK(nx >= 1 && nx <= kFp8MaxRows, "fp8_linear on CUDA takes 1..", kFp8MaxRows, " rows of x, got ", nx);
  TORCH_CHECK(k % 16 == 0 && n >= 1, "fp8_linear on CUDA: K must be a multiple of 16 (got ", k, ")");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "fp8_linear on CUDA: x and W contiguous, 16-byte aligned");
  TORCH_CHECK(scale.size(1) == 1 || block_rows % 16 == 0, "fp8_linear on CUDA: block scales of a multiple of 16 rows");
  TORCH_CHECK(n < (int64_t{1} << 31) / 16 && k < (int64_t{1} << 31) / 2, "fp8_linear: W too large");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({nx, n}, x.options());
  const bool few = nx <= kFewRows;
  const int64_t ctas = few ? (n + 15) / 16 : (n + 16 * kWarps - 1) / (16 * kWarps);
  const int steps = static_cast<int>((k + kFp8Step - 1) / kFp8Step);
  const int splits = splits_for(ctas, steps, few ? kWarps : kStages);
  at::Tensor part;
  if (splits > 1) part = at::empty({splits, nx, n}, x.options().dtype(at::kFloat));
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(splits));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Fp8Args a{w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(x.data_ptr()), scale.data_ptr<float>(),
                  splits > 1 ? part.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()), n, k,
                  static_cast<int>(nx), steps, splits, static_cast<int>(std::min<int64_t>(block_rows, n)),
                  static_cast<int>(scale.size(1))};
  if (few)
    launch_pdl(nx > 8 ? cols_kernel<2> : cols_kernel<1>, grid, dim3(32 * kWarps), stream, a);
  else
    launch_fp8_rows(a, grid, stream);
  if (splits > 1) launch_pdl(sum_kernel, dim3(static_cast<unsigned>((nx * n + 255) / 256)), dim3(256), stream, a);
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
