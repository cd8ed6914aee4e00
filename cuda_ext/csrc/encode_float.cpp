// The C++ CPU twin of the float-codec ENCODER, and the ops' schemas. Mirrors codec/floatcodec.py:
//   prepare_plane(data, dtype)   split planes -> count symbols -> choose the tables   (floatcodec.prepare)
//   encode_planes(...)           pack the entries -> encode lanes -> assemble          (floatcodec.encode_batch)
// encode_float.cu is its CUDA twin. Threads (at::parallel_for, OpenMP) run over segments: every
// segment of every plane of a batch is one task, so small tensors of a batch share the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <memory>
#include <vector>

#include "encode_avx512.h"
#include "encode_host.h"

namespace wcodec {

const Log2Table& log2_table() {
  static const Log2Table* table = [] {
    auto* t = new Log2Table;
    build_log2(*t);
    return t;
  }();
  return *table;
}

// Tables are normalised a few dozen at a time per thread: fewer, larger parallel regions.
auto parallel_rows = [](int64_t n, const auto& fn) {
  at::parallel_for(0, n, 32, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) fn(j);
  });
};

int64_t plane_symbols(const at::Tensor& data, int64_t dtype) {
  TORCH_CHECK(dtype >= kBF16 && dtype <= kU8, "dtype must be 0 (bf16), 1 (fp16), 2 (fp32) or 3 (bytes)");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "data must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(data.numel() % element_bytes(dtype) == 0, "data holds a partial element");
  return data.numel() / element_bytes(dtype);
}

void pack_simd_tables(PlaneJob& p) {
  p.fc.resize(p.entries.size()), p.inv.resize(p.entries.size());
  for (size_t k = 0; k < p.entries.size(); ++k) {
    p.fc[k] = (p.entries[k].freq << 16) | p.entries[k].cum;
    p.inv[k] = p.entries[k].freq ? 1.0 / p.entries[k].freq : 0.0;
  }
}

template <int Dtype>
static inline uint32_t fine_bin(const uint8_t* in, int64_t i) {
  uint32_t sym, h, l;
  split_element(Dtype, in, i, sym, h, l);
  return (fine_context(Dtype, h) << 8) | sym;
}

// Count one segment's symbols by full context in four histograms (a run of one exponent would
// otherwise wait on one counter), then add them up.
template <int Dtype>
static void count_segment(const uint8_t* in, int64_t i0, int64_t end, int32_t* part, int32_t* counts) {
  std::fill(part, part + 4 * kFineBins, 0);
  int64_t i = i0;
  for (; i + 4 <= end; i += 4) {
    ++part[fine_bin<Dtype>(in, i)];
    ++part[kFineBins + fine_bin<Dtype>(in, i + 1)];
    ++part[2 * kFineBins + fine_bin<Dtype>(in, i + 2)];
    ++part[3 * kFineBins + fine_bin<Dtype>(in, i + 3)];
  }
  for (; i < end; ++i) ++part[fine_bin<Dtype>(in, i)];
  for (int64_t k = 0; k < kFineBins; ++k) counts[k] = part[k] + part[kFineBins + k] + part[2 * kFineBins + k] + part[3 * kFineBins + k];
}

// The raw planes of elements [i0, end): a loop the compiler vectorises (restrict: no aliasing).
template <int Dtype>
static void split_raw(const uint8_t* __restrict in, int64_t i0, int64_t end, uint8_t* __restrict hi,
                      uint8_t* __restrict lo) {
  for (int64_t i = i0; i < end; ++i) {
    uint32_t sym, h, l;
    split_element(Dtype, in, i, sym, h, l);
    hi[i] = static_cast<uint8_t>(h);
    if constexpr (Dtype == kFP32) lo[2 * i] = l & 0xFF, lo[2 * i + 1] = l >> 8;
  }
}

