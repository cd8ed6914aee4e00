// The fused y = x W^T on tensor cores (mma.sync m16n8k16, float32 accumulation) for 1..64 rows of
// x, W in the fixed-rate form. Up to 16 rows (mma_kernel; from kSlotRows (7) rows an m16 tile of x shares
// each decoded B fragment) a warp takes 8 rows of W; lane (n, t) = (lane / 4, lane % 4)
// decodes group t of the current 128-weight tile of row n into 16 bf16/fp16 pairs, which are
// exactly its B fragments: mma j (0..7) takes pairs 2j and 2j + 1 (k = 32t + 4j + {0, 1} and
// + {2, 3}), a permutation of k inside the tile that the x (A) fragments follow. So the decoded
// weights never leave registers and need no shuffle. C: batch row lane / 4 (+ 8, + 16m), W rows 2t, 2t + 1.
// Up to 6 rows the roles swap, so that x's loaded words are B as they are: up to 4 rows the same
// registers are A's rows r (A's rows r + 8 are any bits, and C's rows r + 8 are not read), and at
// 5 and 6 rows a warp takes 16 rows of W (walk_block_w16). From 7 to 16 rows x, permuted, is A:
// one m16 tile, its rows past nx zeros (kSlots 2). From 17 rows wide_kernel: W as A, 16 rows a warp,
// against up to 8 n8 tiles of x as B.
// Escapes: the row's block start plus a running count of the tiles' escapes gives a tile's first
// entry; lane t of a quad requests the tile's entry t with the tile ahead, and the quad patches its
// tile's 128 field bytes through shared memory.
#include "fixedrate_mma.cuh"

