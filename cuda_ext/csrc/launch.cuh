// What the extension's matmul kernels share (fixedrate*.cu, fp8_linear.cu, fp8_rows.cu):
// programmatic dependent launch, the launch's per-device answers (asked once a device), loads of W
// that bypass L1 (ld_stream), and the tensor cores' mma.m16n8k16. Internal linkage (an unnamed
// namespace): each kernel file compiles its own copy.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace wcodec {
namespace {

// Programmatic dependent launch (sm_90+; CUDA graphs keep it as a programmatic edge). These kernels
// are launched so that they may start before the kernel ahead of them on the stream has ended:
// mma_kernel's CTAs signal it (launch_dependents) once their walk of W is done, so the next launch
// overlaps their epilogue and the last CTAs' tail, and a warp of the next mma_kernel requests its
// first tile of W before it waits for the grid ahead (griddepcontrol.wait: that grid complete, its
// writes visible). Nothing but W is read before that wait and nothing is written, and W is written
// only at load by work that ends in a host sync (encode, cat_rows). An 8B layer's seven matmuls,
// fused ÷ cuBLAS at 1 / 4 / 16 / 32 rows: 1.050 / 1.118 / 1.162 / 1.529 -> 0.977 / 1.068 / 1.111 /
// 1.382; the 7B layer's 1.005 / 1.059 / 1.205 / 1.477 -> 0.949 / 1.021 / 1.128 / 1.362 (H200,
// 2026-11-29, the same sums). Waiting at the kernel's start instead gained half as much (8B:
// 0.999 / 1.085 / 1.147 / 1.443); signalling at the CTAs' start lost at 4-8 rows (8 rows 1.171 ->
// 1.256). On older GPUs the launch is a plain one and these are no-ops.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A thread's element of a one-dimensional launch, once the grid ahead is complete (its writes visible).
__device__ __forceinline__ int64_t pdl_element() {
  pdl_trigger();
  pdl_wait();
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}

// ask(dev) for the current device, asked once and then kept (`known`: 0 not asked yet; ask's
// answers are never 0).
template <typename Ask>
int32_t per_device(std::atomic<int32_t> (&known)[64], Ask&& ask) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64)
    if (const int32_t k = known[dev].load(std::memory_order_relaxed)) return k;
  const int32_t k = ask(dev);
  if (dev < 64) known[dev].store(k, std::memory_order_relaxed);
  return k;
}

bool pdl_on() {
  static std::atomic<int32_t> known[64] = {};                       // 1 no, 2 yes
  return per_device(known, [](int dev) {
           int major = 0;
           C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
           return major >= 9 ? 2 : 1;
         }) == 2;
}

// The current device's SMs (asked once a device).
int sm_count() {
  static std::atomic<int32_t> known[64] = {};
  return per_device(known, [](int dev) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  });
}

// The waves that `ctas` CTAs take on the current device at `per_sm` an SM.
int64_t waves(int64_t ctas, int per_sm) {
  const int64_t slots = per_sm * static_cast<int64_t>(sm_count());
  return (ctas + slots - 1) / slots;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch where the device has it.
template <typename... Params, typename... Args>
void launch_pdl_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr, cfg.numAttrs = pdl_on() ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...));
}

template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  launch_pdl_smem(kernel, grid, block, 0, stream, args...);
}

__device__ __forceinline__ uint4 ld_stream(const void* p) {        // 16 bytes, not kept in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// W's code and tile words, for a user that keeps them out of L1 too (load_group's kStream).
__device__ __forceinline__ uint2 ld_stream(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ld_stream(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ld_stream(const uint16_t* p) {
  uint16_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

template <bool kBf16>
__device__ __forceinline__ void mma16816(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

}  // namespace
}  // namespace wcodec