// Split planes and count symbols, a segment per task.
template <int Dtype>
static void split_and_count(const uint8_t* in, int64_t n, uint8_t* hi, uint8_t* lo, int32_t* fine) {
  const int64_t n_seg = (n + kSegmentSymbols - 1) / kSegmentSymbols;
  at::parallel_for(0, n_seg, n_seg < 8 ? 8 : 1, [&](int64_t b, int64_t e) {     // small planes: inline
    std::vector<int32_t> part(4 * kFineBins);
    for (int64_t seg = b; seg < e; ++seg) {
      const int64_t i0 = seg * kSegmentSymbols, end = std::min(n, i0 + kSegmentSymbols);
      if constexpr (Dtype != kU8) split_raw<Dtype>(in, i0, end, hi, lo);
      count_segment<Dtype>(in, i0, end, part.data(), fine + seg * kFineBins);
    }
  });
}

// prepare_plane: -> (choice int64 [3] = coded, ctx_bits, table_group; freqs int32 [max_tables, 256],
// the first n_tables rows used; hi uint8 [n] or [0]; lo uint8 [2n] or [0]).
static std::vector<at::Tensor> prepare_plane_cpu(const at::Tensor& data, int64_t dtype) {
  const int64_t n = plane_symbols(data, dtype), n_seg = (n + kSegmentSymbols - 1) / kSegmentSymbols;
  at::Tensor hi = at::empty({dtype == kU8 ? 0 : n}, data.options());
  at::Tensor lo = at::empty({dtype == kFP32 ? 2 * n : 0}, data.options());
  at::Tensor choice = at::zeros({3}, data.options().dtype(at::kLong));
  at::Tensor freqs = at::zeros({4 * ((n_seg + 3) / 4), 256}, data.options().dtype(at::kInt));
  std::vector<int32_t> fine(n_seg * kFineBins, 0);
  const uint8_t* in = data.data_ptr<uint8_t>();
  uint8_t *h = hi.data_ptr<uint8_t>(), *l = lo.data_ptr<uint8_t>();
  switch (dtype) {
    case kBF16: split_and_count<kBF16>(in, n, h, l, fine.data()); break;
    case kFP16: split_and_count<kFP16>(in, n, h, l, fine.data()); break;
    case kFP32: split_and_count<kFP32>(in, n, h, l, fine.data()); break;
    default: split_and_count<kU8>(in, n, h, l, fine.data()); break;
  }
  choose_into(fine.data(), n_seg, n, dtype, choice, freqs);
  return {choice, freqs, hi, lo};
}

void choose_into(const int32_t* fine, int64_t n_seg, int64_t n, int64_t dtype, at::Tensor& choice, at::Tensor& freqs) {
  if (n < kMinCodedElements) return;                                   // stored raw
  std::vector<uint32_t> chosen;
  const Choice c = choose_tables(fine, n_seg, n, dtype == kU8 ? 0 : kMaxCtxBits, log2_table(), chosen, parallel_rows);
  int64_t* ch = choice.data_ptr<int64_t>();
  ch[0] = c.coded, ch[1] = c.ctx_bits, ch[2] = c.table_group;
  int32_t* f = freqs.data_ptr<int32_t>();
  for (size_t k = 0; k < chosen.size(); ++k) f[k] = static_cast<int32_t>(chosen[k]);
}

// ---- encode lanes -------------------------------------------------------------------------------
// Encode one segment. rANS encodes IN REVERSE: steps last to first, lanes 31 down to 0, each word
// written at --ptr; the segment's words end at `end` and its final states go to `states`.
template <int Dtype>
static int64_t encode_segment(const PlaneJob& p, int64_t seg, uint16_t* end, uint32_t* states) {
  const int64_t s0 = seg * kSegmentSymbols, len = std::min(kSegmentSymbols, p.n - s0);
  const EncodeEntry* set = p.entries.data() + (((seg / p.group) << p.ctx_bits) << 8);
  const uint8_t* in = p.in + s0 * element_bytes(Dtype);
  const int cb = static_cast<int>(p.ctx_bits);
  uint32_t x[kLanes];
  for (int l = 0; l < kLanes; ++l) x[l] = kRansL;
  uint16_t* ptr = end;
  int64_t t = (len + kLanes - 1) / kLanes - 1;
#if defined(__x86_64__)
  const int64_t simd_steps = encode_has_avx512() ? len / kLanes : 0;
#else
  const int64_t simd_steps = 0;
#endif
  for (; t >= simd_steps; --t) {                                              // last step first
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, len - t * kLanes));
    for (int l = lanes - 1; l >= 0; --l) {                                    // lane 31 first
      uint32_t sym, hi, lo;
      split_element(Dtype, in, t * kLanes + l, sym, hi, lo);
      const uint32_t ctx = Dtype == kU8 ? 0 : context(hi, cb, Dtype);
      rans_encode_step(x[l], set[(ctx << 8) | sym], ptr);                    // x = C(s, x)
    }
  }