namespace wcodec {
namespace {

// x's words. mma.m16n8k16's A operand is 4 registers: (row r, k slot 2t), (r + 8, 2t), (r, 2t + 8),
// (r + 8, 2t + 8), lane (r, t) = (lane / 4, lane % 4); its B fragment b0, b1 is W's pairs in the
// same slots. Lane t's slots hold its group's pairs (16 a group, the tile's k permuted): b0 = pair
// 2q, b1 = pair 2q + 1 for plane word q.
// * Up to 6 rows, x in place (x [nx, groups*32]): lane (r, t) reads chunk c (pairs 4c .. 4c + 3)
//   of group t of x row r, 16 bytes, a quad's 4 lanes 64 bytes apart. As A, it took pairs 4c,
//   4c + 1 and then 4c + 2, 4c + 3, its rows r + 8 zero: 2 register moves and 2 zeros a mma (H200,
//   2026-11-29, the gate matmul at 1 row: 36.4 us, 16.1 M instructions). As B (x row r is B's
//   column r, k slots 2t, 2t + 8), its (x, y) and (z, w) are b0, b1 as loaded, with the same sums:
//   the 8B layer's seven at 1 row 1.12 -> 1.08 of cuBLAS's time, the 7B layer's 1.08 -> 1.04. Before
//   that change, as A, the word as loaded needed two
//   accumulator chains (A's row r taking pairs 4c, 4c + 2 and its row r + 8 pairs 4c + 1, 4c + 3, the
//   even and odd sums added at the end, at every row count so that a row's sums do not depend on
//   its batch): 35.0 us and 14.9 M, the 8B layer's seven 1.11 -> 1.075 of cuBLAS's time, but the
//   other summation order parted the demo's greedy tokens from decoded mode's at batch 1 (token 8
//   of "Write a haiku about rivers."), which these sums keep. Every lane loading its row clamped
//   to nx lost (40.8 us: L1 63 -> 80 % busy, long-scoreboard stalls 3.4 -> 6.4 cycles an
//   instruction), and so did one chain without the zeroing (40.3 us).
// * From kSlotRows rows (9 until 2026-11-30), where x's loads were the bound, permute_x first
//   writes each m16 tile's A operand as one 16-byte word, which goes to the mma as loaded: separate
//   words for rows r and r + 8 cost 4 register moves a mma, 32 a tile, in the SASS
//   (scripts/gpu/sass_loop.py); without them 16 rows 1.20 -> 1.16 of cuBLAS's time and 32 rows
//   1.63 -> 1.53 (H200, 2026-11-29). A warp's load is 512 consecutive bytes:
//     xp = [tiles] [4 chunks] [2 halves] [M = slots / 2 m16 tiles] [8 rows r] [4 groups t] of uint4
//     {x[r0][p], x[r0 + 8][p], x[r0][p + 1], x[r0 + 8][p + 1]}, r0 = 16m + r, p = 4 chunk + 2 half,
//   zeros past nx rows and past the row's groups.
constexpr int kXQuads = 4 * 2;                                        // A words of an m16 tile a tile: chunks x halves

__global__ void permute_x_kernel(const uint32_t* __restrict__ x, int64_t groups, int nx, int mt, int64_t units,
                                 uint4* __restrict__ xp) {
  const int64_t i = pdl_element();
  if (i >= units) return;
  const int lane = static_cast<int>(i % 32);
  const int64_t q = i / 32 / mt;                                      // tile * 8 + chunk * 2 + half
  const int64_t gr = q / kXQuads * kFrTileGroups + lane % 4;
  const int r0 = static_cast<int>(i / 32 % mt) * 16 + lane / 4, p = static_cast<int>(q % kXQuads) * 2;
  auto at = [&](int r, int k) { return r < nx && gr < groups ? x[(r * groups + gr) * (kFrGroup / 2) + k] : 0u; };
  xp[i] = make_uint4(at(r0, p), at(r0 + 8, p), at(r0, p + 1), at(r0 + 8, p + 1));
}

// A lane's x words in a block: chunk c of its tile s at at[s * tile + c * chunk] (from kSlotRows rows, A word
// h = half * M + m of it at + h * 32).
template <int kSlots>
struct XWords {
  const uint4* at;
  int tile, chunk;                                                  // < 2^31: x has < 2^31 words
  __device__ __forceinline__ XWords(const uint4* x, int64_t groups, int64_t gr, int r) {
    if constexpr (kSlots > 1) {
      tile = kXQuads * kSlots / 2 * 32, chunk = kSlots * 32;
      at = x + gr / kFrTileGroups * tile + (threadIdx.x & 31);
    } else {
      at = x + (r * groups + gr) * 4, tile = 4 * kFrTileGroups, chunk = 1;
    }
  }
};

// x's words of chunk jj of a tile (kSlots of them; in place, zeros past nx and past the row's
// groups), requested before the tile ahead's loads and this tile's decode, so that they arrive
// while the lane decodes: asm volatile, so that the load stays there (the compiler leaves a plain
// load just ahead of its mma, and the warp waited on it: a quarter of the kernel's stall samples at
// 1 and 16 rows, ncu 2026-11-28).
template <int kSlots>
__device__ __forceinline__ void load_x_early(const uint4* __restrict__ xt, const XWords<kSlots>& xw, int nx, bool valid,
                                             int jj, uint4 (&xv)[kSlots]) {
#pragma unroll
  for (int h = 0; h < kSlots; ++h) {
    xv[h] = make_uint4(0, 0, 0, 0);
    const uint4* p = xt + jj * xw.chunk + h * 32;
    if (kSlots > 1 || (valid && (threadIdx.x & 31) >> 2 < nx))
      asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(xv[h].x), "=r"(xv[h].y), "=r"(xv[h].z), "=r"(xv[h].w) : "l"(p));
  }
}

// x's chunks of a tile, all 4 requested early, before the tile ahead's loads. At 9-16 rows with 5
// CTAs an SM (91 registers), an 8B layer 1.42 -> 1.29 of cuBLAS's time; up to 8 rows with 6 (80
// registers), 1.09 -> 1.07 at 1 row and 1.17 -> 1.145 at 4 (H200, 2026-11-28; 5 CTAs or 2 chunks
// gained less).
template <int kSlots>
using XEarly = uint4[4][kSlots];

// One tile step: chunk jj (0..3) of x against plane words q = 2jj, 2jj + 1 (pairs 4jj .. 4jj + 3),
// a mma a half (q) and an m16 tile of x (A word h = half * M + m), x's chunks from xe.
template <bool kBf16, int kSlots>
__device__ __forceinline__ void tile_mma(const XEarly<kSlots>& xe, const FrGroup& tg, const uint32_t f[8],
                                         float (&c)[(kSlots + 1) / 2][4]) {
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const uint4 (&xv)[kSlots] = xe[jj];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t b0, b1;
      join4(plane_word(tg, 2 * jj + half), f[2 * jj + half], b0, b1);
      if constexpr (kSlots == 1) {                                  // W as A (rows r + 8 any bits), x as B
        const uint4& xb = xv[0];
        uint32_t any0, any1;
        asm volatile("" : "=r"(any0), "=r"(any1));                    // no instruction: whatever the registers hold
        mma16816<kBf16>(c[0], b0, any0, b1, any1, half ? xb.z : xb.x, half ? xb.w : xb.y);
      } else {
#pragma unroll
        for (int m = 0; m < kSlots / 2; ++m) {
          const uint4& a = xv[half * (kSlots / 2) + m];
          mma16816<kBf16>(c[m], a.x, a.y, a.z, a.w, b0, b1);
        }
      }
    }
  }
}

