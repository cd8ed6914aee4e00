// The C++ CPU twin of the float-codec ENCODER's second half, and its op's schema. Mirrors
// codec/floatcodec.py (encode_prepare.cpp holds the first half, prepare_plane / prepare_planes):
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

// Each plane's tables (its first n_tables rows of freqs) on the host: for device planes one copy,
// so one wait, for the whole batch.
static void fetch_freqs(at::TensorList freqs, std::vector<PlaneJob>& jobs) {
  std::vector<at::Tensor> used;
  for (size_t i = 0; i < jobs.size(); ++i) used.push_back(freqs[i].reshape(-1).narrow(0, 0, 256 * jobs[i].n_tables()));
  const bool host = used.empty() || used[0].is_cpu();
  const at::Tensor all = host ? at::Tensor() : at::cat(used).cpu();
  int64_t off = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    jobs[i].freqs = host ? used[i] : all.narrow(0, off, used[i].numel());
    off += used[i].numel();
  }
}

// Pack a plane's tables into its encode entries, checking that each sums to M (or is unused).
static void pack_tables(PlaneJob& p, size_t i) {
  p.entries.resize(p.n_tables() * 256);
  for (int64_t j = 0; j < p.n_tables(); ++j) {
    const int32_t* row = p.freqs.data_ptr<int32_t>() + 256 * j;
    uint32_t sum = 0;
    for (int s = 0; s < 256; ++s) sum += static_cast<uint32_t>(row[s]);
    TORCH_CHECK(sum == kProbScale || sum == 0, "plane ", i, ": table ", j, " does not sum to ", kProbScale);
    pack_encode(reinterpret_cast<const uint32_t*>(row), p.entries.data() + 256 * j);
  }
  pack_simd_tables(p);
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
  }
  fetch_freqs(freqs, jobs);
  for (size_t i = 0; i < k; ++i) pack_tables(jobs[i], i);
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
  m.def("encode_planes(Tensor[] data, int[] dtypes, Tensor[] freqs, int[] ctx_bits, int[] table_groups) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("encode_planes", &encode_planes_cpu);
}

}  // namespace wcodec