#if defined(__x86_64__)
  if (simd_steps) {
    const int64_t base = ((seg / p.group) << p.ctx_bits) << 8;
    encode_full_steps_avx512<Dtype>(in, simd_steps, cb, p.fc.data() + base, p.inv.data() + base, x, ptr);
  }
#endif
  for (int l = 0; l < kLanes; ++l) states[l] = x[l];
  return end - ptr;
}

static int64_t encode_any(const PlaneJob& p, int64_t seg, uint16_t* end, uint32_t* states) {
  switch (p.dtype) {
    case kBF16: return encode_segment<kBF16>(p, seg, end, states);
    case kFP16: return encode_segment<kFP16>(p, seg, end, states);
    case kFP32: return encode_segment<kFP32>(p, seg, end, states);
    default: return encode_segment<kU8>(p, seg, end, states);
  }
}

// ---- assemble -----------------------------------------------------------------------------------
StreamLayout stream_layout(const PlaneJob& p, const int64_t* counts) {
  const int64_t n_tables = p.n_tables(), dir = exp_directory_bytes(p.n_seg, n_tables);
  std::vector<uint8_t> blob(n_tables * (kTableBitmapBytes + 512));
  std::vector<uint32_t> table_off(n_tables + 1, static_cast<uint32_t>(dir));
  const uint32_t* freqs = reinterpret_cast<const uint32_t*>(p.freqs.data_ptr<int32_t>());
  int64_t pos = 0;
  for (int64_t j = 0; j < n_tables; ++j) pos += serialize_table(freqs + 256 * j, blob.data() + pos), table_off[j + 1] = dir + pos;
  StreamLayout out{std::vector<uint8_t>(align_up(dir + pos, kSegmentAlign), 0), std::vector<int64_t>(p.n_seg + 1)};
  out.seg_off[0] = static_cast<int64_t>(out.head.size());
  for (int64_t s = 0; s < p.n_seg; ++s) out.seg_off[s + 1] = out.seg_off[s] + segment_bytes(counts[s]);
  uint8_t* o = out.head.data();
  for (int64_t s = 0; s < p.n_seg; ++s) {
    memcpy(o + 8 * s, &out.seg_off[s], 8);
    const uint32_t c = static_cast<uint32_t>(counts[s]);
    memcpy(o + 8 * p.n_seg + 4 * s, &c, 4);
  }
  memcpy(o + 12 * p.n_seg, table_off.data(), 4 * (n_tables + 1));
  memcpy(o + dir, blob.data(), pos);
  return out;
}

// The stream of one plane: its head, then per segment its states, its words (segment s's end at
// words_end(s)) and zeros to the next segment (floatcodec._assemble).
template <class WordsEnd>
static at::Tensor assemble(const PlaneJob& p, const uint32_t* states, const int64_t* counts, WordsEnd words_end) {
  const StreamLayout lay = stream_layout(p, counts);
  at::Tensor out = at::empty({lay.seg_off[p.n_seg]}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  memcpy(o, lay.head.data(), lay.head.size());
  at::parallel_for(0, p.n_seg, 1, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      uint8_t* seg = o + lay.seg_off[s];
      const int64_t words = 2 * counts[s];
      memcpy(seg, states + kLanes * s, kStateBytes);
      memcpy(seg + kStateBytes, words_end(s) - counts[s], words);
      memset(seg + kStateBytes + words, 0, lay.seg_off[s + 1] - lay.seg_off[s] - kStateBytes - words);
    }
  });
  return out;
}