// The lane's field words of its group of a tile (escapes patched: the quad's entries, the first 4
// prefetched, lane t's in e), `run` then past the tile's escapes (whole warp calls).
// kVote: a warp vote skips the patch when no lane's tile has escapes, and another runs the loop
// over a tile's entries past the 4th. Without them (every tile through shared memory, each lane
// looping over its own entries between the barriers) 16 and 32 rows ran 1.112-1.113 -> 1.104-1.106
// and 1.386-1.389 -> 1.369-1.373 of cuBLAS's time, but 1 to 4 rows 0.978-0.980 -> 0.986-0.991 and
// 1.067 -> 1.082-1.089 (H200, 2026-11-29, bench/experiments/fixedrate_ab.py; docs/BENCHMARKS.md).
template <bool kVote>
__device__ __forceinline__ void tile_fields(const FrArrays& a, const FrGroup& tg, bool valid, uint32_t e, int32_t& run,
                                            uint4 (&slot)[2], uint32_t (&f)[8]) {
  const int t = threadIdx.x & 3;
  group_fields(tg, f, valid);
  const int n = tile_escapes(tg);
  if (!kVote || __any_sync(0xffffffffu, n != 0)) {
    fields_to_slot(slot, f);
    __syncwarp();
    if (t < n) patch_entry(slot, e);
    for (int k = t + 4; kVote ? __any_sync(0xffffffffu, k - t < n) : k < n; k += 4)   // a tile with over 4 escapes
      if (k < n) patch_entry(slot, esc_entry(a, run + k));
    __syncwarp();
    fields_from_slot(slot, f);
  }
  run += n;
}

// x's 16-byte word at p into v if `load`, else v as it was (no zeroing: B's columns past nx feed
// only y's columns past nx, which are not written, so a lane past nx keeps its zeros).
__device__ __forceinline__ void load_x_keep(const uint4* p, bool load, uint4& v) {
  asm volatile("{.reg .pred q; setp.ne.b32 q, %5, 0; @q ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];}"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(p), "r"(static_cast<int>(load)));
}

