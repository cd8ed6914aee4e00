// The W8A16 matmul from 17 to 64 rows of x (rows_kernel; fp8_linear.cu has the layout of the mma's
// fragments and why this kernel): each of a CTA's 8 warps owns 16 rows of W for its range of K, and
// the CTA stages x's and W's steps in shared memory by cp.async.
#include <c10/cuda/CUDAException.h>

#include <atomic>

#include "fp8_mma.cuh"

namespace wcodec {
namespace {

template <int kNt>                                                  // (3 at 8 tiles: two CTAs an SM)
constexpr int stages() { return kNt > 4 ? 3 : kStages; }
constexpr int kXPitch = kFp8Step + 8;                               // a staged row of x: 272 B, 17 chunks of 16 B

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool in) {   // !in: 16 zero bytes
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(in ? 16 : 0) : "memory");
}

// rows_kernel: the CTA stages step s of x (its 8 kNt rows, zeros past nx and K) in xs, a group a
// step (empty past the range).
template <int kNt>
__device__ __forceinline__ void stage_x(const Fp8Args& a, int s, int s1, uint16_t (*xs)[kXPitch]) {
  constexpr int kChunks = 8 * kNt * (kFp8Step / 8);                 // 16-byte chunks of the step's rows of x
  for (int i = threadIdx.x; s < s1 && i < kChunks; i += 32 * kWarps) {
    const int r = i / (kFp8Step / 8), c = i % (kFp8Step / 8) * 8;
    const int64_t col = static_cast<int64_t>(s) * kFp8Step + c;
    const bool in = r < a.nx && col < a.k;
    cp_async16(&xs[r][c], a.x + (in ? r * a.k + col : 0), in);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// x's tiles from shared memory: row 8m + g at columns 64h + 16t (17 chunks a row: a warp's 16-byte
// reads fall in distinct banks).
template <int kNt>
__device__ __forceinline__ void rows_step(const uint4 (&w)[4], const uint16_t (*x)[kXPitch], float (&c)[kNt][4]) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t a[4][4];
    decode_half(w, h, a);
#pragma unroll
    for (int m = 0; m < kNt; ++m) {
      const uint4* p = reinterpret_cast<const uint4*>(&x[8 * m + g][64 * h + 16 * t]);
      half_tile(a, p[0], p[1], c[m]);
    }
  }
}

// rows_kernel's step s of a warp's W into shared memory by cp.async, each lane its own 4 chunks
// (rows g, g + 8 at columns 16t, then 64 + 16t) at ws[q][lane]: a lane reads back only what it
// copied, and a warp's 16-byte reads fall in distinct banks. Not committed: the step's x commits.
__device__ __forceinline__ void stage_w(const Fp8Args& a, const Strip& st, int s, uint4 (*ws)[32]) {
  const int t = threadIdx.x & 3, lane = threadIdx.x & 31;
  if (s >= st.s1) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t c = static_cast<int64_t>(s) * kFp8Step + 64 * h + 16 * t;
    const bool in = c < a.k;
    cp_async16(&ws[2 * h][lane], in ? st.row_g + c : a.w, in);
    cp_async16(&ws[2 * h + 1][lane], in ? st.row_h + c : a.w, in);
  }
}

template <int kNt>                                                  // n8 tiles of x: 4 (17..32 rows), 8 (33..64)
__global__ void __launch_bounds__(32 * kWarps, 2) rows_kernel(Fp8Args a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * 16;
  const Strip st = strip(a, n0);
  extern __shared__ __align__(16) uint4 smem[];
  constexpr int kS = stages<kNt>();
  auto xs = reinterpret_cast<uint16_t (*)[8 * kNt][kXPitch]>(smem);                        // [kS][8 kNt][kXPitch]
  auto ws = reinterpret_cast<uint4 (*)[kWarps][4][32]>(smem + kS * 8 * kNt * kXPitch / 8);  // [kS][warp][q][lane]
#pragma unroll
  for (int p = 0; p < kS - 1; ++p) stage_w(a, st, st.s0 + p, ws[p][warp]);
  pdl_wait();
#pragma unroll
  for (int p = 0; p < kS - 1; ++p) stage_x<kNt>(a, st.s0 + p, st.s1, xs[p]);
  float acc[kNt][4] = {};
  for (int s = st.s0; s < st.s1; ++s) {
    const int i = s - st.s0;
    asm volatile("cp.async.wait_group %0;" ::"n"(kS - 2) : "memory");   // step s's W and x are in
    __syncthreads();                                                // and step s - 1's buffers read
    stage_w(a, st, s + kS - 1, ws[(i + kS - 1) % kS][warp]);
    stage_x<kNt>(a, s + kS - 1, st.s1, xs[(i + kS - 1) % kS]);
    uint4 w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) w[q] = ws[i % kS][warp][q][lane];
    if (a.scale_cols > 1) {
      float c[kNt][4] = {};
      rows_step<kNt>(w, xs[i % kS], c);
      add_step<kNt>(a, st, s, c, acc);
    } else {
      rows_step<kNt>(w, xs[i % kS], acc);
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  pdl_trigger();
#pragma unroll
  for (int m = 0; m < kNt; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) put(a, n0, lane, m, e, acc[m][e]);
}

template <int kNt>                                                  // dynamic: over the 48 KB of a static array
constexpr int rows_smem() { return stages<kNt>() * (8 * kNt * kXPitch * 2 + kWarps * 4 * 32 * 16); }

template <int kNt>
void launch_rows(dim3 grid, cudaStream_t stream, const Fp8Args& a) {
  static std::atomic<int32_t> known[64] = {};                       // the attribute set, once a device
  per_device(known, [](int) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(rows_kernel<kNt>, cudaFuncAttributeMaxDynamicSharedMemorySize, rows_smem<kNt>()));
    return 1;
  });
  launch_pdl_smem(rows_kernel<kNt>, grid, dim3(32 * kWarps), rows_smem<kNt>(), stream, a);
}

}  // namespace

void launch_fp8_rows(const Fp8Args& a, dim3 grid, cudaStream_t stream) {
  if (a.nx > 32)
    launch_rows<8>(grid, stream, a);
  else
    launch_rows<4>(grid, stream, a);
}

}  // namespace wcodec
