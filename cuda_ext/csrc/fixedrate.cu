// The fixed-rate GPU form's CUDA twin (codec/fixedrate.py; the CPU twin is fixedrate.cpp):
//   - fixedrate_encode: the transcoder's last step, bf16/fp16 words on the GPU -> the form (a thread
//     a tile; a second pass writes the escape entries once their starts are known);
//   - fixedrate_decode: the form -> words (the scratch of the > 64-row path, and the debug entry
//     point that proves the kernel's decode bit-exact);
//   - fixedrate_linear: y = x W^T for x of 1..64 rows, W decoded in registers (fixedrate_gemv.cuh).
// A warp always holds the 32 groups of one escape block, lane l the l-th: a tile's first entry is
// the block's start plus a warp prefix sum of the tiles' counts. Everything launches on the current stream; no host syncs
// except the encode's escape total (load time, never inside a captured graph).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "fixedrate.h"
#include "fixedrate_gemv.cuh"
#include "fixedrate_host.h"

namespace wcodec {
namespace {

constexpr int kEncodeThreads = 128;

// decode: one warp per (row, escape block), 32 words a lane. The words go out through shared
// memory so that each of a warp's 4 stores writes 512 consecutive bytes (16-byte chunk c of the
// warp's 2 KB at chunk c ^ (c / 8 % 8): conflict-free both ways), where cols allows.
__global__ void __launch_bounds__(32 * kFrWarps) decode_kernel(FrArrays a, int64_t cols, uint16_t* out) {
  const int64_t wid = blockIdx.x * static_cast<int64_t>(kFrWarps) + threadIdx.x / 32;
  if (wid >= a.rows * a.blocks) return;
  const int64_t row = wid / a.blocks, blk = wid % a.blocks;
  const int lane = threadIdx.x & 31;
  __shared__ uint4 stage[kFrWarps][32 * 4];                          // a warp's 2 KB: slots, then words
  uint4* chunks = stage[threadIdx.x / 32];
  uint32_t f[8];
  const FrGroup t = block_fields(a, row, blk, a.esc_start[row * a.blocks + blk],
                                 *reinterpret_cast<uint4(*)[2]>(chunks + 2 * lane), f);
  uint32_t w[16];
#pragma unroll
  for (int q = 0; q < 8; ++q) join4(plane_word(t, q), f[q], w[2 * q], w[2 * q + 1]);
  const int64_t c0 = blk * kFrBlockGroups * kFrGroup;               // the block's first column
  uint16_t* o = out + row * cols + c0;
  if (cols % 8 == 0 && c0 + kFrBlockGroups * kFrGroup <= cols) {
    auto at = [](int c) { return c ^ (c >> 3 & 7); };
    __syncwarp();                                                   // the patch's reads of the slots are done
#pragma unroll
    for (int v = 0; v < 4; ++v) chunks[at(4 * lane + v)] = make_uint4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
    __syncwarp();
#pragma unroll
    for (int v = 0; v < 4; ++v) reinterpret_cast<uint4*>(o)[32 * v + lane] = chunks[at(32 * v + lane)];
    return;
  }
  const int64_t l0 = lane * kFrGroup;
#pragma unroll
  for (int i = 0; i < kFrGroup; ++i)
    if (c0 + l0 + i < cols) o[l0 + i] = static_cast<uint16_t>(w[i / 2] >> (16 * (i & 1)));
}

__global__ void encode_tiles_kernel(const uint16_t* __restrict__ w, int64_t rows, int64_t cols, int64_t groups,
                                    int64_t tiles, uint8_t* plane, uint32_t* lo, uint32_t* hi, uint16_t* tile) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= rows * tiles) return;
  const int64_t r = t / tiles, g = r * groups + (t % tiles) * kFrTileGroups, c0 = (t % tiles) * kFrTile;
  const int64_t n = min(static_cast<int64_t>(kFrTile), cols - c0);
  uint16_t words[kFrTile];
  for (int64_t i = 0; i < n; ++i) words[i] = w[r * cols + c0 + i];
  fr_encode_tile(words, n, static_cast<int>(groups - (t % tiles) * kFrTileGroups), plane + g * kFrGroup,
                 lo + g * kFrLoWords, hi + g, tile + t);
}

// The entries of one tile, from its first (its block's start plus the block's earlier counts).
__global__ void encode_escapes_kernel(const uint16_t* __restrict__ w, int64_t rows, int64_t cols, int64_t tiles,
                                      int64_t blocks, const uint16_t* tile, const int32_t* esc_start, uint16_t* esc) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= rows * tiles || (tile[t] >> 8) == 0) return;
  const int64_t r = t / tiles, s = t % tiles, c0 = s * kFrTile;
  fr_tile_entries(w + r * cols + c0, min(static_cast<int64_t>(kFrTile), cols - c0), tile[t] & 0xFF,
                  esc + fr_tile_start(esc_start, tile, r, tiles, blocks, s));
}

