// The C++ CPU twin of the quantized codecs' decoders, and their op schemas:
//   decode_bytes       byte planes coded alone in the exp-stream layout (ctx_bits 0): fp8 weights
//                      (codec float, whole byte) and the coded planes of GGUF blocks (codec gguf).
//                      The same steps as decode_float.cpp -- read the directory -> build the decode
//                      table -> decode lanes -- with the symbol itself as the output byte.
//   dequantize_blocks  GGUF planes -> blocks -> the compute dtype (gguf_blocks.h), bit-identical
//                      to gguf's NumPy dequantizer followed by torch's CPU cast.
//   reconstruct_int8   the int8 codec's residuals + tile modes -> q -> float32(q) * scale -> the
//                      compute dtype (codec/int8.py), bit-identical to the NumPy reference.
// Mirrors the NumPy reference in codec/ (floatcodec.decode_batch, codecs.GGUF.finish);
// decode_quant.cu is its CUDA twin. Compiled with -ffp-contract=off (setup.py, build.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "decode_common.h"
#include "gguf_avx512.h"
#include "gguf_blocks.h"
#include "gguf_cpu.h"
#include "int8_tiles.h"

namespace wcodec {

// ---- decode lanes: one segment, symbols straight to the output bytes ------------------------------
// One step: `lanes` lanes in lane order, each renormalising with the next word (branch-free: the
// word is loaded whether or not it is taken). `Checked` bounds every word read; the fast path runs
// only when a whole step cannot run past the segment's words.
template <bool Checked>
static inline void decode_byte_step(int lanes, const DecodeTable& t, const uint8_t* words, int64_t n_words,
                                    int64_t& used, uint32_t* x, uint8_t* out) {
  for (int l = 0; l < lanes; ++l) {
    out[l] = static_cast<uint8_t>(rans_step(t.sym, t.freq_cum, x[l]));         // x = D(x)
    const uint32_t need = x[l] < kRansL;                                        // renormalise: one word
    const uint32_t w = (!Checked || used < n_words) ? load_le<uint16_t>(words + 2 * used) : 0u;
    x[l] = need ? (x[l] << kRenormBits) | w : x[l];
    used += need;
  }
}

static int decode_byte_segment(const uint8_t* exp, const SegmentRef& ref, const DecodeTable& t, uint8_t* out) {
  const uint8_t* words = exp + ref.data + kStateBytes;
  uint32_t x[kLanes];
  for (int l = 0; l < kLanes; ++l) x[l] = load_le<uint32_t>(exp + ref.data + 4 * l);
  int64_t used = 0;
  for (int64_t j0 = 0; j0 < ref.symbols; j0 += kLanes) {
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, ref.symbols - j0));
    if (lanes == kLanes && used + kLanes <= ref.words)
      decode_byte_step<false>(kLanes, t, words, ref.words, used, x, out + j0);
    else
      decode_byte_step<true>(lanes, t, words, ref.words, used, x, out + j0);
  }
  if (used != ref.words) return kWords;
  for (int l = 0; l < kLanes; ++l)
    if (x[l] != kRansL) return kState;
  return kOk;
}

void check_data_and_desc(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs);  // decode_float.cpp

std::vector<TensorDesc> check_bytes_args(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                         const at::Tensor& status) {
  check_data_and_desc(data, desc, outputs);
  TORCH_CHECK(status.scalar_type() == at::kInt && status.is_contiguous() && status.device() == data.device(),
              "status must be a contiguous int32 tensor on data's device");
  std::vector<TensorDesc> out;
  int64_t statuses = 0;
  for (int64_t i = 0; i < desc.size(0); ++i) {
    const TensorDesc d = load_desc(desc.data_ptr<int64_t>() + i * kDescFields);
    const at::Tensor& o = outputs[i];
    TORCH_CHECK(o.element_size() == 1 && o.is_contiguous() && o.numel() == d.numel && d.numel > 0 &&
                    o.device() == data.device(),
                "output ", i, " must be a contiguous 1-byte tensor on data's device with numel ", d.numel);
    TORCH_CHECK(d.ctx_bits == 0 && d.hi_off == -1 && d.lo_off == -1 && d.dtype == kU8 && d.table_group >= 1 &&
                    d.first_segment >= 0,
                "row ", i, " is not a byte plane (ctx_bits 0, no hi/lo, dtype code ", int(kU8), ")");
    TORCH_CHECK(d.exp_off >= 0 && d.exp_len >= 0 && d.exp_off + d.exp_len <= data.numel(),
                "the stream of row ", i, " lies outside data");
    statuses = std::max(statuses, d.first_segment + segment_count(d));
    out.push_back(d);
  }
  TORCH_CHECK(status.numel() >= statuses, "status needs ", statuses, " entries");
  return out;
}

