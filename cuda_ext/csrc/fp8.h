// float8_e4m3fn weights in a 16-bit matmul (W8A16): the steps the CPU twin (fp8_linear.cpp) and the
// kernel (fp8_linear.cu) share. Read me first:
// * An e4m3 byte b = s | e (4 bits, bias 7) | m (3 bits). Its magnitude bits (b & 0x7F) shifted
//   left 4 under its sign are the bf16 word of b's value times 2^-120, exactly, for normals and
//   subnormals alike (bf16's exponent bias is 127 = 7 + 120, its subnormals' scale 2^-126 = 2^-6 *
//   2^-120, and 3 mantissa bits fit in 7). One bf16 multiply by 2^120 (exact: the product is an
//   e4m3 value) gives the weight.
// * 0x7F and 0xFF are e4m3fn's NaN; these steps make them 480 and -480. The loader never hands the
//   kernel a matrix that holds them (service/model/fp8_linear.py keeps such a weight dequantized).
// * Scales: y[m, n] = sum over blocks kb of K of scale[n / bo, kb] * (sum over k in kb of x[m, k] *
//   w[n, k]), float32, rounded once. A grid of one column (per tensor, per row: bi >= K) applies its
//   scale after the sum; blocks of K are kFp8Step columns (every FP8 block checkpoint's 128).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace wcodec {

constexpr int kFp8Step = 128;                  // W's columns a warp takes a step; block scales' width
constexpr int kFp8MaxRows = 64;                // rows of x the fused op takes
constexpr uint16_t kBf16Two120 = 0x7B80;       // 2^120 in bf16: exponent 127 + 120

// Two e4m3 bytes placed by prmt (fp8_linear.cu) as the 32-bit word
//    31 ..... 24  23 ...... 16  15 ...... 8  7 ....... 0
//    [   b1    ]  [ sign(b0) x8 ] [   b0   ]  [ sign(b1) x8 ]
// rotated right by 4 and masked with 0x87F087F0: the pair of bf16 words (b0 low) of b0 and b1 times 2^-120:
//    31  30 27  26 .. 20  19 16  15  14 11  10 ... 4  3  0
//    s1  0000   mag1      0000   s0  0000   mag0      0000
#if defined(__CUDACC__)
#define WC_FP8_HD __host__ __device__ __forceinline__
#else
#define WC_FP8_HD inline
#endif

WC_FP8_HD uint16_t fp8_scaled_word(uint8_t b) {             // the host's step, one weight: b * 2^-120 as bf16
  return static_cast<uint16_t>((b & 0x80) << 8 | (b & 0x7F) << 4);
}

// W [N, K] e4m3 bytes and its scale grid [ceil(N / bo), ceil(K / bi)] of float32 on one device; with
// x [M, K] bf16 there too (fp8_linear.cpp): TORCH_CHECKs a caller's mistakes.
void fp8_check_grid(const at::Tensor& w, const at::Tensor& scale, int64_t bo, int64_t bi);
void fp8_check_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t bo, int64_t bi);

}  // namespace wcodec
