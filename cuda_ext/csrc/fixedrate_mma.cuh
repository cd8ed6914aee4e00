// What the fused fixed-rate matmul's two kernels share (fixedrate_mma.cu: 1-16 rows of x, mma_kernel;
// fixedrate_wide.cu: 17-64 rows, wide_kernel): the decode of rows r and r + 8 of W as the mma's A operand (a lane's
// cursor, its pair of groups and their escape patch), the cut of K and the sum of its ranges
// (sum_parts). Internal linkage (an unnamed namespace): each kernel file compiles its own copy.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>

#include "fixedrate_gemv.cuh"
#include "fixedrate_host.h"
#include "launch.cuh"

namespace wcodec {

// From kFrWideRows rows of x (fixedrate_wide.cu): wide_kernel and its launches, y [nx, rows] written
// (x permuted for it already where `permuted`).
void launch_wide_mma(const FrArrays& a, const at::Tensor& x, bool permuted, int nx, uint16_t* y, cudaStream_t stream);

namespace {

constexpr int kMmaWarps = 4;

constexpr int kTargetWarps = 4096;

// The shared-memory carveout: the smallest that holds `ctas` CTAs of `kernel` an SM on device `dev`,
// so that the rest of the SM's L1 and shared memory is L1, where x and the tiles' words live. The
// driver's default gives these kernels a 102.4 KB configuration where they use 6-17 KB a CTA; with
// this rule ncu shows 65.5 KB (the driver takes the next configuration up from the hint) and the same
// CTAs an SM. The served step level at 1-16 rows and 0.3-1.1 % faster at 24-32; a hint too small for
// the CTAs an SM (10 %, 0 %) cost them and up to 2.8x (H200, 2026-11-30). Its callers set it once a
// kernel and device (per_device); returns the hint + 1 (never 0, as per_device wants).
int set_carveout(const void* kernel, int ctas, int dev) {
  cudaFuncAttributes f;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&f, kernel));
  int per_sm = 0, reserved = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  const int64_t need = static_cast<int64_t>(ctas) * static_cast<int64_t>(f.sharedSizeBytes + reserved);
  const int hint = static_cast<int>(std::min<int64_t>(100, (100 * need + per_sm - 1) / per_sm));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, hint));
  return hint + 1;
}


// Escapes of the row in tiles 0 .. s0 - 1 of block blk: where a split of K starts inside a block,
// its running count starts past them.
__device__ __forceinline__ int escapes_before(const FrArrays& a, int64_t row, int64_t blk, int s0) {
  int n = 0;
  for (int s = 0; s < s0; ++s) n += __ldg(a.tile + row * a.tiles + blk * kFrBlockTiles + s) >> 8;
  return n;
}

// A lane's words of its group in a row's tiles, read in order at fixed strides: for a block whose
// groups all exist, no masks and no address arithmetic but a 32-bit index each (the launch checks
// that a matrix's groups fit) off the arrays' bases (kernel parameters: no registers).
struct GroupCursor {
  uint32_t g, tile;                                                  // the group and tile word of the next tile
  __device__ __forceinline__ GroupCursor(const FrArrays& a, int64_t row, int64_t gr)
      : g(static_cast<uint32_t>(row * a.groups + gr)), tile(static_cast<uint32_t>(row * a.tiles + gr / kFrTileGroups)) {}
  template <bool kStream = false>                                    // load_group's kStream
  __device__ __forceinline__ FrGroup next(const FrArrays& a) {      // load_group's loads, then a tile on
    FrGroup t;
    const uint4* p = reinterpret_cast<const uint4*>(a.plane) + 2 * static_cast<uint64_t>(g);
    t.tile = ld_words<kStream>(a.tile + tile), t.p0 = ld_stream(p), t.p1 = ld_stream(p + 1);
    t.lo = ld_words<kStream>(reinterpret_cast<const uint2*>(a.lo) + g), t.hi = ld_words<kStream>(a.hi + g);
    g += kFrTileGroups, tile += 1;
    return t;
  }
};

// esc_entry for an int32 index (the entries are < 2^31: esc_start is int32): one compare.
__device__ __forceinline__ uint32_t esc_entry32(const FrArrays& a, int32_t j) {
  return static_cast<uint32_t>(j) < static_cast<uint32_t>(a.n_esc) ? __ldg(a.esc + static_cast<uint32_t>(j)) : 0u;
}

// Rows r and r + 8 of a warp's 16 rows of W (W as the mma's A operand): lane (r, t) decodes group t
// of a tile of both. A tile's two groups and their escape entries t, and their fields with the
// tile's escapes patched in one pass (tile_fields' steps for two slots; written as one helper with
// tile_fields, the compiler laid walk_block_w16's loop out differently, 3 728 -> 3 744 instructions,
// so the form proven on the GPU stays).
struct PairTile {
  FrGroup ga, gb;
  uint32_t ea, eb;                                                   // their escape entry t
};