std::vector<PlaneJob> plane_jobs(at::TensorList data, at::IntArrayRef dtypes, at::TensorList freqs,
                                 at::IntArrayRef ctx_bits, at::IntArrayRef groups) {
  const size_t k = data.size();
  TORCH_CHECK(dtypes.size() == k && freqs.size() == k && ctx_bits.size() == k && groups.size() == k,
              "one dtype, freqs, ctx_bits and table_group per plane");
  std::vector<PlaneJob> jobs(k);
  int64_t first = 0;
  for (size_t i = 0; i < k; ++i) {
    PlaneJob& p = jobs[i];
    p.n = plane_symbols(data[i], dtypes[i]);
    p.in = data[i].data_ptr<uint8_t>(), p.dtype = dtypes[i], p.ctx_bits = ctx_bits[i], p.group = groups[i];
    p.n_seg = (p.n + kSegmentSymbols - 1) / kSegmentSymbols, p.first_seg = first;
    first += p.n_seg;
    TORCH_CHECK(p.n >= 1 && p.ctx_bits >= 0 && p.ctx_bits <= (p.dtype == kU8 ? 0 : kMaxCtxBits) && p.group >= 1,
                "plane ", i, ": empty, or ctx_bits / table_group out of range");
    const int64_t n_tables = p.n_tables();
    TORCH_CHECK(freqs[i].scalar_type() == at::kInt && freqs[i].is_contiguous() && freqs[i].numel() >= 256 * n_tables &&
                    freqs[i].device() == data[i].device(), "plane ", i, ": freqs must be int32 [>= ", n_tables, ", 256]");
    p.entries.resize(n_tables * 256);
    p.freqs = freqs[i].cpu();
    const at::Tensor& f = p.freqs;
    for (int64_t j = 0; j < n_tables; ++j) {
      const int32_t* row = f.data_ptr<int32_t>() + 256 * j;
      uint32_t sum = 0;
      for (int s = 0; s < 256; ++s) sum += static_cast<uint32_t>(row[s]);
      TORCH_CHECK(sum == kProbScale || sum == 0, "plane ", i, ": table ", j, " does not sum to ", kProbScale);
      pack_encode(reinterpret_cast<const uint32_t*>(row), p.entries.data() + 256 * j);
    }
    pack_simd_tables(p);
  }
  return jobs;
}

// encode_planes: the exp stream of each plane (uint8), given its dtype, tables and parameters.
static std::vector<at::Tensor> encode_planes_cpu(at::TensorList data, at::IntArrayRef dtypes, at::TensorList freqs,
                                                 at::IntArrayRef ctx_bits, at::IntArrayRef groups) {
  std::vector<PlaneJob> jobs = plane_jobs(data, dtypes, freqs, ctx_bits, groups);
  int64_t total_seg = 0;
  for (const auto& p : jobs) total_seg += p.n_seg;
  std::vector<int64_t> firsts;
  for (const auto& p : jobs) firsts.push_back(p.first_seg);
  std::vector<uint32_t> states(total_seg * kLanes);
  std::vector<int64_t> counts(total_seg);
  // Segment g's words end at the end of slot g; each slot has a lane's worth of room below its words.
  constexpr int64_t kSlot = kSegmentSymbols + kLanes;
  std::unique_ptr<uint16_t[]> words(new uint16_t[total_seg * kSlot]);
  at::parallel_for(0, total_seg, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) {
      const size_t i = std::upper_bound(firsts.begin(), firsts.end(), g) - firsts.begin() - 1;
      counts[g] = encode_any(jobs[i], g - jobs[i].first_seg, words.get() + (g + 1) * kSlot,
                             states.data() + g * kLanes);
    }
  });
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const int64_t g0 = jobs[i].first_seg;
    out.push_back(assemble(jobs[i], states.data() + g0 * kLanes, counts.data() + g0,
                           [&](int64_t s) { return words.get() + (g0 + s + 1) * kSlot; }));
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("prepare_plane(Tensor data, int dtype) -> Tensor[]");
  m.def("encode_planes(Tensor[] data, int[] dtypes, Tensor[] freqs, int[] ctx_bits, int[] table_groups) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("prepare_plane", &prepare_plane_cpu);
  m.impl("encode_planes", &encode_planes_cpu);
}

}  // namespace wcodec
