// The C++ CPU twin of the float-codec decoder, and the op's schema.
// Mirrors codec/ (NumPy) step for step; decode_float.cu is its CUDA twin. On a CPU one thread
// decodes a whole segment: within a step the 32 lanes take words in lane order, and steps follow
// each other, so the word stream is simply read front to back.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define WCODEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,popcnt")))
#endif

#include "decode_common.h"

namespace wcodec {

// Build the decode tables of one table set (2^ctx_bits tables).
static int build_decode_tables(const uint8_t* exp, const TensorDesc& d, int64_t table0,
                               std::vector<DecodeTable>& set) {
  const int n_ctx = 1 << d.ctx_bits;
  set.resize(n_ctx);
  uint32_t freq[256];
  for (int c = 0; c < n_ctx; ++c) {
    const int st = parse_table(exp, d.exp_len, d, table0 + c, freq);
    if (st != kOk) return st;
    DecodeTable& t = set[c];
    uint32_t cum = 0;
    for (uint32_t s = 0; s < 256; ++s) {
      memset(t.sym + cum, static_cast<int>(s), freq[s]);
      t.freq_cum[s] = (freq[s] << 16) | cum;
      cum += freq[s];
    }
    if (cum == 0) {                                  // unused table: identity
      memset(t.sym, 0, kProbScale);
      t.freq_cum[0] = kProbScale << 16;
    }
  }
  return kOk;
}

// Decode one step (32 lanes, or fewer at a segment's end) and join the planes. `Checked` bounds
// every word read; the fast path is taken only when a whole step cannot run past the words.
template <int Dtype, int CtxBits, bool Checked, typename Word>
static inline void decode_step(int lanes, const uint8_t* hi, const uint8_t* lo, const DecodeTable* set,
                               const uint8_t* words, int64_t n_words, int64_t& used, uint32_t* x, Word* out) {
  for (int l = 0; l < lanes; ++l) {
    const uint32_t h = hi[l];
    const DecodeTable& t = set[context(h, CtxBits, Dtype)];
    const uint32_t sym = rans_step(t.sym, t.freq_cum, x[l]);
    const uint32_t need = x[l] < kRansL;                               // renormalise: one word
    const uint32_t w = (!Checked || used < n_words) ? load_le<uint16_t>(words + 2 * used) : 0u;
    x[l] = need ? (x[l] << kRenormBits) | w : x[l];
    used += need;
    if constexpr (Dtype == kFP32)
      out[l] = join32(sym, h, load_le<uint16_t>(lo + 2 * l));
    else
      out[l] = join16(Dtype, sym, h);
  }
}

// Decode the lanes of one segment and join its planes into `out` (the segment's first element).
#if defined(__x86_64__)
// The same step on AVX-512: 32 lanes as two vectors of 16. The two table lookups are gathers;
// the renormalising words of a vector's lanes are one masked load of the next `count` words,
// expanded into the lanes that take them in lane order (vpexpandd) -- the format's word order.
template <int Dtype, int CtxBits, typename Word>
WCODEC_AVX512 static void decode_step_avx512(const uint8_t* hi, const uint8_t* lo, const DecodeTable* set,
                                             const uint8_t* words, int64_t n_words, int64_t& used,
                                             __m512i* x, Word* out) {
  const char* base = reinterpret_cast<const char*>(set);
  const __m512i low12 = _mm512_set1_epi32(kProbScale - 1), low16 = _mm512_set1_epi32(0xFFFF);
  for (int v = 0; v < 2; ++v) {
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + 16 * v)));
    const __m512i ctx = CtxBits ? _mm512_and_si512(_mm512_srli_epi32(h, (Dtype == kFP16 ? 8 : 7) - CtxBits),
                                                   _mm512_set1_epi32((1 << CtxBits) - 1))
                                : _mm512_setzero_si512();
    const __m512i table = _mm512_mullo_epi32(ctx, _mm512_set1_epi32(sizeof(DecodeTable)));
    const __m512i slot = _mm512_and_si512(x[v], low12);
    const __m512i sym = _mm512_and_si512(_mm512_i32gather_epi32(_mm512_add_epi32(table, slot), base, 1),
                                         _mm512_set1_epi32(0xFF));
    const __m512i fc_at = _mm512_add_epi32(_mm512_add_epi32(table, _mm512_set1_epi32(kProbScale)),
                                           _mm512_slli_epi32(sym, 2));
    const __m512i fc = _mm512_i32gather_epi32(fc_at, base, 1);
    x[v] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(fc, 16),
                                                                _mm512_srli_epi32(x[v], kProbBits)), slot),
                            _mm512_and_si512(fc, low16));                        // x = D(x)
    const __mmask16 need = _mm512_cmplt_epu32_mask(x[v], _mm512_set1_epi32(kRansL));
    const int count = _mm_popcnt_u32(need);
    const int avail = static_cast<int>(std::min<int64_t>(count, std::max<int64_t>(0, n_words - used)));
    const __m256i w16 = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << avail) - 1u), words + 2 * used);
    const __m512i w = _mm512_maskz_expand_epi32(need, _mm512_cvtepu16_epi32(w16));
    x[v] = _mm512_mask_or_epi32(x[v], need, _mm512_slli_epi32(x[v], kRenormBits), w);
    used += count;
    if constexpr (Dtype == kFP32) {
      const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 32 * v)));
      const __m512i j = _mm512_or_si512(
          _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x80)), 24), _mm512_slli_epi32(sym, 23)),
          _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x7F)), 16), l));
      _mm512_storeu_si512(out + 16 * v, j);
    } else {
      const __m512i j = Dtype == kFP16
          ? _mm512_or_si512(_mm512_slli_epi32(sym, 8), h)
          : _mm512_or_si512(_mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x80)), 8),
                                            _mm512_slli_epi32(sym, 7)), _mm512_and_si512(h, _mm512_set1_epi32(0x7F)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * v), _mm512_cvtepi32_epi16(j));
    }
  }
}