// Tiles s0 .. tiles - 1 of a row's escape block, one by one, the next tile's bytes (and its first
// 4 entries: lane t the t-th) requested before this tile's decode and mma (the loads are asm
// volatile, so the compiler never hoists them itself): 7-8 % faster on an 8B layer at 1, 4 and 16
// rows (H100, bench/fixedrate_gpu.py, 2026-11-26). Up to 8 rows two tiles a turn, so the tile in
// flight and the one decoded keep their registers (no copy a tile): 4.5 % faster at 4 rows; from 9
// rows it spilled and lost 1-3 % (H200, 2026-11-27). From 9 rows the tile ahead sits in a ring
// unrolled by two, so the compiler renames instead of copying: 16 rows 1.19 -> 1.11 of cuBLAS, 32 rows
// 1.47 -> 1.40 (H100, 2026-11-28; spelled as a plain copy with `#pragma unroll 2` it spilled at 32
// rows and lost). Two tiles ahead spilled at 5-7 CTAs an SM and lost at every row count.
// kFull (up to kCursorRows rows of x, and from kSlotRows): every group of the block exists, so W is read by
// a cursor and x at fixed strides, with no masks and no 64-bit address arithmetic.
template <bool kBf16, int kSlots, bool kFull = false>
__device__ __forceinline__ void walk_block(const FrArrays& a, const uint4* __restrict__ x, int nx, int64_t row,
                                           int64_t blk, int s0, int tiles, uint4 (&slot)[2],
                                           float (&c)[(kSlots + 1) / 2][4], bool& wait) {
  const int t = threadIdx.x & 3;
  const int64_t gr0 = blk * kFrBlockGroups + t;
  const XWords<kSlots> xw(x, a.groups, gr0, (threadIdx.x & 31) >> 2);
  constexpr bool kMaskAtLoad = kSlots == 1;                        // x as A: at use (x as B it cost registers)
  auto valid = [&](int s) { return kFull || gr0 + s * kFrTileGroups < a.groups; };   // tile s's group is not padding
  GroupCursor cur(a, row, gr0 + s0 * kFrTileGroups);               // kFull: the next tile's words
  auto group_at = [&](int s) {
    if constexpr (kFull) return cur.template next<(kSlots > 1)>(a);
    else return load_group<kMaskAtLoad, (kSlots > 1)>(a, row, gr0 + s * kFrTileGroups, valid(s));
  };
  int32_t run = a.esc_start[row * a.blocks + blk];                 // the tile's first entry (int32: < 2^31)
  if (s0) run += escapes_before(a, row, blk, s0);
  auto entry = [&](int32_t j) { return kFull ? esc_entry32(a, j) : esc_entry(a, j); };
  const uint4* xc = xw.at + s0 * xw.tile;                          // kFull: x's words of the next tile
  auto x_early = [&](int s, XEarly<kSlots>& xe) {               // kFull: zeroed, predicated (load_x_keep branched)
    const uint4* xt = kFull ? xc : xw.at + s * xw.tile;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) load_x_early<kSlots>(xt, xw, nx, valid(s), jj, xe[jj]);
    if constexpr (kFull) xc += xw.tile;
  };
  auto step = [&](int s, const FrGroup& tg, uint32_t e, const XEarly<kSlots>& xe) {
    uint32_t f[8];
    tile_fields<kSlots == 1>(a, tg, kMaskAtLoad || valid(s), e, run, slot, f);   // votes with x as B
    tile_mma<kBf16, kSlots>(xe, tg, f, c);
  };
  if constexpr (kSlots == 1) {                                       // two tiles a turn: registers for both
    FrGroup even = group_at(s0), odd{};
    uint32_t e_even = entry(run + t), e_odd = 0;
    XEarly<kSlots> xe = {};
    if (wait) pdl_wait(), wait = false;                              // W's first tile requested
    for (int s = s0; s < tiles; s += 2) {                            // warp-uniform
      x_early(s, xe);
      if (s + 1 < tiles) odd = group_at(s + 1), e_odd = entry(run + tile_escapes(even) + t);
      step(s, even, e_even, xe);
      if (s + 1 == tiles) break;
      x_early(s + 1, xe);
      if (s + 2 < tiles) even = group_at(s + 2), e_even = entry(run + tile_escapes(odd) + t);
      step(s + 1, odd, e_odd, xe);
    }
  } else {                                                           // x's slots need the registers
    constexpr int kAhead = 1;                                        // tiles in flight
    FrGroup q[kAhead + 1];
#pragma unroll
    for (int i = 0; i < kAhead; ++i) q[i] = s0 + i < tiles ? group_at(s0 + i) : FrGroup{};
    uint32_t e = esc_entry(a, run + t);
    if (wait) pdl_wait(), wait = false;                              // W's first tile requested
#pragma unroll kAhead + 1
    for (int s = s0; s < tiles; ++s) {
      XEarly<kSlots> xe;
      x_early(s, xe);                                                // before the tile ahead's loads
      q[kAhead] = s + kAhead < tiles ? group_at(s + kAhead) : FrGroup{};
      const uint32_t e_next = s + 1 < tiles ? esc_entry(a, run + tile_escapes(q[0]) + t) : 0u;
      step(s, q[0], e, xe);
#pragma unroll
      for (int i = 0; i < kAhead; ++i) q[i] = q[i + 1];
      e = e_next;
    }
  }
}