// decode_bytes: every segment of every row, in parallel; status per segment (0 = ok).
static void decode_bytes_cpu(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                             const at::Tensor& status) {
  const std::vector<TensorDesc> descs = check_bytes_args(data, desc, outputs, status);
  std::vector<int64_t> firsts;                                       // first segment of each row
  int64_t total = 0;
  for (const auto& d : descs) firsts.push_back(total), total += segment_count(d);
  int32_t* st = status.data_ptr<int32_t>();
  const uint8_t* bytes = data.data_ptr<uint8_t>();
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<DecodeTable> table(1);
    int64_t cached_row = -1, cached_table = -1;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t r = std::upper_bound(firsts.begin(), firsts.end(), g) - firsts.begin() - 1;
      const TensorDesc& d = descs[r];
      const int64_t seg = g - firsts[r];
      int32_t& s = st[d.first_segment + seg];
      const uint8_t* exp = bytes + d.exp_off;
      SegmentRef ref;
      if ((s = read_segment(exp, d.exp_len, d, seg, &ref)) != kOk) continue;
      if (r != cached_row || ref.table0 != cached_table) {
        cached_row = -1;
        if ((s = build_decode_table(exp, d, ref.table0, table[0])) != kOk) continue;
        cached_row = r, cached_table = ref.table0;
      }
      s = decode_byte_segment(exp, ref, table[0], static_cast<uint8_t*>(outputs[r].data_ptr()) + seg * kSegmentSymbols);
    }
  });
}

// ---- dequantize_blocks -------------------------------------------------------------------------------
// outs: tensors of one GGML type, each with its l.n_planes planes in turn in `planes`.
const gguf::BlockLayout& check_blocks_args(at::TensorList planes, int64_t ggml_type, at::TensorList outs) {
  const gguf::BlockLayout* l = gguf::find_layout(ggml_type);
  TORCH_CHECK(l != nullptr, "no dequantizer for GGML type ", ggml_type);
  TORCH_CHECK(planes.size() == outs.size() * static_cast<size_t>(l->n_planes), "GGML type ", ggml_type, " has ",
              l->n_planes, " planes a tensor: ", outs.size(), " outputs need ", outs.size() * l->n_planes);
  for (size_t t = 0; t < outs.size(); ++t) {
    const at::Tensor& out = outs[t];
    TORCH_CHECK(out.is_contiguous() && (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf ||
                                        out.scalar_type() == at::kFloat),
                "out must be a contiguous bfloat16, float16 or float32 tensor");
    TORCH_CHECK(out.scalar_type() == outs[0].scalar_type() && out.device() == outs[0].device(),
                "every out must have the first one's dtype and device");
    TORCH_CHECK(out.numel() % l->block_size == 0, "out's numel is not whole blocks");
    const int64_t n_blocks = out.numel() / l->block_size;
    for (int k = 0; k < l->n_planes; ++k) {
      const at::Tensor& plane = planes[t * l->n_planes + k];
      TORCH_CHECK(plane.scalar_type() == at::kByte && plane.is_contiguous() && plane.device() == out.device() &&
                      plane.numel() == n_blocks * l->planes[k].width,
                  "plane ", k, " must be contiguous uint8 on out's device with ", n_blocks * l->planes[k].width, " bytes");
    }
  }
  return *l;
}

// Blocks [b0, b1) of one tensor, its block type and output dtype fixed (gguf_cpu.h): AVX-512 where
// the CPU has it, else the scalar loop.
template <int Code, typename Out>
static void dequantize_range(const gguf::BlockLayout& l, const gguf::Planes& planes, int64_t b0, int64_t b1,
                             typename Out::T* out) {
#if defined(__x86_64__)
  if (gguf::has_avx512()) return gguf::simd_range<Code, Out>(l, planes, b0, b1, out);
#endif
  gguf::scalar_range<Code, Out>(l, planes, b0, b1, out);
}

template <int Code, typename Out>
static void dequantize_into(const gguf::BlockLayout& l, const gguf::Planes& planes, const at::Tensor& out) {
  auto* o = reinterpret_cast<typename Out::T*>(out.data_ptr());
  at::parallel_for(0, out.numel() / l.block_size, 256,
                   [&](int64_t b0, int64_t b1) { dequantize_range<Code, Out>(l, planes, b0, b1, o); });
}

static void dequantize_one_cpu(const gguf::BlockLayout& l, at::TensorList planes, const at::Tensor& out) {
  gguf::Planes p{};
  for (int k = 0; k < l.n_planes; ++k) p.p[k] = planes[k].data_ptr<uint8_t>();
  const auto kind = out.scalar_type();
  gguf::with_block_type(l.code, [&](auto type) {
    constexpr int kCode = decltype(type)::kCode;
    if (kind == at::kFloat) dequantize_into<kCode, gguf::OutF32>(l, p, out);
    else if (kind == at::kBFloat16) dequantize_into<kCode, gguf::OutBF16>(l, p, out);
    else dequantize_into<kCode, gguf::OutF16>(l, p, out);
  });
}