template <int Dtype, int CtxBits, typename Word>
WCODEC_AVX512 static int64_t decode_full_steps_avx512(const uint8_t* hi, const uint8_t* lo, const DecodeTable* set,
                                                      const uint8_t* words, int64_t n_words, int64_t& used,
                                                      uint32_t* x_lanes, int64_t full_steps, Word* out) {
  __m512i x[2] = {_mm512_loadu_si512(x_lanes), _mm512_loadu_si512(x_lanes + 16)};
  for (int64_t t = 0; t < full_steps; ++t)
    decode_step_avx512<Dtype, CtxBits>(hi + t * kLanes, Dtype == kFP32 ? lo + 2 * t * kLanes : nullptr, set,
                                       words, n_words, used, x, out + t * kLanes);
  _mm512_storeu_si512(x_lanes, x[0]);
  _mm512_storeu_si512(x_lanes + 16, x[1]);
  return full_steps * kLanes;
}

// WCODEC_CPU_SIMD=0 forces the scalar path (tests run both).
static bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          !(std::getenv("WCODEC_CPU_SIMD") && std::string(std::getenv("WCODEC_CPU_SIMD")) == "0");
  return yes;
}
#endif

template <int Dtype, int CtxBits, typename Word>
static int decode_lanes(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, int64_t seg,
                        const DecodeTable* lut, Word* out) {
  const uint8_t* exp = data + d.exp_off;
  const uint8_t* hi = data + d.hi_off + seg * kSegmentSymbols;
  const uint8_t* lo = Dtype == kFP32 ? data + d.lo_off + 2 * seg * kSegmentSymbols : nullptr;
  const uint8_t* words = exp + ref.data + kStateBytes;
  uint32_t x[kLanes];
  for (int l = 0; l < kLanes; ++l) x[l] = load_le<uint32_t>(exp + ref.data + 4 * l);
  int64_t used = 0, j0 = 0;
#if defined(__x86_64__)
  if (has_avx512())                                    // every full step; the scalar loop ends it
    j0 = decode_full_steps_avx512<Dtype, CtxBits>(hi, lo, lut, words, ref.words, used, x, ref.symbols / kLanes, out);
#endif
  for (; j0 < ref.symbols; j0 += kLanes) {
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, ref.symbols - j0));
    const uint8_t* lo_step = Dtype == kFP32 ? lo + 2 * j0 : nullptr;
    if (lanes == kLanes && used + kLanes <= ref.words)
      decode_step<Dtype, CtxBits, false>(kLanes, hi + j0, lo_step, lut, words, ref.words, used, x, out + j0);
    else
      decode_step<Dtype, CtxBits, true>(lanes, hi + j0, lo_step, lut, words, ref.words, used, x, out + j0);
  }
  if (used != ref.words) return kWords;
  for (int l = 0; l < kLanes; ++l)
    if (x[l] != kRansL) return kState;
  return kOk;
}

template <int Dtype, typename Word>
static int decode_lanes_ctx(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, int64_t seg,
                            const DecodeTable* lut, void* base) {
  Word* out = static_cast<Word*>(base) + seg * kSegmentSymbols;
  switch (d.ctx_bits) {
    case 0: return decode_lanes<Dtype, 0>(data, d, ref, seg, lut, out);
    case 1: return decode_lanes<Dtype, 1>(data, d, ref, seg, lut, out);
    default: return decode_lanes<Dtype, 2>(data, d, ref, seg, lut, out);
  }
}