std::vector<at::Tensor> encode_cuda(const at::Tensor& w_in) {
  const c10::cuda::CUDAGuard guard(w_in.device());
  auto [plane, lo, hi, tile] = fr_alloc(w_in);
  const int64_t rows = w_in.size(0), cols = w_in.size(1), groups = hi.size(1), tiles = tile.size(1);
  const int64_t blocks = (groups + kFrBlockGroups - 1) / kFrBlockGroups, n = rows * tiles;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* w = reinterpret_cast<const uint16_t*>(w_in.data_ptr());
  auto* tw = reinterpret_cast<uint16_t*>(tile.data_ptr<int16_t>());
  if (n == 0) return {plane, lo, hi, tile, at::empty({0}, tile.options()), at::zeros({rows, blocks}, lo.options())};
  const unsigned grid = static_cast<unsigned>((n + kEncodeThreads - 1) / kEncodeThreads);
  encode_tiles_kernel<<<grid, kEncodeThreads, 0, stream>>>(w, rows, cols, groups, tiles, plane.data_ptr<uint8_t>(),
                                                           reinterpret_cast<uint32_t*>(lo.data_ptr<int32_t>()),
                                                           reinterpret_cast<uint32_t*>(hi.data_ptr<int32_t>()), tw);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto [esc_start, total] = fr_escape_starts(tile, blocks);
  auto esc = at::empty({total}, tile.options());
  encode_escapes_kernel<<<grid, kEncodeThreads, 0, stream>>>(w, rows, cols, tiles, blocks, tw, esc_start.data_ptr<int32_t>(),
                                                             reinterpret_cast<uint16_t*>(esc.data_ptr<int16_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));   // the form complete: the fused kernels read W before their PDL wait
  return {plane, lo, hi, tile, esc, esc_start};
}

FrArrays arrays(const FrShape& s, const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi,
                const at::Tensor& tile, const at::Tensor& esc, const at::Tensor& esc_start) {
  return {plane.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(lo.data_ptr<int32_t>()),
          reinterpret_cast<const uint32_t*>(hi.data_ptr<int32_t>()), reinterpret_cast<const uint16_t*>(tile.data_ptr<int16_t>()),
          reinterpret_cast<const uint16_t*>(esc.data_ptr<int16_t>()), esc.numel(), esc_start.data_ptr<int32_t>(), s.rows,
          s.groups, s.tiles, s.blocks};
}

void decode_cuda(const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& tile,
                 const at::Tensor& esc, const at::Tensor& esc_start, int64_t cols, const at::Tensor& out) {
  const FrShape s = fr_check(plane, lo, hi, tile, esc, esc_start, cols);
  TORCH_CHECK(out.element_size() == 2 && out.is_contiguous() && out.numel() == s.rows * cols && out.device() == plane.device(),
              "out: contiguous 16-bit [rows, cols] on the arrays' device");
  const c10::cuda::CUDAGuard guard(plane.device());
  const int64_t warps = s.rows * s.blocks;
  if (warps == 0) return;
  const unsigned grid = static_cast<unsigned>((warps + kFrWarps - 1) / kFrWarps);
  decode_kernel<<<grid, 32 * kFrWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
      arrays(s, plane, lo, hi, tile, esc, esc_start), cols, reinterpret_cast<uint16_t*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi,
                       const at::Tensor& tile, const at::Tensor& esc, const at::Tensor& esc_start, int64_t cols,
                       int64_t kernel) {
  const FrShape s = fr_check(plane, lo, hi, tile, esc, esc_start, cols);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == s.groups * kFrGroup && x.is_contiguous() && x.device() == plane.device(),
              "x: contiguous [rows, groups*32] (zero-padded past cols) on the arrays' device");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kFrMaxRows, "the fused op takes 1 to 64 rows of x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "x: bfloat16 or float16");
  const c10::cuda::CUDAGuard guard(plane.device());
  auto y = at::empty({x.size(0), s.rows}, x.options());
  TORCH_CHECK(kernel == kFrKernelMma || kernel == kFrKernelSimt, "kernel: 0 (tensor cores) or 1 (CUDA cores)");
  TORCH_CHECK(kernel == kFrKernelMma || x.size(0) <= kFrMaxSimtRows, "the CUDA-core kernel takes 1 to 16 rows of x");
  if (s.rows > 0 && kernel == kFrKernelMma)
    launch_mma(arrays(s, plane, lo, hi, tile, esc, esc_start), x, y, c10::cuda::getCurrentCUDAStream());
  else if (s.rows > 0)
    launch_gemv(arrays(s, plane, lo, hi, tile, esc, esc_start), x, y, c10::cuda::getCurrentCUDAStream());
  return y;
}

at::Tensor linear_permuted_cuda(const at::Tensor& xp, int64_t rows, const at::Tensor& plane, const at::Tensor& lo,
                                const at::Tensor& hi, const at::Tensor& tile, const at::Tensor& esc,
                                const at::Tensor& esc_start, int64_t cols) {
  const FrShape s = fr_check_permuted(xp, rows, plane, lo, hi, tile, esc, esc_start, cols);
  const c10::cuda::CUDAGuard guard(plane.device());
  auto y = at::empty({rows, s.rows}, xp.options());
  if (s.rows > 0) launch_mma(arrays(s, plane, lo, hi, tile, esc, esc_start), xp, y, c10::cuda::getCurrentCUDAStream(), true);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) {
  m.impl("fixedrate_encode", &encode_cuda);
  m.impl("fixedrate_decode", &decode_cuda);
  m.impl("fixedrate_linear", &linear_cuda);
  m.impl("fixedrate_linear_permuted", &linear_permuted_cuda);
}

}  // namespace wcodec
