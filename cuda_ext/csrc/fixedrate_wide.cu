// The fused y = x W^T from kFrWideRows (17) to 64 rows of x (wide_kernel): W as the mma's A
// operand, 16 rows of W a warp, against up to 8 n8 tiles of x as B (fixedrate_mma.cu has the
// 1-16-row kernel and the layout of the mma's fragments; fixedrate_mma.cuh what the two share).
#include "fixedrate_mma.cuh"

namespace wcodec {
namespace {

// From kFrWideRows rows of x: W as A (16 rows of W a warp, walk_block_w16's decode) against up to 8
// n8 tiles of x as B (C: W rows r, r + 8, x rows 8j + 2t, 8j + 2t + 1 of n-tile j), 8 warps a CTA
// on one range of K, so that 128 rows of W share each x word through L1. x is first permuted
// (permute_xb) so that a warp's load of a half-tile q of n-tile j is 256 consecutive bytes:
//   xq = [tiles] [8 halves q] [kNT n-tiles j] [32 lanes (r, t)] of uint2 {x[8j + r][p], x[8j + r][p + 1]},
//   p = 16 (4 tile + t) + 2q (x's pairs), zeros past nx and past the row's groups,
// and each half's kNT words are requested before the half ahead's mma (asm volatile, so the
// compiler does not hoist a tile's 8 kNT words into registers). K is cut as mma_kernel cuts it
// and the ranges' float32 sums are added in its order (sum_parts), so a row of x gets the same
// bits as in the 1-16-row kernels: a row's sums do not depend on its batch. Two tiles a turn (no
// copy of the tile in flight) and no registers bound: up to 255 registers, one CTA an SM. An 8B
// layer's seven matmuls at 17 / 24 / 32 / 48 / 64 rows: 1.43 / 1.37 / 1.38 / 2.71 / 2.78 of cuBLAS's
// time (x as A, 8 rows of W a warp, 4 warps a CTA) -> 1.35 / 1.32 / 1.41 / 1.54 / 1.72; the 7B
// layer's 1.41 / 1.35 / 1.36 / 2.75 / 2.87 -> 1.30 / 1.25 / 1.33 / 1.49 / 1.73 (H200, 2026-11-29,
// bench/experiments/fixedrate_ab.py). Slower there: a tile copied each step (64 rows 1.85), 12 or
// 16 warps a CTA (168 or 128 registers, spills: 2.10, 2.34), two CTAs of 8 (2.37), two tiles in
// flight (1.80), x's next tiles or W's plane lines prefetched to L1 or L2 (level or 1.78).
// Up to 40 rows (up to 5 n8 tiles) at most 168 registers (4 bytes spilled at 4 n8 tiles), so that
// 12 warps fit an SM: a matrix whose CTAs of 8 warps fill more than one wave takes CTAs of 6 (or 5),
// two an SM (wide_launch). 6 and 7 n8 tiles fit 168 registers without spilling too, but their layers ran
// 1.54 -> 1.56 of cuBLAS's time at 48 rows; 8 spilled 88 bytes (1.73 -> 2.00 at 64); at 40 rows
// 1.47 -> 1.44 (the 8B layer) and 1.42 -> 1.39 (the 7B's). At 128 registers (16 warps an SM, 16-36
// bytes spilled) 17-32 rows ran 1.30-1.37 -> 1.65-1.93 (H200, 2026-11-30).
constexpr int kWideWarps = 8;

__global__ void permute_xb_kernel(const uint32_t* __restrict__ x, int64_t groups, int nx, int nt, int64_t units,
                                  uint2* __restrict__ xq) {
  const int64_t i = pdl_element();
  if (i >= units) return;
  const int lane = static_cast<int>(i % 32), j = static_cast<int>(i / 32 % nt);
  const int64_t u = i / 32 / nt;                                    // tile * 8 + q
  const int q = static_cast<int>(u % 8), r = 8 * j + lane / 4;
  const int64_t gr = u / 8 * kFrTileGroups + lane % 4;
  uint2 v = make_uint2(0, 0);
  if (r < nx && gr < groups) {
    const uint32_t* p = x + (r * groups + gr) * (kFrGroup / 2) + 2 * q;
    v = make_uint2(p[0], p[1]);
  }
  xq[i] = v;
}

__device__ __forceinline__ uint2 ld_x2(const uint2* p) {           // asm volatile: stays where it is written
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

template <bool kBf16, int kNT, bool kFull>
__device__ __forceinline__ void walk_block_wide(const FrArrays& a, const uint2* __restrict__ xq, int64_t row_a,
                                                int64_t row_b, int64_t blk, int s0, int tiles, uint4 (&slot_a)[2],
                                                uint4 (&slot_b)[2], float (&c)[kNT][4], bool& wait) {
  const int64_t gr0 = blk * kFrBlockGroups + (threadIdx.x & 3);
  auto valid = [&](int s) { return kFull || gr0 + s * kFrTileGroups < a.groups; };   // tile s's group is not padding
  int32_t run_a, run_b;
  pair_runs(a, row_a, row_b, blk, s0, run_a, run_b);
  GroupCursor ca(a, row_a, gr0 + s0 * kFrTileGroups), cb(a, row_b, gr0 + s0 * kFrTileGroups);
  const uint2* xc = xq + (blk * kFrBlockTiles + s0) * (8 * kNT * 32) + (threadIdx.x & 31);   // the next tile's x
  // W's code and tile words past L1 (L1::no_allocate, as the plane's), which leaves L1 to x, read
  // by every warp of the SM: the 8B layer's seven at 17 / 24 / 32 rows 1.235 / 1.200 / 1.292 ->
  // 1.176 / 1.144 / 1.257 of cuBLAS's time, the 7B's 1.206 / 1.172 / 1.277 -> 1.150 / 1.125 / 1.248;
  // the served step at 28 / 32 rows 8B 1.311 / 1.299 -> 1.294 / 1.285, 7B level (H200, 2026-11-30).
  auto fetch = [&](int s, int32_t ra, int32_t rb) {                  // tiles in order
    return fetch_pair<kFull, true>(a, ca, cb, row_a, row_b, gr0 + s * kFrTileGroups, valid(s), ra, rb);
  };
  auto step = [&](const PairTile& p) {
    uint32_t fa[8], fb[8];
    pair_fields(a, p, run_a, run_b, slot_a, slot_b, fa, fb);
    uint2 xb[2][kNT];
#pragma unroll
    for (int j = 0; j < kNT; ++j) xb[0][j] = ld_x2(xc + j * 32);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (q < 7) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) xb[(q + 1) & 1][j] = ld_x2(xc + ((q + 1) * kNT + j) * 32);
      }
      uint32_t a0, a1, a2, a3;
      join4(plane_word(p.ga, q), fa[q], a0, a2);
      join4(plane_word(p.gb, q), fb[q], a1, a3);
#pragma unroll
      for (int j = 0; j < kNT; ++j) mma16816<kBf16>(c[j], a0, a1, a2, a3, xb[q & 1][j].x, xb[q & 1][j].y);
    }
    xc += 8 * kNT * 32;
  };
  PairTile even = fetch(s0, run_a, run_b), odd{};                    // two tiles a turn: registers for both
  if (wait) pdl_wait(), wait = false;                                // W's first tile requested
  for (int s = s0; s < tiles; s += 2) {                              // warp-uniform
    if (s + 1 < tiles) odd = fetch(s + 1, run_a + tile_escapes(even.ga), run_b + tile_escapes(even.gb));
    step(even);
    if (s + 1 == tiles) break;
    if (s + 2 < tiles) even = fetch(s + 2, run_a + tile_escapes(odd.ga), run_b + tile_escapes(odd.gb));
    step(odd);
  }
}