static int decode_segment(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, int64_t seg,
                          const DecodeTable* lut, void* base) {
  switch (d.dtype) {
    case kBF16: return decode_lanes_ctx<kBF16, uint16_t>(data, d, ref, seg, lut, base);
    case kFP16: return decode_lanes_ctx<kFP16, uint16_t>(data, d, ref, seg, lut, base);
    default: return decode_lanes_ctx<kFP32, uint32_t>(data, d, ref, seg, lut, base);
  }
}

// Checks a caller's arguments (not archive data: that yields statuses). Returns the descriptors.
std::vector<TensorDesc> check_args(const at::Tensor& data, const at::Tensor& desc,
                                   at::TensorList outputs, int64_t n_segments) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "data must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(desc.scalar_type() == at::kLong && desc.device().is_cpu() && desc.dim() == 2 &&
                  desc.size(1) == kDescFields && desc.is_contiguous(),
              "desc must be a contiguous CPU int64 tensor [n, ", int(kDescFields), "]");
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) == desc.size(0), "one output per descriptor row");
  std::vector<TensorDesc> out;
  int64_t first = 0;
  const int64_t size = data.numel();
  for (int64_t i = 0; i < desc.size(0); ++i) {
    const TensorDesc d = load_desc(desc.data_ptr<int64_t>() + i * kDescFields);
    const at::Tensor& o = outputs[i];
    const auto want = d.dtype == kBF16 ? at::kBFloat16 : d.dtype == kFP16 ? at::kHalf : at::kFloat;
    TORCH_CHECK(d.dtype >= kBF16 && d.dtype <= kFP32 && o.scalar_type() == want, "output ", i, " has the wrong dtype");
    TORCH_CHECK(o.is_contiguous() && o.numel() == d.numel && d.numel > 0 && o.device() == data.device(),
                "output ", i, " must be contiguous, on data's device, with numel ", d.numel);
    TORCH_CHECK(d.ctx_bits >= 0 && d.ctx_bits <= kMaxCtxBits && d.table_group >= 1, "bad params in row ", i);
    TORCH_CHECK(d.first_segment == first, "first_segment of row ", i, " must be ", first);
    TORCH_CHECK(d.exp_off >= 0 && d.exp_len >= 0 && d.exp_off + d.exp_len <= size && d.hi_off >= 0 &&
                    d.hi_off + d.numel <= size && (d.dtype != kFP32 || (d.lo_off >= 0 && d.lo_off + 2 * d.numel <= size)),
                "streams of row ", i, " lie outside data");
    first += segment_count(d);
    out.push_back(d);
  }
  TORCH_CHECK(first == n_segments, "n_segments must be ", first);
  return out;
}

static at::Tensor decode_float_cpu(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                   int64_t n_segments) {
  const std::vector<TensorDesc> descs = check_args(data, desc, outputs, n_segments);
  at::Tensor status = at::zeros({n_segments}, data.options().dtype(at::kInt));
  int32_t* st = status.data_ptr<int32_t>();
  const uint8_t* bytes = data.data_ptr<uint8_t>();
  std::vector<int64_t> firsts;
  for (const auto& d : descs) firsts.push_back(d.first_segment);
  at::parallel_for(0, n_segments, 1, [&](int64_t begin, int64_t end) {
    std::vector<DecodeTable> lut;
    int64_t cached_tensor = -1, cached_table = -1;
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t = std::upper_bound(firsts.begin(), firsts.end(), g) - firsts.begin() - 1;
      const TensorDesc& d = descs[t];
      const uint8_t* exp = bytes + d.exp_off;
      SegmentRef ref;
      const int64_t seg = g - d.first_segment;
      if ((st[g] = read_segment(exp, d.exp_len, d, seg, &ref)) != kOk) continue;
      if (t != cached_tensor || ref.table0 != cached_table) {
        cached_tensor = -1;
        if ((st[g] = build_decode_tables(exp, d, ref.table0, lut)) != kOk) continue;
        cached_tensor = t, cached_table = ref.table0;
      }
      st[g] = decode_segment(bytes, d, ref, seg, lut.data(), outputs[t].data_ptr());
    }
  });
  return status;
}

#ifdef WCODEC_PYTHON_MODULE
// Built ahead of time as the Python module cuda_ext._C: importing it registers the ops above.
}  // namespace wcodec
#include <Python.h>
extern "C" PyObject* PyInit__C() {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "wcodec decoders (ops under torch.ops.wcodec)", -1, nullptr};
  return PyModule_Create(&def);
}
namespace wcodec {
#endif

TORCH_LIBRARY(wcodec, m) {
  m.def("decode_float(Tensor data, Tensor desc, Tensor(a!)[] outputs, int n_segments) -> Tensor");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) { m.impl("decode_float", &decode_float_cpu); }

}  // namespace wcodec