static void dequantize_blocks_cpu(at::TensorList planes, int64_t ggml_type, at::TensorList outs) {
  const gguf::BlockLayout& l = check_blocks_args(planes, ggml_type, outs);
  for (size_t t = 0; t < outs.size(); ++t) dequantize_one_cpu(l, planes.slice(t * l.n_planes, l.n_planes), outs[t]);
}

// ---- reconstruct_int8 (codec/int8.py, int8_tiles.h) -------------------------------------------------
void check_int8_args(const at::Tensor& resid, const at::Tensor& modes, const at::Tensor& scales,
                     const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && (out.scalar_type() == at::kBFloat16 ||
                                                        out.scalar_type() == at::kHalf || out.scalar_type() == at::kFloat),
              "out must be a contiguous 2-D bfloat16, float16 or float32 tensor");
  const int64_t rows = out.size(0), cols = out.size(1);
  const int64_t tiles = ((rows + int8::kTile - 1) / int8::kTile) * ((cols + int8::kTile - 1) / int8::kTile);
  TORCH_CHECK(resid.scalar_type() == at::kByte && resid.is_contiguous() && resid.numel() == rows * cols,
              "resid must be contiguous uint8 with rows * cols bytes");
  TORCH_CHECK(modes.scalar_type() == at::kByte && modes.is_contiguous() && modes.numel() == tiles,
              "modes must be contiguous uint8 with one byte per tile");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == rows,
              "scales must be contiguous float32 with one per row");
  TORCH_CHECK(resid.device() == out.device() && modes.device() == out.device() && scales.device() == out.device(),
              "every tensor must be on out's device");
}

// A tile row -> the output, one element at a time (the GPU stores whole rows: decode_quant.cu).
template <typename Put>
struct RowStore {
  Put put;
  void row(int64_t at, const float* y, int w) const {
    for (int j = 0; j < w; ++j) put(at + j, y[j]);
  }
};
template <typename Put>
static RowStore<Put> rows_of(Put put) { return RowStore<Put>{put}; }

static void reconstruct_int8_cpu(const at::Tensor& resid, const at::Tensor& modes, const at::Tensor& scales,
                                 const at::Tensor& out) {
  check_int8_args(resid, modes, scales, out);
  const int64_t rows = out.size(0), cols = out.size(1), tiles = modes.numel();
  const uint8_t* r = resid.data_ptr<uint8_t>();
  const uint8_t* m = modes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  const auto kind = out.scalar_type();
  at::parallel_for(0, tiles, 64, [&](int64_t t0, int64_t t1) {
    float* f32 = kind == at::kFloat ? out.data_ptr<float>() : nullptr;
    uint16_t* u16 = kind == at::kFloat ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
    const auto store_f32 = rows_of([f32](int64_t i, float v) { f32[i] = v; });
    const auto store_bf16 = rows_of([u16](int64_t i, float v) { u16[i] = gguf::f32_to_bf16(v); });
    const auto store_f16 = rows_of([u16](int64_t i, float v) { u16[i] = gguf::f32_to_f16(v); });
    for (int64_t t = t0; t < t1; ++t) {
      if (kind == at::kFloat) int8::reconstruct_tile(r, m, s, rows, cols, t, store_f32);
      else if (kind == at::kBFloat16) int8::reconstruct_tile(r, m, s, rows, cols, t, store_bf16);
      else int8::reconstruct_tile(r, m, s, rows, cols, t, store_f16);
    }
  });
}

// decode_bytes: decode the byte planes in `desc` (rows as decode_pieces', ctx_bits 0, dtype code
// kU8, no hi/lo) from `data` into `outputs` (caller-owned, 1-byte elements); status per segment.
// dequantize_blocks: GGUF planes (codec/gguf_blocks.py order) of each tensor in turn -> `outs`.
// reconstruct_int8: an int8-coded weight's residual bytes, tile modes and row scales -> `out`.
TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("decode_bytes(Tensor data, Tensor desc, Tensor(a!)[] outputs, Tensor(b!) status) -> ()");
  m.def("dequantize_blocks(Tensor[] planes, int ggml_type, Tensor(a!)[] outs) -> ()");
  m.def("reconstruct_int8(Tensor resid, Tensor modes, Tensor scales, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("decode_bytes", &decode_bytes_cpu);
  m.impl("dequantize_blocks", &dequantize_blocks_cpu);
  m.impl("reconstruct_int8", &reconstruct_int8_cpu);
}

}  // namespace wcodec
