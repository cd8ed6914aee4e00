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

// The escape flags of e[w] (bit 8b + 2s: weight 16w + 4s + b) in weight order, bit 4s + b: each
// byte's four flags packed to a nibble (bit s), the nibbles to 16 bits (bit 4b + s), then that 4x4
// bit matrix transposed by two delta swaps.
__device__ __forceinline__ uint32_t weight_order(uint32_t e) {
  e = (e | e >> 1) & 0x33333333u;                  // flag s at bits 0, 1, 4, 5 of its byte
  e = (e | e >> 2) & 0x0F0F0F0Fu;                  // flag s at bit s
  e = (e | e >> 4) & 0x00FF00FFu;
  e = (e | e >> 8) & 0x0000FFFFu;                  // bit 4b + s
  uint32_t d = (e ^ e >> 3) & 0x0A0Au;
  e ^= d ^ d << 3;                                 // (b, s) <-> (b + 1, s - 1), b even, s odd
  d = (e ^ e >> 6) & 0x00CCu;
  return e ^ d ^ d << 6;                           // (b, s) <-> (b + 2, s - 2), b < 2, s >= 2
}

// group_fields and the group's escapes as a mask in weight order (bit i: weight i escapes).
__device__ __forceinline__ uint32_t group_decode(const FrGroup& t, uint32_t f[8]) {
  group_fields(t, f);
  uint32_t e[2];
  group_escapes(t, e);
  return weight_order(e[0]) | weight_order(e[1]) << 16;
}

// esc's bytes seen as aligned 32-bit words: byte j lies in word (misalign + j) / 4, byte lane
// (misalign + j) % 4. A word wholly inside the array is one load; bytes outside the array read 0.
__device__ __forceinline__ int esc_misalign(const FrArrays& a) {
  return static_cast<int>(reinterpret_cast<uintptr_t>(a.esc) & 3);
}

__device__ __forceinline__ uint32_t esc_byte(const FrArrays& a, int64_t j) { return j < a.n_esc ? a.esc[j] : 0u; }

__device__ __forceinline__ uint32_t esc_word(const FrArrays& a, int64_t word) {
  const int mis = esc_misalign(a);
  const int64_t j0 = 4 * word - mis;                                // esc index of the word's byte 0
  if (j0 >= 0 && j0 + 4 <= a.n_esc) return __ldg(reinterpret_cast<const uint32_t*>(a.esc - mis) + word);
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    if (j0 + i >= 0) v |= esc_byte(a, j0 + i) << 8 * i;
  return v;
}

// The rounds a patch runs: the warp's largest escape count (whole warp calls).
__device__ __forceinline__ int escape_rounds(uint32_t m) {
  return static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(__popc(m))));
}

// patch_fields: the escaped fields, in weight order, replace base + 7. The lane's 8 field words go
// to its 32-byte slot of shared memory (byte i: weight i), escape i of the lane is stored at the
// position of mask m's i-th bit, and the words come back. fetch(i) gives escape i's byte; every
// lane calls it for i below the warp's largest count (it may shuffle), so no lane diverges.
template <class Fetch>
__device__ __forceinline__ void patch_fields(uint4 (&slot)[2], uint32_t m, uint32_t f[8], Fetch fetch) {
  const int iters = escape_rounds(m);
  if (iters == 0) return;
  slot[0] = make_uint4(f[0], f[1], f[2], f[3]);
  slot[1] = make_uint4(f[4], f[5], f[6], f[7]);
  auto* bytes = reinterpret_cast<uint8_t*>(slot);
  for (int i = 0; i < iters; ++i) {
    const uint32_t v = fetch(i);
    if (m) {
      bytes[__ffs(m) - 1] = static_cast<uint8_t>(v);
      m &= m - 1;
    }
  }
  const uint4 s0 = slot[0], s1 = slot[1];
  f[0] = s0.x, f[1] = s0.y, f[2] = s0.z, f[3] = s0.w, f[4] = s1.x, f[5] = s1.y, f[6] = s1.z, f[7] = s1.w;
}

// patch_fields without shared memory: escape i of the lane goes into byte lane b of f[q] by a byte
// permute, the word chosen by predicate among the 8 (more ALU work, no load/store unit traffic).
template <class Fetch>
__device__ __forceinline__ void patch_fields_regs(uint32_t m, uint32_t f[8], Fetch fetch) {
  const int iters = escape_rounds(m);
  for (int i = 0; i < iters; ++i) {
    const uint32_t v = fetch(i);
    const int pos = __ffs(m) - 1, b = pos & 3, qd = pos >> 2;      // pos -1 (no escape left): no word
    m &= m - 1;
    const uint32_t sel = 0x3210u ^ ((static_cast<uint32_t>(b) ^ 4u) << 4 * b);
#pragma unroll
    for (int q = 0; q < 8; ++q)
      if (q == qd) f[q] = __byte_perm(f[q], v, sel);
  }
}

// The fields of lane's group of escape block `blk` of `row`, escapes patched (whole warp calls;
// `start` is the block's esc_start). Lane l requests word l of the escapes from the block's first
// on with its group (128 bytes a warp: a block's escapes, unless it has more than about 125), so
// the escapes cost no second trip to memory; a lane takes its bytes from the word's owner.
__device__ __forceinline__ FrGroup block_fields(const FrArrays& a, int64_t row, int64_t blk, int64_t start,
                                                uint4 (&slot)[2], uint32_t f[8]) {
  const int lane = threadIdx.x & 31;
  const int64_t gr = blk * kFrBlockGroups + lane;
  const FrGroup t = load_group(a, row, gr, gr < a.groups);
  const int64_t at = start + esc_misalign(a);
  const uint32_t win = esc_word(a, (at >> 2) + lane);
  const uint32_t m = group_decode(t, f);
  const int cnt = __popc(m);
  int below = cnt;                                                  // warp prefix sum: lanes <= this one
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, below, d);
    if (lane >= d) below += v;
  }
  const int first = static_cast<int>(at & 3) + below - cnt;         // window byte of the lane's first escape
  patch_fields(slot, m, f, [&](int i) {
    const int o = first + i;
    uint32_t v = __shfl_sync(0xffffffffu, win, (o >> 2) & 31) >> 8 * (o & 3) & 0xFFu;
    if (o >= 128 && i < cnt) v = esc_byte(a, start + below - cnt + i);
    return v;
  });
  return t;
}

// join_words, 4 at a time: plane word p and field word f of weights 4q..4q+3 -> two 16-bit pairs.
// A pair's bytes interleaved, f1 p1 f0 p0, rotated right by one bit: p0's bit 0 (s1) to bit 31, f1
// to bits 23..30, p1's bits 1..7 to 16..22, p1's bit 0 (s0) to bit 15, f0 to 7..14, p0's 1..7 to 0..6.
__device__ __forceinline__ void join4(uint32_t p, uint32_t f, uint32_t& w01, uint32_t& w23) {
  const uint32_t y0 = __byte_perm(p, f, 0x5140), y1 = __byte_perm(p, f, 0x7362);
  w01 = __funnelshift_r(y0, y0, 1);
  w23 = __funnelshift_r(y1, y1, 1);
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
