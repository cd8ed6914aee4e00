// Does Hopper's wgmma (A from registers, B from shared memory) give the same float32 sums, bit for
// bit, as mma.sync m16n8k16 over the same k16 steps? The fused kernels keep a row's sums independent
// of its batch (tests/gpu/test_fixedrate_cuda.py), and the 1-16-row kernels use mma.sync, so a
// wgmma kernel for 17-32 rows could only join them if it rounds as they do.
//
// One warpgroup: A is 64 x 128 (W's rows: each warp 16 of them, in mma.sync's A fragment layout, as
// the 5-8-row kernel decodes them), B is N x 128 (x's rows, K-major in shared memory, no swizzle), D
// = A B^T accumulated in float32 over the 8 k16 steps from +0. The same products by mma.sync: each
// warp its 16 rows, one m16n8k16 chain an 8-row block of B. Random bf16 values spread over 2^-12 ..
// 2^12, so that the order of the additions shows in the last bits. It also checks both sums against
// a double-precision reference, which tells whether the descriptor's two strides are read as meant
// (LBO: between the two 8-element halves of K; SBO: between 8-row blocks of N), and prints both
// orders of them.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o /tmp/wgmma_bits bench/experiments/wgmma_bits.cu && /tmp/wgmma_bits
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

constexpr int kM = 64, kK = 128, kSteps = kK / 16, kMaxN = 32;

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

__device__ __forceinline__ uint32_t pack(const uint16_t* p) { return p[0] | static_cast<uint32_t>(p[1]) << 16; }

// Thread (warp w, g = lane / 4, t = lane % 4)'s A fragment of k16 step q (mma.m16n8k16's layout).
__device__ __forceinline__ void a_frag(const uint16_t* a, int q, uint32_t (&r)[4]) {
  const int lane = threadIdx.x & 31, row = 16 * (threadIdx.x >> 5) + lane / 4, k = 16 * q + 2 * (lane % 4);
  r[0] = pack(a + row * kK + k), r[1] = pack(a + (row + 8) * kK + k);
  r[2] = pack(a + row * kK + k + 8), r[3] = pack(a + (row + 8) * kK + k + 8);
}

