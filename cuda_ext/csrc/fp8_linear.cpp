// The W8A16 matmul's CPU twin and schemas (fp8.h; the kernel is fp8_linear.cu):
//   - fp8_to_bf16: e4m3 bytes -> their bf16 words by fp8.h's steps (the kernel's decode, written out:
//     the bit-exact test's entry point);
//   - fp8_dequantize: W times its scales, rounded once to bf16 (a prompt's matmul is cuBLAS's on it);
//   - fp8_linear: y = x W^T with W's e4m3 bytes and a float32 grid of scales, float32 sums by blocks
//     of kFp8Step columns, each block's sum times its scale, rounded once. Only the order of the
//     float32 sums inside a block differs from the kernel's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "fp8.h"

namespace wcodec {
namespace {

uint16_t bf16_bits(float f) {                                       // exact here: f is an e4m3 value
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

at::Tensor fp8_to_bf16_cpu(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "fp8_to_bf16: w must be contiguous uint8 (e4m3 bytes)");
  at::Tensor out = at::empty(w.sizes(), w.options().dtype(at::kBFloat16));
  const uint8_t* b = w.data_ptr<uint8_t>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float two120 = bf16_value(kBf16Two120);
  for (int64_t i = 0; i < w.numel(); ++i) o[i] = bf16_bits(bf16_value(fp8_scaled_word(b[i])) * two120);
  return out;
}

at::Tensor fp8_linear_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t block_rows,
                          int64_t block_cols) {
  fp8_check_args(x, w, scale, block_rows, block_cols);
  const int64_t n = w.size(0), k = w.size(1);
  const at::Tensor wf = fp8_to_bf16_cpu(w.contiguous()).to(at::kFloat);                        // [N, K], exact
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor rows = scale.repeat_interleave(block_rows, 0).narrow(0, 0, n);               // [N, blocks]
  at::Tensor acc = at::zeros({x.size(0), n}, x.options().dtype(at::kFloat));
  const int64_t step = scale.size(1) == 1 ? k : kFp8Step;
  for (int64_t kb = 0; kb * step < k; ++kb) {
    const int64_t c = std::min(step, k - kb * step);
    const at::Tensor part = at::matmul(xf.narrow(1, kb * step, c), wf.narrow(1, kb * step, c).t());   // [M, N]
    acc.add_(part * rows.select(1, kb).unsqueeze(0));
  }
  return acc.to(at::kBFloat16);
}

// W times its scales rounded once to bf16 (service/model/fp8.py's dequantization): float32(w) * scale.
at::Tensor fp8_dequantize_cpu(const at::Tensor& w, const at::Tensor& scale, int64_t block_rows, int64_t block_cols) {
  fp8_check_grid(w, scale, block_rows, block_cols);
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor cols = scale.repeat_interleave(block_rows, 0).narrow(0, 0, n);                     // [N, blocks]
  if (scale.size(1) > 1) cols = cols.repeat_interleave(block_cols, 1).narrow(1, 0, k);           // [N, K]
  return (fp8_to_bf16_cpu(w.contiguous()).to(at::kFloat) * cols).to(at::kBFloat16);
}

}  // namespace

void fp8_check_grid(const at::Tensor& w, const at::Tensor& scale, int64_t bo, int64_t bi) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, "fp8: W must be uint8 [N, K] (its e4m3 bytes)");
  TORCH_CHECK(scale.device() == w.device(), "fp8: W and its scale on one device");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.is_contiguous(),
              "fp8: scale must be a contiguous float32 grid [ceil(N / block_rows), ceil(K / block_cols)]");
  TORCH_CHECK(bo >= 1 && bi >= 1 && scale.size(0) == (n + bo - 1) / bo && scale.size(1) == (k + bi - 1) / bi,
              "fp8: scale grid ", scale.sizes(), " does not cut W [", n, ", ", k, "] into blocks of [", bo, ", ", bi, "]");
}

void fp8_check_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t bo, int64_t bi) {
  fp8_check_grid(w, scale, bo, bi);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "fp8_linear: x [M, K] and W [N, K], got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "fp8_linear: x must be bfloat16");
  TORCH_CHECK(x.device() == w.device(), "fp8_linear: x and W on one device");
  TORCH_CHECK(scale.size(1) == 1 || bi == kFp8Step, "fp8_linear: blocks of ", bi, " columns (", kFp8Step,
              " or the whole row)");
}

TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("fp8_to_bf16(Tensor w) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, int block_rows, int block_cols) -> Tensor");
  m.def("fp8_dequantize(Tensor w, Tensor scale, int block_rows, int block_cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("fp8_to_bf16", &fp8_to_bf16_cpu);
  m.impl("fp8_linear", &fp8_linear_cpu);
  m.impl("fp8_dequantize", &fp8_dequantize_cpu);
}

}  // namespace wcodec