template <bool kFull, bool kStream = false>                          // kStream: load_group's
__device__ __forceinline__ PairTile fetch_pair(const FrArrays& a, GroupCursor& ca, GroupCursor& cb, int64_t row_a,
                                               int64_t row_b, int64_t gr, bool valid, int32_t ra, int32_t rb) {
  PairTile n;                                                        // ra, rb: the tile's first entries
  if constexpr (kFull) {
    n.ga = ca.template next<kStream>(a), n.gb = cb.template next<kStream>(a);
  } else {
    n.ga = load_group<true, kStream>(a, row_a, gr, valid), n.gb = load_group<true, kStream>(a, row_b, gr, valid);
  }
  const int t = threadIdx.x & 3;
  n.ea = esc_entry32(a, ra + t), n.eb = esc_entry32(a, rb + t);
  return n;
}

__device__ __forceinline__ void pair_fields(const FrArrays& a, const PairTile& p, int32_t& run_a, int32_t& run_b,
                                            uint4 (&slot_a)[2], uint4 (&slot_b)[2], uint32_t (&fa)[8], uint32_t (&fb)[8]) {
  const int t = threadIdx.x & 3;
  group_fields(p.ga, fa), group_fields(p.gb, fb);
  const int na = tile_escapes(p.ga), nb = tile_escapes(p.gb);
  if (__any_sync(0xffffffffu, (na | nb) != 0)) {                    // the two rows' escapes in one pass
    fields_to_slot(slot_a, fa), fields_to_slot(slot_b, fb);
    __syncwarp();
    if (t < na) patch_entry(slot_a, p.ea);
    if (t < nb) patch_entry(slot_b, p.eb);
    for (int k = t + 4; __any_sync(0xffffffffu, k - t < max(na, nb)); k += 4) {   // a tile with over 4 escapes
      if (k < na) patch_entry(slot_a, esc_entry32(a, run_a + k));
      if (k < nb) patch_entry(slot_b, esc_entry32(a, run_b + k));
    }
    __syncwarp();
    fields_from_slot(slot_a, fa), fields_from_slot(slot_b, fb);
  }
  run_a += na, run_b += nb;
}

// Range k of `splits` ranges of a row's tiles (whole tiles, the cut of K), walked block by block:
// walk(blk, s0, s1) for the range's tiles s0 .. s1 - 1 of escape block blk.
template <typename Walk>
__device__ __forceinline__ void for_range_blocks(int64_t tiles64, int k, int splits, Walk&& walk) {
  const int tiles = static_cast<int>(tiles64);                      // < 2^31 / 128: k * tiles fits
  const int t1 = static_cast<int>(static_cast<int64_t>(tiles) * (k + 1) / splits);
  for (int tile = static_cast<int>(static_cast<int64_t>(tiles) * k / splits); tile < t1;) {
    const int blk = tile / kFrBlockTiles, s0 = tile % kFrBlockTiles, s1 = min(kFrBlockTiles, t1 - blk * kFrBlockTiles);
    walk(blk, s0, s1);
    tile = blk * kFrBlockTiles + s1;
  }
}

// The running escape counts of rows a and b at tile s0 of block blk.
__device__ __forceinline__ void pair_runs(const FrArrays& a, int64_t row_a, int64_t row_b, int64_t blk, int s0,
                                          int32_t& run_a, int32_t& run_b) {
  run_a = a.esc_start[row_a * a.blocks + blk], run_b = a.esc_start[row_b * a.blocks + blk];
  if (s0) run_a += escapes_before(a, row_a, blk, s0), run_b += escapes_before(a, row_b, blk, s0);
}

// y from float32 sums of ranges of K, rounded once: for each of `parts` groups of `per` ranges (in
// order), the group's sum from 0, then the groups' from 0 (mma_kernel: a CTA's ranges summed in
// shared memory, per = 1 here; wide_kernel: per = the ranges mma_kernel's CTA would sum). With one
// group its sum is y's.
template <bool kBf16>
__global__ void sum_parts_kernel(const float* __restrict__ part, int64_t n, int per, int parts, uint16_t* __restrict__ y) {
  const int64_t i = pdl_element();
  if (i >= n) return;
  float s = 0.f;
  for (int p = 0; p < parts; ++p) {
    float g = 0.f;
    for (int j = 0; j < per; ++j) g += part[(p * per + j) * n + i];
    if (parts > 1) s += g;
    else s = g;
  }
  y[i] = from_float<kBf16>(s);
}