// A CTA: 8 warps (or wide_launch's 6 or 5) of 16 rows of W on range blockIdx.y of K, whose float32
// sums go to `part` [ranges][nx][rows] when K is cut (else y, as mma_kernel rounds them).
template <bool kBf16, int kNT>
__global__ void __launch_bounds__(32 * kWideWarps) __maxnreg__(kNT <= 5 ? 168 : 255)
    wide_kernel(FrArrays a, const uint2* __restrict__ xq, int nx, uint16_t* __restrict__ y, float* __restrict__ part) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int64_t row0 = (blockIdx.x * static_cast<int64_t>(warps) + warp) * 16;
  const int64_t row_a = min(row0 + (lane >> 2), a.rows - 1), row_b = min(row0 + 8 + (lane >> 2), a.rows - 1);
  __shared__ uint4 stage[2][32 * kWideWarps][2];
  float c[kNT][4] = {};
  bool wait = true;                                                 // pdl_wait still to come
  const int k = blockIdx.y;
  if (row0 < a.rows)                                                // warp-uniform
    for_range_blocks(a.tiles, k, static_cast<int>(gridDim.y), [&](int blk, int s0, int s1) {
      if ((blk + 1) * kFrBlockGroups <= a.groups)                  // warp-uniform
        walk_block_wide<kBf16, kNT, true>(a, xq, row_a, row_b, blk, s0, s1, stage[0][threadIdx.x], stage[1][threadIdx.x], c, wait);
      else
        walk_block_wide<kBf16, kNT, false>(a, xq, row_a, row_b, blk, s0, s1, stage[0][threadIdx.x], stage[1][threadIdx.x], c, wait);
    });
  if (wait) pdl_wait();                                             // a warp with no tiles
  pdl_trigger();
  if (row0 >= a.rows) return;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int b = 8 * j + 2 * (lane & 3) + (i & 1);
      const int64_t out_row = row0 + (lane >> 2) + 8 * (i >> 1);
      if (b >= nx || out_row >= a.rows) continue;
      if (part) {
        part[(k * static_cast<int64_t>(nx) + b) * a.rows + out_row] = c[j][i];
      } else {
        const float v = 0.f + c[j][i];                               // mma_kernel's sum over one range
        y[b * a.rows + out_row] = from_float<kBf16>(v);
      }
    }
  }
}

