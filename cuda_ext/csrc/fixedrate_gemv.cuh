// Device side of the fixed-rate form (fixedrate.cu, fixedrate_gemv.cu): a warp's decode of one
// escape block (lane l the block's l-th group: 32 weights) into field bytes and words. The kernels:
// decode_kernel (fixedrate.cu), the fused y = x W^T for 1..16 rows of x on CUDA cores (fixedrate_gemv.cu)
// and for 1..64 on tensor cores (fixedrate_mma.cu up to 16 rows, fixedrate_wide.cu from 17). Steps as
// codec/fixedrate.py names them:
//   load_group -> group_fields (unpack_codes + base, 4 weights a u32) -> the tile's escape entries
//   patched in through shared memory -> join_words.
// W's bytes are read once, the plane 16 bytes a load bypassing L1 (x lives there; the tensor-core
// kernel's code and tile words too from kSlotRows (7) rows of x); nothing is written back but y.
// Rows of W are spread over warps; when there are few, the K blocks of a row are split over up to 4
// warps of a CTA and summed through shared memory (split-K without a second launch).
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fixedrate.h"
#include "launch.cuh"

namespace wcodec {

constexpr int kFrWarps = 4;       // warps per CTA
constexpr int kFrMaxSimtRows = 16;  // rows of x the CUDA-core kernel takes

struct FrArrays {
  const uint8_t* plane;
  const uint32_t* lo;
  const uint32_t* hi;
  const uint16_t* tile;
  const uint16_t* esc;
  int64_t n_esc;
  const int32_t* esc_start;
  int64_t rows, groups, tiles, blocks;
};

struct FrGroup {               // one group's bits: 32 plane bytes, 2 + 1 code words, its tile's word
  uint4 p0, p1;
  uint2 lo;
  uint32_t hi, tile;           // base | the tile's escapes << 8
};

// W's code and tile words through L1, or past it as the plane (kStream; load_group's below).
template <bool kStream, typename T>
__device__ __forceinline__ auto ld_words(const T* p) {
  if constexpr (kStream) return ld_stream(p);
  else return __ldg(p);
}

// A group's bits; a padding group (past the row's groups) reads as codes 0, plane bytes 0 and base
// 0, but keeps its tile's escape count when the tile exists (so a tile's lanes agree on it).
// kMask false leaves its tile word as stored, for a user that passes `valid` to group_fields: the
// mask waits for the word just after its load (6 % of the fused kernel's stall samples, 2026-11-28).
// kStream: the code and tile words bypass L1 as the plane does. Through L1 they are about 14 of
// each 46 bytes of W and stream x out of it: the fused kernel from 9 rows of x (and x early at
// 17-32 rows), served at 32 clients, 3 072-3 086 -> 3 485 tokens/s (H200, 2026-11-28). They bypass
// it from kSlotRows (7) rows, and in wide_kernel (17-64 rows) since 66762e5. Up to 6 rows they stay
// in L1, where a quad's next tiles find their tile and hi words: served at batch 1 without it
// 202-205 tokens/s, with it 197-198 (H200, 2026-11-28; the 8B layer bench alone had shown 1.075 ->
// 1.044 of cuBLAS at 1 row).
template <bool kMask = true, bool kStream = false>
__device__ __forceinline__ FrGroup load_group(const FrArrays& a, int64_t row, int64_t gr, bool valid) {
  const int64_t g = row * a.groups + gr;
  FrGroup t{};
  if (gr / kFrTileGroups < a.tiles) t.tile = ld_words<kStream>(a.tile + row * a.tiles + gr / kFrTileGroups);
  if (!valid) {
    if constexpr (kMask) t.tile &= 0xFF00u;
    return t;
  }
  t.p0 = ld_stream(a.plane + g * kFrGroup);
  t.p1 = ld_stream(a.plane + g * kFrGroup + 16);
  t.lo = ld_words<kStream>(reinterpret_cast<const uint2*>(a.lo) + g);
  t.hi = ld_words<kStream>(a.hi + g);
  return t;
}

// A float32 sum rounded once to the output's 16-bit word.
template <bool kBf16>
__device__ __forceinline__ uint16_t from_float(float v) {
  if constexpr (kBf16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  else return __half_as_ushort(__float2half_rn(v));
}

__device__ __forceinline__ int tile_escapes(const FrGroup& t) { return static_cast<int>(t.tile >> 8); }

// unpack_codes + base, 4 fields a u32 (f[q] byte b: weight 4q + b); an escaped weight's field is
// base + 0 until its entry replaces it. A padding group (valid false) has base 0.
__device__ __forceinline__ void group_fields(const FrGroup& t, uint32_t f[8], bool valid = true) {
  const uint32_t base4 = valid ? (t.tile & 0xFFu) * 0x01010101u : 0u;
#pragma unroll
  for (int q = 0; q < 8; ++q) f[q] = fr_fields4(t.lo.x, t.lo.y, t.hi, q, base4);
}

// Escape entry j (position in the tile | field << 8); 0 outside the array (a decoder never reads
// past it: the form is made in memory by the loader, not read from a file).
__device__ __forceinline__ uint32_t esc_entry(const FrArrays& a, int64_t j) {
  return j >= 0 && j < a.n_esc ? __ldg(a.esc + j) : 0u;
}

// The lane's 8 field words to its 32-byte slot of shared memory (byte i: weight i). A quad of lanes
// holding one tile's 4 groups has consecutive slots: the tile's 128 field bytes in weight order, so
// an entry patches byte (its position) of the quad's first slot. Then (after the patch) back.
__device__ __forceinline__ void fields_to_slot(uint4 (&slot)[2], const uint32_t f[8]) {
  slot[0] = make_uint4(f[0], f[1], f[2], f[3]);
  slot[1] = make_uint4(f[4], f[5], f[6], f[7]);
}

__device__ __forceinline__ void fields_from_slot(const uint4 (&slot)[2], uint32_t f[8]) {
  const uint4 s0 = slot[0], s1 = slot[1];
  f[0] = s0.x, f[1] = s0.y, f[2] = s0.z, f[3] = s0.w, f[4] = s1.x, f[5] = s1.y, f[6] = s1.z, f[7] = s1.w;
}

__device__ __forceinline__ void patch_entry(uint4 (&slot)[2], uint32_t e) {
  reinterpret_cast<uint8_t*>(&slot[0] - 2 * (threadIdx.x & 3))[e & kFrPosMask] = static_cast<uint8_t>(e >> kFrFieldShift);
}

// The fields of lane's group of escape block `blk` of `row`, escapes patched (whole warp calls;
// `start` is the block's esc_start; `slot` the lane's, the warp's 32 slots consecutive). Lane l
// requests the block's entry l with its group (a block has ~13 escapes on trained weights); the
// tiles' first entries are a warp prefix sum of their counts, and a tile's 4 lanes patch its
// entries 4 at a time, each taken from the lane that loaded it (a block's entries past the 32nd
// are loaded one by one).
__device__ __forceinline__ FrGroup block_fields(const FrArrays& a, int64_t row, int64_t blk, int64_t start,
                                                uint4 (&slot)[2], uint32_t f[8]) {
  const int lane = threadIdx.x & 31;
  const int64_t gr = blk * kFrBlockGroups + lane;
  const FrGroup t = load_group(a, row, gr, gr < a.groups);
  const uint32_t win = esc_entry(a, start + lane);
  group_fields(t, f);
  const int c = tile_escapes(t);
  int incl = (lane & 3) == 0 ? c : 0;                               // warp prefix sum over the tiles
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  const int rounds = static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(c + 3) >> 2));
  if (rounds == 0) return t;
  fields_to_slot(slot, f);
  __syncwarp();
  for (int i = 0; i < rounds; ++i) {
    const int k = (lane & 3) + 4 * i, j = incl - c + k;             // the tile's entry k, the block's j
    uint32_t e = __shfl_sync(0xffffffffu, win, j & 31);
    if (k < c) {
      if (j >= 32) e = esc_entry(a, start + j);
      patch_entry(slot, e);
    }
  }
  __syncwarp();
  fields_from_slot(slot, f);
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

// y = x W^T on CUDA cores (fixedrate_gemv.cu) or tensor cores (fixedrate_mma.cu, fixedrate_wide.cu).
void launch_gemv(const FrArrays& a, const at::Tensor& x, const at::Tensor& y, cudaStream_t stream);
// permuted: x already in the kernel's layout for y's rows (kFrSlotRows..64; fixedrate_host.h), no permute launch.
void launch_mma(const FrArrays& a, const at::Tensor& x, const at::Tensor& y, cudaStream_t stream, bool permuted = false);
constexpr int64_t kFrKernelMma = 0, kFrKernelSimt = 1;

}  // namespace wcodec
