// The C++ CPU twin of the encoder's first half, and its ops' schemas. Mirrors floatcodec.prepare:
//   prepare_planes(data, dtypes)   split planes -> count symbols -> choose the tables, for a batch
//   prepare_plane(data, dtype)     the same for one plane
// encode_prepare.cu is its CUDA twin (it counts on the device and chooses with choose_planes here);
// encode_float.cpp encodes the planes so prepared. Threads (at::parallel_for, OpenMP) run over every
// segment of every plane of a batch, then over every (plane, candidate choice) of the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

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

template <int Dtype>
static void split_and_count(const PlaneShape& p, int64_t seg, int32_t* part, int32_t* fine) {
  const int64_t i0 = seg * kSegmentSymbols, end = std::min(p.n, i0 + kSegmentSymbols);
  if constexpr (Dtype != kU8) split_raw<Dtype>(p.in, i0, end, p.hi, p.lo);
  count_segment<Dtype>(p.in, i0, end, part, fine + (p.first_seg + seg) * kFineBins);
}

// Split planes and count symbols, a segment of any plane per task (small batches: inline).
static void split_and_count(const PrepareBatch& b, int32_t* fine) {
  std::vector<int64_t> firsts;
  for (const PlaneShape& p : b.planes) firsts.push_back(p.first_seg);
  at::parallel_for(0, b.total_seg, b.total_seg < 8 ? 8 : 1, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> part(4 * kFineBins);
    for (int64_t g = lo; g < hi; ++g) {
      const PlaneShape& p = b.planes[std::upper_bound(firsts.begin(), firsts.end(), g) - firsts.begin() - 1];
      switch (p.dtype) {
        case kBF16: split_and_count<kBF16>(p, g - p.first_seg, part.data(), fine); break;
        case kFP16: split_and_count<kFP16>(p, g - p.first_seg, part.data(), fine); break;
        case kFP32: split_and_count<kFP32>(p, g - p.first_seg, part.data(), fine); break;
        default: split_and_count<kU8>(p, g - p.first_seg, part.data(), fine); break;
      }
    }
  });
}

PrepareBatch prepare_batch(at::TensorList data, at::IntArrayRef dtypes, bool pinned) {
  TORCH_CHECK(data.size() == dtypes.size(), "one dtype per plane");
  PrepareBatch b;
  const auto host = at::TensorOptions().pinned_memory(pinned);
  b.choices = at::zeros({static_cast<int64_t>(data.size()), 3}, host.dtype(at::kLong));
  for (size_t i = 0; i < data.size(); ++i) {
    const int64_t n = plane_symbols(data[i], dtypes[i]), n_seg = (n + kSegmentSymbols - 1) / kSegmentSymbols;
    TORCH_CHECK(data[i].device() == data[0].device(), "every plane must be on one device");
    b.hi.push_back(at::empty({dtypes[i] == kU8 ? 0 : n}, data[i].options()));
    b.lo.push_back(at::empty({dtypes[i] == kFP32 ? 2 * n : 0}, data[i].options()));
    b.freqs.push_back(at::zeros({4 * ((n_seg + 3) / 4), 256}, host.dtype(at::kInt)));
    b.planes.push_back(PlaneShape{data[i].data_ptr<uint8_t>(), b.hi[i].data_ptr<uint8_t>(), b.lo[i].data_ptr<uint8_t>(),
                                  n, n_seg, dtypes[i], b.total_seg});
    b.total_seg += n_seg;
  }
  return b;
}

std::vector<at::Tensor> PrepareBatch::outputs(const at::Device& device) const {
  std::vector<at::Tensor> out{choices.to(device, /*non_blocking=*/true)};
  for (size_t i = 0; i < planes.size(); ++i)
    out.insert(out.end(), {freqs[i].to(device, /*non_blocking=*/true), hi[i], lo[i]});
  return out;
}