template <int N>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (N == 8) {
    asm volatile("{.reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (N == 16) {
    asm volatile("{.reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else {
    asm volatile("{.reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15},"
                 " {%16,%17,%18,%19}, %20, p, 1, 1, 0;}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
}

// D's element i of a thread: n8 block i / 4, row g (+ 8 for i % 4 >= 2), column 2t (+ 1 for odd i).
__device__ __forceinline__ void store_d(float* out, int n, int i, float v) {
  const int lane = threadIdx.x & 31, row = 16 * (threadIdx.x >> 5) + lane / 4 + 8 * ((i % 4) / 2);
  out[row * n + 8 * (i / 4) + 2 * (lane % 4) + (i & 1)] = v;
}

// B in shared memory, step q's core matrix (n block j, k half h) of 8 rows x 16 bytes at
// q * 32 N + (2 j + h) * 128 bytes: 128 bytes between K's halves, 256 between N's blocks.
template <int N>
__global__ void wgmma_kernel(const uint16_t* a, const uint16_t* b, bool swap, float* out) {
  __shared__ __align__(128) uint16_t sb[2 * kSteps * N * 16];      // slack: the strides' wrong order reads past
  for (int i = threadIdx.x; i < kSteps * N * 16; i += blockDim.x) {
    const int q = i / (N * 16), r = i % (N * 16), core = r / 64, j = core / 2, h = core % 2, row = r % 64 / 8, e = r % 8;
    sb[i] = b[(8 * j + row) * kK + 16 * q + 8 * h + e];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  float d[N / 2] = {};
  const uint64_t lbo = swap ? 256 : 128, sbo = swap ? 128 : 256;
  for (int q = 0; q < kSteps; ++q) {
    uint32_t ar[4];
    a_frag(a, q, ar);
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(sb + q * N * 16));
    const uint64_t desc = (addr >> 4 & 0x3FFF) | (lbo >> 4) << 16 | (sbo >> 4) << 32;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    wgmma<N>(d, ar, desc);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  for (int i = 0; i < N / 2; ++i) store_d(out, N, i, d[i]);
}

template <int N>
__global__ void mma_kernel(const uint16_t* a, const uint16_t* b, float* out) {
  const int lane = threadIdx.x & 31;
  float c[N / 8][4] = {};
  for (int q = 0; q < kSteps; ++q) {
    uint32_t ar[4];
    a_frag(a, q, ar);
    for (int j = 0; j < N / 8; ++j) {
      const uint16_t* bp = b + (8 * j + lane / 4) * kK + 16 * q + 2 * (lane % 4);
      const uint32_t b0 = pack(bp), b1 = pack(bp + 8);
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                   : "r"(ar[0]), "r"(ar[1]), "r"(ar[2]), "r"(ar[3]), "r"(b0), "r"(b1));
    }
  }
  for (int i = 0; i < N / 2; ++i) store_d(out, N, i, c[i / 4][i % 4]);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next() { rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; return rng; }

static uint16_t bf16(float f) {                                     // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + (u >> 16 & 1)) >> 16);
}

static double value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int N>
static void trials(int count, const uint16_t* da, const uint16_t* db, float* dout) {
  std::vector<uint16_t> a(kM * kK), b(kMaxN * kK);
  std::vector<float> w0(kM * N), w1(kM * N), m(kM * N);
  long differ = 0, total = 0;
  double err[3] = {0, 0, 0};                                       // max |x - ref| / sum |products|
  for (int trial = 0; trial < count; ++trial) {
    for (auto* v : {&a, &b})
      for (auto& x : *v) {
        const double u = (next() >> 11) * 0x1.0p-53 * 2 - 1;        // uniform (-1, 1) x 2^(-12 .. 12)
        x = bf16(static_cast<float>(std::ldexp(u, static_cast<int>(next() % 25) - 12)));
      }
    CHECK(cudaMemcpy((void*)da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy((void*)db, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    std::vector<float>* outs[3] = {&w0, &w1, &m};
    for (int v = 0; v < 3; ++v) {
      if (v < 2) wgmma_kernel<N><<<1, 128>>>(da, db, v == 1, dout);
      else mma_kernel<N><<<1, 128>>>(da, db, dout);
      CHECK(cudaGetLastError());
      if (cudaError_t e = cudaMemcpy(outs[v]->data(), dout, kM * N * 4, cudaMemcpyDeviceToHost); e != cudaSuccess) {
        std::printf("N = %d, variant %d (0, 1: wgmma, strides as meant or swapped; 2: mma.sync): %s\n", N, v,
                    cudaGetErrorString(e));
        std::exit(1);
      }
    }
    for (int r = 0; r < kM; ++r)
      for (int n = 0; n < N; ++n) {
        double ref = 0, mag = 0;
        for (int k = 0; k < kK; ++k) {
          const double p = value(a[r * kK + k]) * value(b[n * kK + k]);
          ref += p, mag += std::fabs(p);
        }
        for (int v = 0; v < 3; ++v) err[v] = std::fmax(err[v], std::fabs((*outs[v])[r * N + n] - ref) / (mag > 0 ? mag : 1));
        differ += std::memcmp(&w0[r * N + n], &m[r * N + n], 4) != 0, ++total;
      }
  }
  std::printf("N = %2d, %d trials: wgmma (LBO 128, SBO 256) rel. error %.3g, (LBO 256, SBO 128) %.3g, mma.sync %.3g; "
              "wgmma (LBO 128) != mma.sync in %ld of %ld sums\n", N, count, err[0], err[1], err[2], differ, total);
}

int main() {
  uint16_t *da, *db;
  float* dout;
  CHECK(cudaMalloc(&da, kM * kK * 2));
  CHECK(cudaMalloc(&db, kMaxN * kK * 2));
  CHECK(cudaMalloc(&dout, kM * kMaxN * 4));
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s\n", p.name);
  trials<8>(200, da, db, dout);
  trials<16>(200, da, db, dout);
  trials<32>(200, da, db, dout);
  return 0;
}
