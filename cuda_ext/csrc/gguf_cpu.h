// dequantize_blocks on the CPU (decode_quant.cpp): the loops around gguf_blocks.h's arithmetic,
// chosen once per call (never per weight): the block type and the output dtype are template
// arguments, the planes are read where they lie.
//   scalar   (no AVX-512, or WCODEC_CPU_SIMD=0): join a block's planes (gguf_blocks.join), the
//            block's weights by gguf_blocks.h, cast one by one -- the specification itself;
//   AVX-512  (gguf_avx512.h): 16 weights a vector from the planes, the same float32 operations.
// Both give the bits of gguf's NumPy dequantizer followed by torch's CPU cast; a block whose
// weights include a NaN is redone by the scalar path unless the output is bf16 (every NaN -> 0xFFFF),
// because a vector unit may swap two NaN operands of an add, which changes which payload survives.
#pragma once
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace wcodec {
namespace gguf {

// One tensor's planes, in codec/gguf_blocks.py order: plane k of block b is p[k] + b * width_k.
struct Planes {
  const uint8_t* p[kMaxPlanes];
};

// The output dtypes: cast is torch's CPU cast of one float32 (gguf_blocks.h).
struct OutF32 {
  using T = float;
  static constexpr bool kNanFree = false;           // a NaN's bits are stored as they are
  static T cast(float v) { return v; }
};
struct OutBF16 {
  using T = uint16_t;
  static constexpr bool kNanFree = true;            // every NaN -> 0xFFFF
  static T cast(float v) { return f32_to_bf16(v); }
};
struct OutF16 {
  using T = uint16_t;
  static constexpr bool kNanFree = false;           // sign and top payload bits kept
  static T cast(float v) { return f32_to_f16(v); }
};

template <int Code>
struct TypeCode {
  static constexpr int kCode = Code;
};

// f(TypeCode<code>{}) for a GGML type this file dequantizes; false for any other.
template <typename F>
bool with_block_type(int64_t code, F&& f) {
  switch (code) {
    case 2: f(TypeCode<2>{}); return true;
    case 3: f(TypeCode<3>{}); return true;
    case 6: f(TypeCode<6>{}); return true;
    case 7: f(TypeCode<7>{}); return true;
    case 8: f(TypeCode<8>{}); return true;
    case 12: f(TypeCode<12>{}); return true;
    case 13: f(TypeCode<13>{}); return true;
    case 14: f(TypeCode<14>{}); return true;
    default: return false;
  }
}

// Block b: its planes joined into the ggml byte layout, dequantized, cast into out[0, block_size).
template <int Code, typename Out>
inline void scalar_block(const BlockLayout& l, const Planes& planes, int64_t b, typename Out::T* out) {
  uint8_t block[kMaxTypeSize];
  float y[kMaxBlockSize];
  for (int k = 0; k < l.n_planes; ++k)
    memcpy(block + l.planes[k].start, planes.p[k] + b * l.planes[k].width, l.planes[k].width);
  dequantize_block(Code, block, y);                  // Code is a constant: the switch folds away
  for (int j = 0; j < l.block_size; ++j) out[j] = Out::cast(y[j]);
}

// Blocks [b0, b1) into out (element 0 of block 0 at out).
template <int Code, typename Out>
void scalar_range(const BlockLayout& l, const Planes& planes, int64_t b0, int64_t b1, typename Out::T* out) {
  for (int64_t b = b0; b < b1; ++b) scalar_block<Code, Out>(l, planes, b, out + b * l.block_size);
}

}  // namespace gguf
}  // namespace wcodec