namespace {
struct ChoiceTask {             // one candidate (ctx_bits, table_group) of one plane, priced
  size_t plane;
  Candidate cand;
  int64_t cost = 0;
  std::vector<uint32_t> freqs;
};
}  // namespace

// Price every task, the threads taking the next one as they finish (tasks differ a lot in size).
static void price_tasks(const int32_t* fine, const PrepareBatch& b, std::vector<ChoiceTask>& tasks) {
  std::atomic<size_t> next{0};
  const auto serial = [](int64_t n, const auto& fn) {
    for (int64_t j = 0; j < n; ++j) fn(j);
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks.size()), 1, [&](int64_t, int64_t) {
    for (size_t t = next++; t < tasks.size(); t = next++) {
      ChoiceTask& task = tasks[t];
      const PlaneShape& p = b.planes[task.plane];
      task.cost = price_choice(fine + p.first_seg * kFineBins, p.n_seg, task.cand.ctx_bits, task.cand.group,
                               log2_table(), task.freqs, serial);
    }
  });
}

void choose_planes(const int32_t* fine, PrepareBatch& b) {
  std::vector<ChoiceTask> tasks;
  for (size_t i = 0; i < b.planes.size(); ++i) {
    if (b.planes[i].n < kMinCodedElements) continue;                     // stored raw
    Candidate cand[kMaxCandidates];
    const int k = candidates(b.planes[i].n_seg, b.planes[i].dtype == kU8 ? 0 : kMaxCtxBits, cand);
    for (int c = 0; c < k; ++c) tasks.push_back(ChoiceTask{i, cand[c]});
  }
  price_tasks(fine, b, tasks);
  std::vector<Choice> best(b.planes.size(), Choice{false, 0, 0, 0});
  std::vector<const ChoiceTask*> won(b.planes.size(), nullptr);
  for (const ChoiceTask& t : tasks)                                     // in candidate order: the first least
    if (cheaper(best[t.plane], t.cost)) best[t.plane] = Choice{true, t.cand.ctx_bits, t.cand.group, t.cost}, won[t.plane] = &t;
  int64_t* ch = b.choices.data_ptr<int64_t>();
  for (size_t i = 0; i < b.planes.size(); ++i) {
    if (won[i] == nullptr) continue;
    ch[3 * i] = worth_coding(best[i].cost, b.planes[i].n_seg, b.planes[i].n), ch[3 * i + 1] = best[i].ctx_bits;
    ch[3 * i + 2] = best[i].table_group;
    std::copy(won[i]->freqs.begin(), won[i]->freqs.end(), reinterpret_cast<uint32_t*>(b.freqs[i].data_ptr<int32_t>()));
  }
}

std::vector<at::Tensor> first_plane(const std::vector<at::Tensor>& batch) {
  return {batch[0][0].clone(), batch[1], batch[2], batch[3]};
}

// prepare_planes: -> [choices int64 [k, 3] (coded, ctx_bits, table_group), then per plane freqs int32
// [4 ceil(n_seg / 4), 256] (the first n_tables rows used), hi uint8 [n] or [0], lo uint8 [2n] or [0]].
static std::vector<at::Tensor> prepare_planes_cpu(at::TensorList data, at::IntArrayRef dtypes) {
  PrepareBatch b = prepare_batch(data, dtypes, /*pinned=*/false);
  std::vector<int32_t> fine(b.total_seg * kFineBins);
  split_and_count(b, fine.data());
  choose_planes(fine.data(), b);
  return b.outputs(at::kCPU);
}

static std::vector<at::Tensor> prepare_plane_cpu(const at::Tensor& data, int64_t dtype) {
  return first_plane(prepare_planes_cpu({data}, {dtype}));
}

TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("prepare_plane(Tensor data, int dtype) -> Tensor[]");
  m.def("prepare_planes(Tensor[] data, int[] dtypes) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("prepare_plane", &prepare_plane_cpu);
  m.impl("prepare_planes", &prepare_planes_cpu);
}

}  // namespace wcodec