// Splits of K (powers of two, or 6 below; at least kMinSplitTiles tiles each): in a CTA up to
// kMmaWarps while the warps are below kTargetWarps; across CTAs only while below kFewWarps, where the second
// launch (sum_parts, ~2 us) costs less than the idle SMs: k and v of an 8B layer at 16 rows
// 0.0167 -> 0.0112 ms each, but q and o (512 groups of rows) 0.019 -> 0.024 (H100, 2026-11-28).
constexpr int kMinSplitTiles = 2;
constexpr int kFewWarps = 2048;

// mma_kernel's CTA where a matrix's groups of 8 rows, one CTA of kMmaWarps ranges each, leave a
// third of the 1-row kernel's wave empty (kMmaCtas: 6 CTAs an SM) and fit that wave in CTAs of
// kMmaWarpsWide ranges (kMmaCtasWide an SM at the same 80 registers): a 4 096-row matrix on 132 SMs,
// 512 CTAs of 4 warps where 792 fit, 15.5 warps an SM; in CTAs of 6, 23.3 warps an SM, each walking
// two thirds of the tiles. The 8B's down at 1 / 4 / 16 rows 1.039 / 1.192 / 1.268 of cuBLAS's time ->
// 0.888 / 1.040 / 1.152, its q 0.882 / 0.924 / 1.014 -> 0.777 / 0.855 / 1.010; its layer's seven at
// 1 / 4 / 8 / 16 / 32 rows 0.966-0.969 / 1.042-1.045 / 1.136-1.139 / 1.126-1.129 / 1.275-1.278 ->
// 0.903-0.906 / 0.983-0.986 / 1.102 / 1.096 / 1.271-1.274, the 7B's 0.948-0.952 / 1.027-1.033 /
// 1.128-1.130 / 1.113-1.124 / 1.249-1.259 -> 0.875 / 0.966-0.970 / 1.115-1.116 / 1.116-1.118 /
// 1.259-1.264 (H200, 2026-12-02, bench/experiments/fixedrate_ab.py and fixedrate_permatrix.py, the
// two builds alternated twice; bench/fixedrate_gpu.py, one run each on one box: 0.943 / 1.063 / 1.135
// / 1.278 -> 0.881 / 0.998 / 1.104 / 1.270 at 1 / 4 / 16 / 32 rows). From 17 to 40 rows wide_kernel
// takes the same 6 ranges (its rule gives these rows CTAs of 6 warps); from 41, 4 where 6 would
// take more waves (launch_wide). The cut depends on the device's SMs as well as the matrix; on nx
// only across 40 | 41 rows, for such a matrix. Tried for the gate-sized matrices too (14 336 and
// 11 008 rows: 2, 3 or 6 ranges in CTAs of 4 or 6): none better at every row count.
constexpr int kMmaWarpsWide = 6;
constexpr int kMmaCtasWide = 4;

// The matrix's cut of K (not nx's: a row of x gets the same sums in any batch): `splits` ranges,
// `per_cta` of them summed in one of mma_kernel's CTAs of `warps` warps, `parts` such groups summed
// by sum_parts. Where the device has few SMs for the matrix's rows, 6 ranges in CTAs of 6.
struct CutK {
  int splits, per_cta, parts, warps;
};

CutK cut_k(const FrArrays& a, bool six = true) {                    // six: 6 ranges where they fill the wave
  const int64_t row_groups = (a.rows + 7) / 8;
  auto fits = [&](int64_t s) { return s * 2 * kMinSplitTiles <= a.tiles; };
  int64_t splits = 1;
  while (splits < kMmaWarps && row_groups * splits < kTargetWarps && fits(splits)) splits *= 2;
  if (six && splits == kMmaWarps && row_groups * splits >= kFewWarps && fits(kMmaWarpsWide) &&
      row_groups <= kMmaCtasWide * static_cast<int64_t>(sm_count()))
    return {kMmaWarpsWide, kMmaWarpsWide, 1, kMmaWarpsWide};
  while (row_groups * splits < kFewWarps && fits(splits)) splits *= 2;
  const int per_cta = static_cast<int>(std::min<int64_t>(splits, kMmaWarps));
  return {static_cast<int>(splits), per_cta, static_cast<int>(splits / per_cta), kMmaWarps};
}

// The float32 buffer [ranges, nx, rows] that a launch cut into `ranges` writes its sums to (null for one).
float* part_sums(at::Tensor& part, int ranges, int nx, int64_t rows, const at::Tensor& like) {
  if (ranges <= 1) return nullptr;
  part = at::empty({ranges, nx, rows}, like.options().dtype(at::kFloat));
  return part.data_ptr<float>();
}

void launch_sum(bool bf16, const float* part, int64_t n, int per, int parts, uint16_t* y, cudaStream_t stream) {
  launch_pdl(bf16 ? sum_parts_kernel<true> : sum_parts_kernel<false>, dim3(static_cast<unsigned>((n + 255) / 256)), dim3(256),
             stream, part, n, per, parts, y);
}

}  // namespace
}  // namespace wcodec
