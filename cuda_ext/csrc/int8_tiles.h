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

// Tile t (row-major over tiles) of an int8-coded [rows, cols] weight; store(i, y) writes element i.
template <typename Store>
GB_HD void reconstruct_tile(const uint8_t* resid, const uint8_t* modes, const float* scales, int64_t rows,
                            int64_t cols, int64_t t, Store& store) {
  const int64_t tiles_per_row = (cols + kTile - 1) / kTile;
  const int64_t r0 = (t / tiles_per_row) * kTile, c0 = (t % tiles_per_row) * kTile;
  const int mode = modes[t];
  const int h = rows - r0 < kTile ? static_cast<int>(rows - r0) : kTile;
  const int w = cols - c0 < kTile ? static_cast<int>(cols - c0) : kTile;
  int prev[kTile], cur[kTile];                      // the row above, this row
  for (int j = 0; j < kTile; ++j) prev[j] = 0;
  for (int i = 0; i < h; ++i) {
    const float s = scales[r0 + i];
    for (int j = 0; j < w; ++j) {
      const int left = j ? cur[j - 1] : 0, top = i ? prev[j] : 0, top_left = (i && j) ? prev[j - 1] : 0;
      const int64_t at = (r0 + i) * cols + c0 + j;
      cur[j] = ((resid[at] + predict(mode, left, top, top_left) + 128) & 0xFF) - 128;
      store(at, gguf::f32_mul(static_cast<float>(cur[j]), s));
    }
    for (int j = 0; j < w; ++j) prev[j] = cur[j];
  }
}

}  // namespace int8
}  // namespace wcodec