// From kWARows to kSlotRows - 1 rows of x, W is the A operand and x the B: a warp takes 16 rows of
// W, lane (r, t) decoding group t of the tile of rows r and r + 8 (A's rows r, r + 8: a0, a2 =
// pairs 2q, 2q + 1 of row r, a1, a3 row r + 8's), and B (k slots 2t, 2t + 8 of x row r) is x's 16-byte word as loaded:
// b0, b1 = its (x, y) or (z, w). No register moves and one mma for two groups' 4 pairs; C is y's W
// rows r, r + 8 for x rows 2t, 2t + 1. The k order and the mma sequence are x as A's, and the sums
// the same bits (tests/gpu/test_fixedrate_cuda.py).
template <bool kBf16, bool kFull>
__device__ __forceinline__ void walk_block_w16(const FrArrays& a, const uint4* __restrict__ x, int nx, int64_t row_a,
                                               int64_t row_b, int64_t blk, int s0, int tiles, uint4 (&slot_a)[2],
                                               uint4 (&slot_b)[2], float (&c)[4], bool& wait) {
  const int t = threadIdx.x & 3;
  const int64_t gr0 = blk * kFrBlockGroups + t;
  const XWords<1> xw(x, a.groups, gr0, (threadIdx.x & 31) >> 2);
  auto valid = [&](int s) { return kFull || gr0 + s * kFrTileGroups < a.groups; };   // tile s's group is not padding
  int32_t run_a, run_b;
  pair_runs(a, row_a, row_b, blk, s0, run_a, run_b);
  GroupCursor ca(a, row_a, gr0 + s0 * kFrTileGroups), cb(a, row_b, gr0 + s0 * kFrTileGroups);
  const bool x_row = (threadIdx.x & 31) >> 2 < nx;                   // the lane's x row exists
  const uint4* xc = xw.at + s0 * xw.tile;                            // x's words of the next tile
  auto fetch = [&](int s, int32_t ra, int32_t rb) {                  // tiles in order
    return fetch_pair<kFull>(a, ca, cb, row_a, row_b, gr0 + s * kFrTileGroups, valid(s), ra, rb);
  };
  auto x_early = [&](int s, XEarly<1>& xe) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if constexpr (kFull) load_x_keep(xc + jj, x_row, xe[jj][0]);
      else load_x_early<1>(xc, xw, nx, valid(s), jj, xe[jj]);        // zeros past the row's groups
    }
    xc += xw.tile;
  };
  auto step = [&](const PairTile& p, const XEarly<1>& xe) {
    uint32_t fa[8], fb[8];
    pair_fields(a, p, run_a, run_b, slot_a, slot_b, fa, fb);
#pragma unroll
    for (int q = 0; q < 8; ++q) {                                    // chunk q / 2 of x, half q % 2
      const uint4& xv = xe[q / 2][0];
      uint32_t a0, a1, a2, a3;
      join4(plane_word(p.ga, q), fa[q], a0, a2);
      join4(plane_word(p.gb, q), fb[q], a1, a3);
      mma16816<kBf16>(c, a0, a1, a2, a3, q % 2 ? xv.z : xv.x, q % 2 ? xv.w : xv.y);
    }
  };
  PairTile even = fetch(s0, run_a, run_b), odd{};                    // two tiles a turn: registers for both
  XEarly<1> xe = {};
  if (wait) pdl_wait(), wait = false;                                // W's first tile requested
  for (int s = s0; s < tiles; s += 2) {                              // warp-uniform
    x_early(s, xe);
    if (s + 1 < tiles) odd = fetch(s + 1, run_a + tile_escapes(even.ga), run_b + tile_escapes(even.gb));
    step(even, xe);
    if (s + 1 == tiles) break;
    x_early(s + 1, xe);
    if (s + 2 < tiles) even = fetch(s + 2, run_a + tile_escapes(odd.ga), run_b + tile_escapes(odd.gb));
    step(odd, xe);
  }
}

// CTAs an SM the registers must allow: from 7 to 16 rows 5 (91 registers with
// x's early chunks; 6 spilled); x as B (up to 4 rows) 6 (80 registers with x's early chunks; before them 7
// with 72, and 8, with 64 registers, was slower).
// W as A (5-6 rows) 4: 126 registers, and its grids are half as many warps.
template <int kSlots, bool kWA>
constexpr int kMmaCtas = kWA ? 4 : kSlots == 2 ? 5 : 6;
// A launch whose grid takes fewer waves at one CTA an SM more runs a build held to that many (the
// same sums). Up to 4 rows, 7 CTAs at 72 registers (16-40 bytes spilled): the 8B gate and up at 1
// row, 1 792 CTAs, 3 waves -> 2; the 8B layer's seven at 1 / 2 / 4 rows 0.982-0.983 / 1.003-1.006 /
// 1.081-1.084 -> 0.971-0.972 / 0.997-0.998 / 1.058-1.064 of cuBLAS's time; the 7B layer's, none of
// whose grids it changes, level (H200, 2026-11-30, bench/experiments/fixedrate_ab.py, alternated
// twice). Every matrix at 7 CTAs was slower (an earlier try). At 9-16 rows, 6 CTAs at 80 registers
// (64 bytes spilled): the 7B's gate and up (1 376 CTAs) and its served qkv and gate_up, 3 waves ->
// 2; the 7B layer's seven at 9 / 12 / 16 rows 1.120-1.122 / 1.108-1.111 / 1.110-1.114 -> 1.105-1.106 /
// 1.103-1.104 / 1.098, the 8B layer's (no grid changed) level (H200, 2026-11-30, the same bits).
// The same rule from 7 rows, where x is A since kSlotRows. In the served step (8 layers,
// bench/experiments/step_rows.py) the rule against never and always one CTA more: the 8B's at 8 / 12
// / 16 rows 1.119 / 1.134 / 1.133 against 1.157 / 1.175 / 1.173 and 1.256 / 1.303 / 1.311 (H200, 2026-11-30).

