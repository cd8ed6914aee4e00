// The int8 predictive codec's decoder steps for the C++ twin (decode_quant.cpp) and the CUDA kernel
// (decode_quant.cu): codec/int8.py is the specification.
//   one tile of 16 x 16 (partial at the right and bottom edges), positions in raster order:
//     p = predict(mode, left, top, top-left)      the tile's own decoded neighbours, 0 outside it
//     q = (r + p) wrapped to [-128, 127]
//     y = float32(q) * scale[row]                 (one multiply, never fused; x86 NaN rules)
// A mode byte >= 5 decodes as `none`, as the reference does; the host refuses such planes first.
#pragma once
#include <cstdint>

#include "gguf_blocks.h"

namespace wcodec {
namespace int8 {

constexpr int kTile = 16;
constexpr int kModes = 5;                            // none, left, top, average, planar

GB_HD int predict(int mode, int left, int top, int top_left) {
  switch (mode) {
    case 1: return left;
    case 2: return top;
    case 3: return (left + top) >> 1;               // floor, as NumPy's >> on int16
    case 4: {
      const int p = left + top - top_left;
      return p < -127 ? -127 : (p > 127 ? 127 : p);
    }
    default: return 0;
  }
}

#ifdef __CUDA_ARCH__
#define I8_UNROLL _Pragma("unroll")
#else
#define I8_UNROLL
#endif

// The residual bytes of one tile row (w <= kTile of them; the rest read as 0). A GPU thread
// reads an aligned full row as one 16-byte load.
GB_HD void load_row(const uint8_t* r, int w, int (&out)[kTile]) {
#ifdef __CUDA_ARCH__
  if (w == kTile && (reinterpret_cast<uintptr_t>(r) & 15u) == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(r);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    I8_UNROLL
    for (int j = 0; j < kTile; ++j) out[j] = (words[j >> 2] >> (8 * (j & 3))) & 0xFF;
    return;
  }
#endif
  I8_UNROLL
  for (int j = 0; j < kTile; ++j) out[j] = j < w ? r[j] : 0;
}

// Tile t (row-major over tiles) of an int8-coded [rows, cols] weight. Each decoded tile row goes
// to store.row(i, y, w): elements [i, i + w) of the output are y[0 .. w).
template <typename Store>
GB_HD void reconstruct_tile(const uint8_t* resid, const uint8_t* modes, const float* scales, int64_t rows,
                            int64_t cols, int64_t t, const Store& store) {
  const int64_t tiles_per_row = (cols + kTile - 1) / kTile;
  const int64_t r0 = (t / tiles_per_row) * kTile, c0 = (t % tiles_per_row) * kTile;
  const int mode = modes[t];
  const int h = rows - r0 < kTile ? static_cast<int>(rows - r0) : kTile;
  const int w = cols - c0 < kTile ? static_cast<int>(cols - c0) : kTile;
  int prev[kTile], cur[kTile], r[kTile];            // the row above, this row, its residuals
  float y[kTile];
  I8_UNROLL
  for (int j = 0; j < kTile; ++j) prev[j] = 0, cur[j] = 0, y[j] = 0.0f;
  for (int i = 0; i < h; ++i) {
    const int64_t at = (r0 + i) * cols + c0;
    const float s = scales[r0 + i];
    load_row(resid + at, w, r);
    I8_UNROLL
    for (int j = 0; j < kTile; ++j) {
      if (j >= w) continue;
      const int left = j ? cur[j - 1] : 0, top = i ? prev[j] : 0, top_left = (i && j) ? prev[j - 1] : 0;
      cur[j] = ((r[j] + predict(mode, left, top, top_left) + 128) & 0xFF) - 128;   // q = (r + p) wrapped
      y[j] = gguf::f32_mul(static_cast<float>(cur[j]), s);                         // y = float32(q) * scale
    }
    store.row(at, y, w);
    I8_UNROLL
    for (int j = 0; j < kTile; ++j) prev[j] = cur[j];
  }
}

}  // namespace int8
}  // namespace wcodec