// wide_kernel's warps a CTA (and the waves they take) for a matrix of `rows` cut into `splits`
// ranges of K: 8 (128 rows of W sharing each x word through L1) while the launch's CTAs of 8 warps
// all fit the device at once; past that, kWideWarpsMany where more of its warps fit an SM (two CTAs
// of 6 warps, 12 warps an SM, where the kernel needs at most 168 registers), so that the launch runs
// in fewer, fuller waves.
// Each warp's sums are the same bits either way. The 7B's served matrices at 17 / 25 / 32 rows,
// 8 -> 6 warps a CTA: qkv (12 288 rows) 1.35 / 1.44 / 1.48 -> 1.16 / 1.30 / 1.33 of cuBLAS's time,
// gate_up (22 016) 1.46 / 1.57 / 1.63 -> 1.29 / 1.40 / 1.47, but o (4 096 rows, one wave of 8)
// 1.02 / 1.33 / 1.14 -> 1.22 / 1.62 / 1.38 and down (4 096) 1.21 / 1.30 / 1.32 -> 1.53 / 1.71 / 1.73,
// hence the rule (H200, 2026-11-30, one build, a sweep of 4 to 8 warps; 5 and 7 slower on most).
// But CTAs of 5 (two an SM, 10 warps) where they take no more waves than CTAs of 6: the last wave
// fuller, fewer warps on an SM. The 8B's gate_up (28 672 rows, 2 ranges; 2.27 waves of 6, 2.72 of
// 5) at 32 rows 1.635 with 6 warps, 1.513 with 5 (the same sweep); every other matrix of the two
// layers takes more waves in CTAs of 5 and keeps its size.
// The 7B layer's seven at 17 / 24 / 28 / 32 rows 1.29 / 1.25 / 1.42 / 1.34 -> 1.23 / 1.19 / 1.37 /
// 1.30, the 8B layer's 1.335 / 1.30 / 1.425 / 1.39 -> 1.29 / 1.25 / 1.38 / 1.35
// (bench/experiments/fixedrate_ab.py, the two builds alternated).
constexpr int kWideWarpsMany = 6;
constexpr int kWideWarpsFew = 5;