// Rows of x from which the kernel takes 16 rows of W as A (walk_block_w16), up to kSlotRows - 1
// (until 2026-11-30 up to 8; then, against x as B, at 8 rows the 8B layer's seven matmuls 1.35 ->
// 1.16 of cuBLAS's time, the 7B layer's 1.28 -> 1.19, and at 4 rows 1.14 ->
// 1.08 and 1.09 -> 1.11; at 1 row 1.115 -> 1.08 and 1.07 -> 1.11: its grids have half as many warps,
// and below 5 rows the 7B layer's gate, up and down lose more than their instructions gain (H200,
// 2026-11-29, bench/experiments/fixedrate_ab.py [--7b])). The sums are the same bits either way.
constexpr int kWARows = 5;

// Rows of x up to which walk_block walks a block whose groups all exist by cursors (GroupCursor,
// x at fixed strides: its SASS tile loop 261 -> 189 instructions, 80 registers and 8 bytes of
// stack): the 8B layer's seven at 1 row 1.08 -> 1.06 of cuBLAS's time and the 7B layer's 1.04 ->
// 1.01, but at 2 rows 1.050 -> 1.059 and 1.020 -> 1.006, and at 3-4 rows 1.08 -> 1.11 and 1.13 ->
// 1.16 on the 8B layer (H200, 2026-11-29, bench/experiments/fixedrate_ab.py --rows 1,2,3,4).
// From kSlotRows rows (x permuted, its loads unmasked) the cursor walk is taken too, its code and tile
// words out of L1 as load_group's: SASS tile loop 332 -> 280 instructions, the 7B layer's seven at
// 9 / 12 / 16 rows 1.130 / 1.125 / 1.126 -> 1.117 / 1.114 / 1.110 of cuBLAS's time, the 8B layer's
// within 0.5 % (H200, 2026-11-30). With the code layout of 2026-11-30 (two instructions a field
// word) it is taken at 2 rows too: the 8B layer's seven 0.980 -> 0.968-0.969 and the 7B's 0.952 ->
// 0.938-0.940; up to 4 rows, 4 rows still lost (1.047-1.051 -> 1.060-1.062; H200, 2026-11-30).
constexpr int kCursorRows = 2;

