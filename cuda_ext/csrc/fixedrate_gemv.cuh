// Device side of the fixed-rate form (fixedrate.cu, fixedrate_gemv.cu): a warp's decode of one
// escape block (lane l the block's l-th group: 32 weights) into field bytes and words. The kernels:
// decode_kernel (fixedrate.cu), the fused y = x W^T for 1..16 rows of x on CUDA cores (fixedrate_gemv.cu)
// and for 1..64 on tensor cores (fixedrate_mma.cu). Steps as codec/fixedrate.py names them:
//   load_group -> group_fields (unpack_codes + base, 4 weights a u32), group_escapes -> patch_fields
//   -> join_words.
// W's bytes are read once, 16 bytes a load, bypassing L1 (x lives there); nothing is written back
// but y. Rows of W are spread over warps; when there are few, the K blocks of a row are split over
// up to 4 warps of a CTA and summed through shared memory (split-K without a second launch).
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fixedrate.h"

namespace wcodec {

constexpr int kFrWarps = 4;       // warps per CTA
constexpr int kFrMaxRows = 64;    // rows of x the fused op takes (the tensor-core kernel)
constexpr int kFrMaxSimtRows = 16;  // rows of x the CUDA-core kernel takes

struct FrArrays {
  const uint8_t* plane;
  const uint32_t* lo;
  const uint32_t* hi;
  const uint8_t* base;
  const uint8_t* esc;
  int64_t n_esc;
  const int32_t* esc_start;
  int64_t rows, groups, tiles, blocks;
};

struct FrGroup {               // one group's bits: 32 plane bytes, 2 + 1 code words, its base
  uint4 p0, p1;
  uint2 lo;
  uint32_t hi, base;
};

__device__ __forceinline__ uint4 ld_stream(const void* p) {        // 16 bytes, not kept in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ FrGroup load_group(const FrArrays& a, int64_t row, int64_t gr, bool valid) {
  const int64_t g = row * a.groups + gr;
  FrGroup t{};
  if (!valid) return t;                                             // padding lanes: code 0, plane 0
  t.p0 = ld_stream(a.plane + g * kFrGroup);
  t.p1 = ld_stream(a.plane + g * kFrGroup + 16);
  t.lo = __ldg(reinterpret_cast<const uint2*>(a.lo) + g);
  t.hi = __ldg(a.hi + g);
  t.base = __ldg(a.base + row * a.tiles + gr / kFrTileGroups);
  return t;
}

// unpack_codes + base, 4 fields a u32 (f[q] byte b: weight 4q + b); an escaped weight's field is
// base + 7 until patch_fields replaces it.
__device__ __forceinline__ void group_fields(const FrGroup& t, uint32_t f[8]) {
  const uint32_t base4 = t.base * 0x01010101u;
#pragma unroll
  for (int q = 0; q < 8; ++q) f[q] = fr_codes4(q < 4 ? t.lo.x : t.lo.y, t.hi, q) + base4;
}

// Bits 8b + s (s < 4) of h onto bits 8b + 2s.
__device__ __forceinline__ uint32_t spread_nibbles(uint32_t h) {
  h = (h | (h << 2)) & 0x33333333u;
  return (h | (h << 1)) & 0x55555555u;
}

// The group's escaped weights (code 7: lo bits 11 and hi bit 1), word by word rather than code
// by code: bit 8b + 2s of e[w] is set where weight 16w + 4s + b escapes (q = 4w + s). lo & lo >> 1
// leaves bit 8b + 2s for lo's pair of weight 4q + b; hi's bit 8b + q is spread onto the same bit.
__device__ __forceinline__ void group_escapes(const FrGroup& t, uint32_t e[2]) {
  e[0] = t.lo.x & (t.lo.x >> 1) & spread_nibbles(t.hi & 0x0F0F0F0Fu);
  e[1] = t.lo.y & (t.lo.y >> 1) & spread_nibbles((t.hi >> 4) & 0x0F0F0F0Fu);
}

// group_fields and group_escapes of one group; returns its escape count.
__device__ __forceinline__ int group_decode(const FrGroup& t, uint32_t f[8], uint32_t e[2]) {
  group_fields(t, f);
  group_escapes(t, e);
  return __popc(e[0]) + __popc(e[1]);
}

// Escaped fields in weight order from `rank` on (a rank past the array reads 0): word q, then
// byte lane b. Word q is a compile-time index; only the byte lane inside it is not.
__device__ __forceinline__ void patch_fields(const FrArrays& a, const uint32_t e[2], int64_t rank, uint32_t f[8]) {
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    uint32_t lanes = (e[q >> 2] >> (2 * (q & 3))) & 0x01010101u;      // bit 8b: weight 4q + b escapes
    while (lanes) {
      const int shift = __ffs(lanes) - 1;
      lanes &= lanes - 1;
      const uint32_t v = rank < a.n_esc ? a.esc[rank] : 0u;
      ++rank;
      f[q] = (f[q] & ~(0xFFu << shift)) | (v << shift);
    }
  }
}

// The fields of lane's group of escape block `blk` of `row`, escapes patched (whole warp calls).
__device__ __forceinline__ FrGroup block_fields(const FrArrays& a, int64_t row, int64_t blk, uint32_t f[8]) {
  const int lane = threadIdx.x & 31;
  const int64_t gr = blk * kFrBlockGroups + lane;
  const FrGroup t = load_group(a, row, gr, gr < a.groups);
  uint32_t e[2];
  const int escapes = group_decode(t, f, e);
  int below = escapes;                                              // warp prefix sum: lanes <= this one
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, below, d);
    if (lane >= d) below += v;
  }
  if (escapes) patch_fields(a, e, a.esc_start[row * a.blocks + blk] + below - escapes, f);
  return t;
}

// join_words, 4 at a time: plane word p and field word f of weights 4q..4q+3 -> two 16-bit pairs.
//   h = f << 8 | p  (per weight);  word = (h >> 1 & 0x7F80) | (h & 0x7F) | (h << 8 & 0x8000)
__device__ __forceinline__ void join4(uint32_t p, uint32_t f, uint32_t& w01, uint32_t& w23) {
  const uint32_t y0 = __byte_perm(p, f, 0x5140), y1 = __byte_perm(p, f, 0x7362);
  w01 = ((y0 >> 1) & 0x7F807F80u) | (y0 & 0x007F007Fu) | ((y0 << 8) & 0x80008000u);
  w23 = ((y1 >> 1) & 0x7F807F80u) | (y1 & 0x007F007Fu) | ((y1 << 8) & 0x80008000u);
}

__device__ __forceinline__ uint32_t plane_word(const FrGroup& t, int q) {
  const uint4& v = q < 4 ? t.p0 : t.p1;
  switch (q & 3) { case 0: return v.x; case 1: return v.y; case 2: return v.z; default: return v.w; }
}

// y = x W^T on CUDA cores (fixedrate_gemv.cu) or tensor cores (fixedrate_mma.cu).
void launch_gemv(const FrArrays& a, const at::Tensor& x, const at::Tensor& y, cudaStream_t stream);
void launch_mma(const FrArrays& a, const at::Tensor& x, const at::Tensor& y, cudaStream_t stream);
constexpr int64_t kFrKernelMma = 0, kFrKernelSimt = 1;

}  // namespace wcodec