// wide_kernel's CTAs along the rows of W in CTAs of `warps` warps (16 rows of W each).
int64_t wide_ctas(int64_t rows, int warps) { return (rows + 16 * warps - 1) / (16 * warps); }

struct WideLaunch {
  int warps;                                                         // a CTA's
  int64_t waves;
};

template <bool kBf16, int kNT>
WideLaunch wide_launch(int64_t rows, int splits) {
  static std::atomic<int32_t> known[64] = {};                       // CTAs an SM of 8 << 16 | of 6 << 8 | of 5
  const int32_t k = per_device(known, [](int dev) {
    int per8 = 0, per6 = 0, per5 = 0;
    auto ctas_an_sm = [](int& n, int warps) {
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, wide_kernel<kBf16, kNT>, 32 * warps, 0));
    };
    ctas_an_sm(per8, kWideWarps), ctas_an_sm(per6, kWideWarpsMany), ctas_an_sm(per5, kWideWarpsFew);
    set_carveout(reinterpret_cast<const void*>(wide_kernel<kBf16, kNT>), std::max({per8, per6, per5}), dev);   // one for all three
    return per8 << 16 | per6 << 8 | per5;
  });
  auto in = [&](int warps, int per) { return waves(wide_ctas(rows, warps) * splits, per); };   // in CTAs of `warps`
  const int per8 = k >> 16, per6 = k >> 8 & 0xFF, per5 = k & 0xFF;
  if (in(kWideWarps, per8) == 1 || per6 * kWideWarpsMany <= per8 * kWideWarps) return {kWideWarps, in(kWideWarps, per8)};
  if (per5 && in(kWideWarpsFew, per5) == in(kWideWarpsMany, per6)) return {kWideWarpsFew, in(kWideWarpsFew, per5)};
  return {kWideWarpsMany, in(kWideWarpsMany, per6)};
}

// From 41 rows of x (6-8 n8 tiles: 255 registers, one CTA of 8 warps an SM) the 6 ranges of K that
// cut_k gives a 4 096-row matrix on 132 SMs take two waves where 4 take one: the 8B layer's seven at
// 64 rows 1.763 -> 1.995 of cuBLAS's time (H200, 2026-12-02, bench/fixedrate_gpu.py). There K keeps
// its 4 ranges where 6 take more waves at 64 rows (decided by the 64-row build for all of 41-64):
// at 48 / 64 rows 1.476-1.478 / 1.686-1.691 against main's 1.479-1.486 / 1.687-1.696, the 7B's
// 1.444-1.451 / 1.702 against 1.446-1.452 / 1.701-1.703 (bench/experiments/fixedrate_ab.py, two
// rounds). So such a matrix gives a row of x the same bits in any batch of 1-40 rows and in any of
// 41-64, not across the two.
constexpr int kFewRangesNT = 6;

// The cut of K wide_kernel takes at kNT n8 tiles: cut_k's, but for the exception above.
template <bool kBf16, int kNT>
CutK wide_cut(const FrArrays& a) {
  const CutK cut = cut_k(a);
  if (kNT < kFewRangesNT || cut.warps != kMmaWarpsWide) return cut;
  const CutK four = cut_k(a, false);
  return wide_launch<kBf16, 8>(a.rows, cut.splits).waves > wide_launch<kBf16, 8>(a.rows, four.splits).waves ? four : cut;
}