// K is cut into `splits` ranges of whole tiles (a range may start inside an escape block: its
// running count then starts past the block's earlier escapes). A CTA's kWarps warps (4, or 6 for 6
// ranges: cut_k) take `splits_cta` of them for kWarps / splits_cta groups of 8 rows and sum through
// shared memory. A matrix with few rows (1024: 128 groups of 8, one CTA an SM) is cut further,
// gridDim.y CTAs a group of rows, each writing float32 partial sums to `part` [gridDim.y][nx][rows],
// which sum_parts adds in order. The cut depends on the matrix (and the device's SMs), not on nx: a
// row of x gets the same sums in any batch of 1-16 rows (and of 17-40 from wide_kernel; cut_k).
template <bool kBf16, int kSlots, bool kWA, bool kCursor, int kCtas = kMmaCtas<kSlots, kWA>, int kWarps = kMmaWarps>
__global__ void __launch_bounds__(32 * kWarps, kCtas) mma_kernel(FrArrays a, const uint4* __restrict__ x,
                                                                                    int nx, int splits_cta,
                                                                                    uint16_t* __restrict__ y,
                                                                                    float* __restrict__ part) {
  static_assert(!kWA || kSlots == 1, "W as A takes up to kSlotRows - 1 rows of x");
  static_assert(!kCursor || !kWA, "cursors in walk_block (walk_block_w16 has its own)");
  constexpr int kM = (kSlots + 1) / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = (blockIdx.x * static_cast<int64_t>(kWarps / splits_cta) + warp / splits_cta) * (kWA ? 16 : 8);
  const int64_t row = min(row0 + (lane >> 2), a.rows - 1);
  __shared__ uint4 stage[kWA ? 2 : 1][32 * kWarps][2];
  float c[kM][4] = {};
  bool wait = true;                                                 // pdl_wait still to come
  const int k = blockIdx.y * splits_cta + warp % splits_cta;
  for_range_blocks(a.tiles, k, splits_cta * static_cast<int>(gridDim.y), [&](int blk, int s0, int s1) {
    if constexpr (kWA) {
      const int64_t row_b = min(row0 + 8 + (lane >> 2), a.rows - 1);
      if ((blk + 1) * kFrBlockGroups <= a.groups)                    // warp-uniform
        walk_block_w16<kBf16, true>(a, x, nx, row, row_b, blk, s0, s1, stage[0][threadIdx.x], stage[1][threadIdx.x], c[0], wait);
      else
        walk_block_w16<kBf16, false>(a, x, nx, row, row_b, blk, s0, s1, stage[0][threadIdx.x], stage[1][threadIdx.x], c[0], wait);
    } else if (kCursor && (blk + 1) * kFrBlockGroups <= a.groups) {   // warp-uniform
      walk_block<kBf16, kSlots, kCursor>(a, x, nx, row, blk, s0, s1, stage[0][threadIdx.x], c, wait);
    } else {
      walk_block<kBf16, kSlots>(a, x, nx, row, blk, s0, s1, stage[0][threadIdx.x], c, wait);
    }
  });
  if (wait) pdl_wait();                                             // a warp with no tiles
  pdl_trigger();
  __shared__ float red[kWarps][32][4 * kM];
#pragma unroll
  for (int i = 0; i < 4 * kM; ++i) red[warp][lane][i] = c[i / 4][i % 4];
  __syncthreads();
  if (warp % splits_cta != 0) return;
#pragma unroll
  for (int i = 0; i < 4 * kM; ++i) {
    float s = 0.f;
    for (int j = 0; j < splits_cta; ++j) s += red[warp + j][lane][i];
    // C: x as B, W rows g (, g + 8 from kWARows) and x rows 2t, 2t + 1; else x rows g, g + 8 of m16 tile i / 4
    constexpr bool kXB = kSlots == 1;                               // x is B up to 4 rows (W as A: 5, 6)
    if (!kWA && kSlots == 1 && i >= 2) continue;                    // up to 4 rows C's rows r + 8 are any bits
    const int b = kXB ? 2 * (lane & 3) + (i & 1) : (lane >> 2) + 8 * ((i % 4) >> 1) + 16 * (i / 4);
    const int64_t out_row = row0 + (kXB ? (lane >> 2) + 8 * (i >> 1) : 2 * (lane & 3) + (i & 1));
    if (b < nx && out_row < a.rows) {
      if (part) part[(blockIdx.y * static_cast<int64_t>(nx) + b) * a.rows + out_row] = s;
      else y[b * a.rows + out_row] = from_float<kBf16>(s);
    }
  }
}

// mma_kernel's CTAs an SM in CTAs of kMmaWarpsWide (cut_k): W as A 2 (126 registers), else
// kMmaCtasWide (80 registers, as the 1-row kernel's 6 CTAs of 4; from 7 rows the build of the rule
// below that spills 64 bytes).
template <int kSlots, bool kWA>
constexpr int kMmaCtasW6 = kWA ? 2 : kMmaCtasWide;

template <bool kBf16, int kSlots, bool kWA = false, bool kCursor = false>
void launch(const FrArrays& a, const uint4* x, int nx, uint16_t* y, const at::Tensor& like, cudaStream_t stream) {
  const CutK cut = cut_k(a);
  const int64_t row_units = kWA ? (a.rows + 15) / 16 : (a.rows + 7) / 8;   // a warp's rows each
  const int64_t ctas = (row_units + cut.warps / cut.per_cta - 1) / (cut.warps / cut.per_cta);
  at::Tensor part;
  float* pp = part_sums(part, cut.parts, nx, a.rows, like);
  auto kernel = mma_kernel<kBf16, kSlots, kWA, kCursor>;
  int per_sm = kMmaCtas<kSlots, kWA>, build = 0;                    // build: the carveout's (base, an SM more, CTAs of 6)
  if (cut.warps == kMmaWarpsWide) {
    per_sm = kMmaCtasW6<kSlots, kWA>, build = 2;
    kernel = mma_kernel<kBf16, kSlots, kWA, kCursor, kMmaCtasW6<kSlots, kWA>, kMmaWarpsWide>;
  } else if constexpr (!kWA) {                                       // one CTA an SM more where that saves a wave
    constexpr int kMore = kMmaCtas<kSlots, kWA> + 1;
    const int64_t grid = ctas * cut.parts;
    if (waves(grid, kMore) < waves(grid, kMmaCtas<kSlots, kWA>))
      kernel = mma_kernel<kBf16, kSlots, kWA, kCursor, kMore>, per_sm = kMore, build = 1;
  }
  static std::atomic<int32_t> carved[3][64] = {};
  per_device(carved[build], [&](int dev) { return set_carveout(reinterpret_cast<const void*>(kernel), per_sm, dev); });
  launch_pdl(kernel, dim3(static_cast<unsigned>(ctas), cut.parts), dim3(32 * cut.warps), stream, a, x, nx, cut.per_cta, y, pp);
  if (cut.parts > 1) launch_sum(kBf16, pp, nx * a.rows, 1, cut.parts, y, stream);
}

