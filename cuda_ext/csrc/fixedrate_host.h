// Host-side pieces of the fixed-rate ops shared by the CPU twin and the CUDA ops: argument checks
// and the escape starts (an exclusive prefix sum over blocks, done with ATen on either device).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace wcodec {

struct FrShape {
  int64_t rows, cols, groups, tiles, blocks;
};

// TORCH_CHECKs that the six arrays of one fixed-rate weight agree with each other and with cols.
FrShape fr_check(const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& base,
                 const at::Tensor& esc, const at::Tensor& esc_start, int64_t cols);

// counts: int32 [rows, groups] escapes per group -> esc_start int32 [rows, blocks] and the total.
std::tuple<at::Tensor, int64_t> fr_escape_starts(const at::Tensor& counts, int64_t blocks);

// The arrays of an encode of w [rows, cols] (16-bit), allocated on w's device; esc is allocated later.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fr_alloc(const at::Tensor& w);

}  // namespace wcodec
