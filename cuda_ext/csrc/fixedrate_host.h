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

// plane, lo, hi and tile of an encode of w [rows, cols] (16-bit), allocated on w's device.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fr_alloc(const at::Tensor& w);

}  // namespace wcodec
