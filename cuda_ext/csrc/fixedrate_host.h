// Host-side pieces of the fixed-rate ops shared by the CPU twin and the CUDA ops: argument checks
// and the escape starts (an exclusive prefix sum over blocks of the tiles' counts, done with ATen on either device).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace wcodec {

struct FrShape {
  int64_t rows, cols, groups, tiles, blocks;
};

// TORCH_CHECKs that the six arrays of one fixed-rate weight agree with each other and with cols.
FrShape fr_check(const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& tile,
                 const at::Tensor& esc, const at::Tensor& esc_start, int64_t cols);

// tile: int16 [rows, tiles] (escapes in bits 8..15) -> esc_start int32 [rows, blocks] and the total.
std::tuple<at::Tensor, int64_t> fr_escape_starts(const at::Tensor& tile, int64_t blocks);

// The tensor-core kernels' x layouts (fixedrate_mma.cu, fixedrate_wide.cu). From kFrSlotRows rows of x the kernel reads x
// permuted (permute_x_kernel's layout: one m16 tile, 16 rows), from kFrWideRows rows wide_kernel's
// (permute_xb_kernel's: n8 tiles, 8 rows each); below, x in place. A caller may hand the op x already
// in that layout (fixedrate_linear_permuted): [fr_permuted_rows(rows), tiles * 128] of x's dtype, the
// rows past x's and the columns past cols zeros, element (r, c) at fr_permuted_at(rows, r, c).
constexpr int kFrSlotRows = 7;
constexpr int kFrWideRows = 17;

// Rows of the permuted buffer for `rows` rows of x (kFrSlotRows .. 64): 16, or whole n8 tiles.
inline int64_t fr_permuted_rows(int64_t rows) { return rows < kFrWideRows ? 16 : (rows + 7) / 8 * 8; }

// The element index of x's (r, c) (a 16-bit element) in the permuted buffer for `rows` rows.
inline int64_t fr_permuted_at(int64_t rows, int64_t r, int64_t c) {
  const int64_t pw = c / 2, gr = pw / 16, pp = pw % 16, tile = gr / 4, t = gr % 4, lane = (r % 8) * 4 + t;
  if (rows < kFrWideRows)                                    // [tiles][8 q][32 lanes] of {r p, r+8 p, r p+1, r+8 p+1}
    return 2 * (4 * ((tile * 8 + pp / 2) * 32 + lane) + (pp % 2) * 2 + r / 8) + c % 2;
  const int64_t nt = (rows + 7) / 8;                        // [tiles][8 q][nt j][32 lanes] of {p, p+1} of row 8j + r%8
  return 2 * (2 * (((tile * 8 + pp / 2) * nt + r / 8) * 32 + lane) + pp % 2) + c % 2;
}

// fr_check, then TORCH_CHECKs x of fixedrate_linear_permuted against the weight's shape.
FrShape fr_check_permuted(const at::Tensor& xp, int64_t rows, const at::Tensor& plane, const at::Tensor& lo,
                          const at::Tensor& hi, const at::Tensor& tile, const at::Tensor& esc, const at::Tensor& esc_start,
                          int64_t cols);

// plane, lo, hi and tile of an encode of w [rows, cols] (16-bit), allocated on w's device.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fr_alloc(const at::Tensor& w);

}  // namespace wcodec