// kFrWideRows..64 rows: x permuted for wide_kernel, its ranges' sums added in mma_kernel's order.
// The second launch (sum_parts) stays. Taken off the step with the same bits, the step was level:
// the step's Triton kernels added the ranges where they read y (the served step at 17-32 rows within
// 1.5 %, none faster at 32; what a launch less saves, the consumer pays back in reads of the float32
// ranges). A probe that skipped the launch, leaving y unwritten, had shown 0.07 at 24-32 rows. Each
// way of summing in wide_kernel lost, with the same bits: the last CTA of a row block adding the
// ranges; the ranges in a thread-block cluster, summed through distributed shared memory (the 7B's
// step at 32 rows 1.250 -> 1.644: o and down lose their one wave, 120 CTAs in clusters of 4 against
// 132, and a cluster holds every range of x at once); the ranges in the CTA, as mma_kernel's (1.286
// -> 1.322 at best). The SMs read one or two ranges of x at a time, each x word shared by all of an
// SM's warps through L1, and that is worth more (H200, 2026-11-30; docs/BENCHMARKS.md).
// `permuted`: x is already in permute_xb_kernel's layout (fixedrate_linear_permuted), so no permute launch.
template <bool kBf16, int kNT>
void launch_wide(const FrArrays& a, const at::Tensor& x, bool permuted, int nx, uint16_t* y, cudaStream_t stream) {
  const CutK cut = wide_cut<kBf16, kNT>(a);
  const WideLaunch wl = wide_launch<kBf16, kNT>(a.rows, cut.splits);
  const int64_t units = a.tiles * 8 * kNT * 32;
  at::Tensor xq = x;
  if (!permuted) {
    xq = at::empty({units * 4}, x.options());
    launch_pdl(permute_xb_kernel, dim3(static_cast<unsigned>((units + 255) / 256)), dim3(256), stream,
               reinterpret_cast<const uint32_t*>(x.data_ptr()), a.groups, nx, kNT, units, reinterpret_cast<uint2*>(xq.data_ptr()));
  }
  at::Tensor part;
  float* pp = part_sums(part, cut.splits, nx, a.rows, x);
  const int64_t ctas = wide_ctas(a.rows, wl.warps);
  launch_pdl(wide_kernel<kBf16, kNT>, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(cut.splits)),
             dim3(32 * wl.warps), stream, a, reinterpret_cast<const uint2*>(xq.data_ptr()), nx, y, pp);
  if (cut.splits > 1) launch_sum(kBf16, pp, nx * a.rows, cut.per_cta, cut.parts, y, stream);
}

template <bool kBf16>
void launch_wide_nt(const FrArrays& a, const at::Tensor& x, bool permuted, int nx, uint16_t* y, cudaStream_t stream) {
  switch ((nx + 7) / 8) {                                            // n8 tiles of x
    case 3: return launch_wide<kBf16, 3>(a, x, permuted, nx, y, stream);
    case 4: return launch_wide<kBf16, 4>(a, x, permuted, nx, y, stream);
    case 5: return launch_wide<kBf16, 5>(a, x, permuted, nx, y, stream);
    case 6: return launch_wide<kBf16, 6>(a, x, permuted, nx, y, stream);
    case 7: return launch_wide<kBf16, 7>(a, x, permuted, nx, y, stream);
    default: return launch_wide<kBf16, 8>(a, x, permuted, nx, y, stream);
  }
}

}  // namespace

void launch_wide_mma(const FrArrays& a, const at::Tensor& x, bool permuted, int nx, uint16_t* y, cudaStream_t stream) {
  (x.scalar_type() == at::kBFloat16 ? launch_wide_nt<true> : launch_wide_nt<false>)(a, x, permuted, nx, y, stream);
}

}  // namespace wcodec