// Rows of x from which mma_kernel takes x permuted as A (kSlots 2: an m16 tile, the rows past nx
// zeros) and 8 rows of W a warp, as it did from 9 rows, rather than W as A (16 rows of W a warp,
// walk_block_w16), as it did from 5 to 8 until 2026-11-30 (kWARows). W as A costs more with each
// row and runs grids of half as many warps, while x as A costs as much at 5 as at 16 rows. The
// served step (8 layers, the Triton kernels between the linears, PDL; over decoded mode's) at 5 / 6
// / 7 / 8 rows: the 7B's 1.133 / 1.164 / 1.193 / 1.218 -> 1.120 / 1.120 / 1.124 / 1.117, the 8B's
// 1.070 / 1.098 / 1.116 / 1.133 -> 1.116 / 1.117 / 1.120 / 1.116 (H200, 2026-11-30,
// bench/experiments/step_rows.py, two rounds). Taken by the matrix (x as A where its grid had no
// more waves than W as A's) it lost: a step that mixes the two kernels ran slower than either (the
// 8B's at 8 rows 1.150-1.160 against 1.129-1.136 with W as A for all). The sums are the same bits
// either way.
constexpr int kSlotRows = kFrSlotRows;

// Up to 16 rows: the kernel's slots (8 rows of x each), 1 or 2.
int slots_for(int nx) { return nx < kSlotRows ? 1 : 2; }

template <bool kBf16>
void launch_slots(const FrArrays& a, const uint4* x, int nx, uint16_t* y, const at::Tensor& like, cudaStream_t stream) {
  if (slots_for(nx) == 2) return launch<kBf16, 2, false, true>(a, x, nx, y, like, stream);
  if (nx >= kWARows) return launch<kBf16, 1, true>(a, x, nx, y, like, stream);
  if (nx <= kCursorRows) return launch<kBf16, 1, false, true>(a, x, nx, y, like, stream);
  return launch<kBf16, 1>(a, x, nx, y, like, stream);
}

}  // namespace

void launch_mma(const FrArrays& a, const at::Tensor& x, const at::Tensor& y, cudaStream_t stream, bool permuted) {
  TORCH_CHECK(a.rows * a.groups <= UINT32_MAX, "fixedrate linear: ", a.rows * a.groups,
              " groups of 32 weights in one matrix, over the fused kernel's 2^32");   // GroupCursor's index
  const int nx = static_cast<int>(y.size(0));
  const at::Tensor xa = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 ? x : x.clone();   // 16-byte loads
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (nx >= kFrWideRows) return launch_wide_mma(a, xa, permuted, nx, yp, stream);
  at::Tensor xp = xa;
  if (const int mt = slots_for(nx) / 2; mt && !permuted) {        // kSlots > 1: permuted, mt m16 tiles
    const int64_t units = a.tiles * kXQuads * mt * 32;
    xp = at::empty({units * 8}, x.options());
    launch_pdl(permute_x_kernel, dim3(static_cast<unsigned>((units + 255) / 256)), dim3(256), stream,
               reinterpret_cast<const uint32_t*>(xa.data_ptr()), a.groups, nx, mt, units, reinterpret_cast<uint4*>(xp.data_ptr()));
  }
  const auto* xw = reinterpret_cast<const uint4*>(xp.data_ptr());
  (bf16 ? launch_slots<true> : launch_slots<false>)(a, xw, nx, yp, x, stream);
}

}  // namespace wcodec
