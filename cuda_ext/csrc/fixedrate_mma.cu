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
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>

#include "fixedrate_gemv.cuh"
#include "fixedrate_host.h"

namespace wcodec {
namespace {

constexpr int kMmaWarps = 4;

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

// The waves that `ctas` CTAs take on the current device at `per_sm` an SM (its SMs asked once).
int64_t waves(int64_t ctas, int per_sm) {
  static std::atomic<int32_t> known[64] = {};
  const int64_t slots = per_sm * static_cast<int64_t>(per_device(known, [](int dev) {
                          int n = 0;
                          C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
                          return n;
                        }));
  return (ctas + slots - 1) / slots;
}

template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = 0, cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr, cfg.numAttrs = pdl_on() ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...));
}
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

// Escapes of the row in tiles 0 .. s0 - 1 of block blk: where a split of K starts inside a block,
// its running count starts past them.
__device__ __forceinline__ int escapes_before(const FrArrays& a, int64_t row, int64_t blk, int s0) {
  int n = 0;
  for (int s = 0; s < s0; ++s) n += __ldg(a.tile + row * a.tiles + blk * kFrBlockTiles + s) >> 8;
  return n;
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

// From kWideRows rows of x: W as A (16 rows of W a warp, walk_block_w16's decode) against up to 8
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
// two an SM (wide_warps). 6 and 7 n8 tiles fit 168 registers without spilling too, but their layers ran
// 1.54 -> 1.56 of cuBLAS's time at 48 rows; 8 spilled 88 bytes (1.73 -> 2.00 at 64); at 40 rows
// 1.47 -> 1.44 (the 8B layer) and 1.42 -> 1.39 (the 7B's). At 128 registers (16 warps an SM, 16-36
// bytes spilled) 17-32 rows ran 1.30-1.37 -> 1.65-1.93 (H200, 2026-11-30).
constexpr int kWideWarps = 8;
constexpr int kWideRows = kFrWideRows;

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

// A CTA: 8 warps (or wide_warps' 6 or 5) of 16 rows of W on range blockIdx.y of K, whose float32
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
// running count then starts past the block's earlier escapes). A CTA's 4 warps take `splits_cta` of
// them for kMmaWarps / splits_cta groups of 8 rows and sum through shared memory. A matrix with few
// rows (1024: 128 groups of 8, one CTA an SM) is cut further, gridDim.y CTAs a group of rows, each
// writing float32 partial sums to `part` [gridDim.y][nx][rows], which sum_parts adds in order.
// The cut depends on the matrix alone, not on nx: a row of x gets the same sums in any batch.
template <bool kBf16, int kSlots, bool kWA, bool kCursor, int kCtas = kMmaCtas<kSlots, kWA>>
__global__ void __launch_bounds__(32 * kMmaWarps, kCtas) mma_kernel(FrArrays a, const uint4* __restrict__ x,
                                                                                    int nx, int splits_cta,
                                                                                    uint16_t* __restrict__ y,
                                                                                    float* __restrict__ part) {
  static_assert(!kWA || kSlots == 1, "W as A takes up to kSlotRows - 1 rows of x");
  static_assert(!kCursor || !kWA, "cursors in walk_block (walk_block_w16 has its own)");
  constexpr int kM = (kSlots + 1) / 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = (blockIdx.x * static_cast<int64_t>(kMmaWarps / splits_cta) + warp / splits_cta) * (kWA ? 16 : 8);
  const int64_t row = min(row0 + (lane >> 2), a.rows - 1);
  __shared__ uint4 stage[kWA ? 2 : 1][32 * kMmaWarps][2];
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
  __shared__ float red[kMmaWarps][32][4 * kM];
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

// Splits of K (powers of two, at least kMinSplitTiles tiles each): in a CTA up to kMmaWarps while
// the warps are below kTargetWarps; across CTAs only while below kFewWarps, where the second
// launch (sum_parts, ~2 us) costs less than the idle SMs: k and v of an 8B layer at 16 rows
// 0.0167 -> 0.0112 ms each, but q and o (512 groups of rows) 0.019 -> 0.024 (H100, 2026-11-28).
constexpr int kMinSplitTiles = 2;
constexpr int kFewWarps = 2048;

// The matrix's cut of K (not nx's: a row of x gets the same sums in any batch): `splits` ranges,
// `per_cta` of them summed in one of mma_kernel's CTAs, `parts` such groups summed by sum_parts.
struct CutK {
  int splits, per_cta, parts;
};

CutK cut_k(const FrArrays& a) {
  const int64_t row_groups = (a.rows + 7) / 8;
  auto fits = [&](int64_t s) { return s * 2 * kMinSplitTiles <= a.tiles; };
  int64_t splits = 1;
  while (splits < kMmaWarps && row_groups * splits < kTargetWarps && fits(splits)) splits *= 2;
  while (row_groups * splits < kFewWarps && fits(splits)) splits *= 2;
  const int per_cta = static_cast<int>(std::min<int64_t>(splits, kMmaWarps));
  return {static_cast<int>(splits), per_cta, static_cast<int>(splits / per_cta)};
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

template <bool kBf16, int kSlots, bool kWA = false, bool kCursor = false>
void launch(const FrArrays& a, const uint4* x, int nx, uint16_t* y, const at::Tensor& like, cudaStream_t stream) {
  const CutK cut = cut_k(a);
  const int64_t row_units = kWA ? (a.rows + 15) / 16 : (a.rows + 7) / 8;   // a warp's rows each
  const int64_t ctas = (row_units + kMmaWarps / cut.per_cta - 1) / (kMmaWarps / cut.per_cta);
  at::Tensor part;
  float* pp = part_sums(part, cut.parts, nx, a.rows, like);
  auto kernel = mma_kernel<kBf16, kSlots, kWA, kCursor>;
  int per_sm = kMmaCtas<kSlots, kWA>;
  if constexpr (!kWA) {                                              // one CTA an SM more where that saves a wave
    constexpr int kMore = kMmaCtas<kSlots, kWA> + 1;
    const int64_t grid = ctas * cut.parts;
    if (waves(grid, kMore) < waves(grid, kMmaCtas<kSlots, kWA>))
      kernel = mma_kernel<kBf16, kSlots, kWA, kCursor, kMore>, per_sm = kMore;
  }
  static std::atomic<int32_t> carved[2][64] = {};                   // by the kernel taken (CTAs an SM more or not)
  per_device(carved[per_sm - kMmaCtas<kSlots, kWA>], [&](int dev) {
    return set_carveout(reinterpret_cast<const void*>(kernel), per_sm, dev);
  });
  launch_pdl(kernel, dim3(static_cast<unsigned>(ctas), cut.parts), dim3(32 * kMmaWarps), stream, a, x, nx, cut.per_cta, y, pp);
  if (cut.parts > 1) launch_sum(kBf16, pp, nx * a.rows, 1, cut.parts, y, stream);
}

// wide_kernel's warps a CTA for a matrix of `rows` cut into `splits` ranges of K: 8 (128 rows of W
// sharing each x word through L1) while the launch's CTAs of 8 warps all fit the device at once;
// past that, kWideWarpsMany where more of its warps fit an SM (two CTAs of 6 warps, 12 warps an SM,
// where the kernel needs at most 168 registers), so that the launch runs in fewer, fuller waves.
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

template <bool kBf16, int kNT>
int wide_warps(int64_t rows, int splits) {
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
  if (in(kWideWarps, per8) == 1 || per6 * kWideWarpsMany <= per8 * kWideWarps) return kWideWarps;
  return per5 && in(kWideWarpsFew, per5) == in(kWideWarpsMany, per6) ? kWideWarpsFew : kWideWarpsMany;
}

// kWideRows..64 rows: x permuted for wide_kernel, its ranges' sums added in mma_kernel's order.
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
  const CutK cut = cut_k(a);
  const int64_t units = a.tiles * 8 * kNT * 32;
  at::Tensor xq = x;
  if (!permuted) {
    xq = at::empty({units * 4}, x.options());
    launch_pdl(permute_xb_kernel, dim3(static_cast<unsigned>((units + 255) / 256)), dim3(256), stream,
               reinterpret_cast<const uint32_t*>(x.data_ptr()), a.groups, nx, kNT, units, reinterpret_cast<uint2*>(xq.data_ptr()));
  }
  at::Tensor part;
  float* pp = part_sums(part, cut.splits, nx, a.rows, x);
  const int w = wide_warps<kBf16, kNT>(a.rows, cut.splits);
  const int64_t ctas = wide_ctas(a.rows, w);
  launch_pdl(wide_kernel<kBf16, kNT>, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(cut.splits)),
             dim3(32 * w), stream, a, reinterpret_cast<const uint2*>(xq.data_ptr()), nx, y, pp);
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
  if (nx >= kWideRows) return (bf16 ? launch_wide_nt<true> : launch_wide_nt<false>)(a, xa, permuted, nx, yp, stream);
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
