// CUDA twin of decode_float.cpp: the same steps (read the directory -> build the decode tables ->
// decode lanes -> join planes), spread over threads: one warp decodes one segment, one lane per
// rANS state, exactly the lane/word order of docs/FORMAT.md §3. The warp builds its table set in
// shared memory, then each step is two shared-memory loads, a multiply-add, and a ballot + popc
// to hand out the renormalisation words in lane order. Archive data never traps: every read is
// bounded and each segment reports a status.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "decode_common.h"

namespace wcodec {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

std::vector<TensorDesc> check_args(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                   int64_t n_segments);   // decode_float.cpp

// ---- build the decode tables (warp-parallel) ------------------------------------------------------
// Lane l owns symbols [8l, 8l + 8): their presence bits are byte l of the bitmap. Returns kOk/kTable.
__device__ int build_decode_table(const uint8_t* exp, const TensorDesc& d, int64_t j, DecodeTable* t) {
  const int lane = threadIdx.x & 31;
  const int64_t base = 12 * segment_count(d);
  const int64_t start = load_le<uint32_t>(exp + base + 4 * j);
  const int64_t end = load_le<uint32_t>(exp + base + 4 * (j + 1));
  bool ok = start >= directory_bytes(d) && end >= start + kTableBitmapBytes && end <= d.exp_len;
  const uint32_t bits = ok ? exp[start + lane] : 0u;
  uint32_t before = __popc(bits);                                    // exclusive scan of counts
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(kFullMask, before, o);
    if (lane >= o) before += v;
  }
  before -= __popc(bits);
  uint32_t freq[8], sum = 0;
  for (int k = 0, seen = 0; k < 8; ++k) {
    freq[k] = 0;
    if (!((bits >> k) & 1)) continue;
    const int64_t pos = start + kTableBitmapBytes + 2 * (before + seen++);
    if (pos + 2 > end) { ok = false; continue; }
    freq[k] = load_le<uint16_t>(exp + pos);
    ok = ok && freq[k] != 0;
    sum += freq[k];
  }
  uint32_t cum = sum;                                                // exclusive scan of sums
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_up_sync(kFullMask, cum, o);
    if (lane >= o) cum += v;
  }
  const uint32_t total = __shfl_sync(kFullMask, cum, 31);
  cum -= sum;
  ok = __all_sync(kFullMask, ok) && (total == kProbScale || total == 0);
  if (!ok) return kTable;
  for (int k = 0; k < 8; ++k) {
    const int s = 8 * lane + k;
    // an unused (all-zero) table is the identity: symbol 0 owns [0, M), every other cum is M
    t->freq_cum[s] = total ? (freq[k] << 16) | cum : (s == 0 ? kProbScale << 16 : kProbScale);
    cum += freq[k];
  }
  __syncwarp();
  // The symbol owning a slot is the last s with cum[s] <= slot: cum never decreases, and an absent
  // symbol shares its cum with the next symbol, so the last such s is always a present one.
  for (uint32_t slot = lane; slot < kProbScale; slot += 32) {
    uint32_t lo = 0, hi = 255;
    while (lo < hi) {
      const uint32_t mid = (lo + hi + 1) >> 1;
      if ((t->freq_cum[mid] & 0xFFFF) <= slot) lo = mid; else hi = mid - 1;
    }
    t->sym[slot] = static_cast<uint8_t>(lo);
  }
  __syncwarp();
  return kOk;
}

// ---- decode lanes + join planes -------------------------------------------------------------------
template <int Dtype, int CtxBits>
__device__ int decode_lanes(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, int64_t seg,
                            const DecodeTable* set, void* out_base) {
  using Word = typename std::conditional<Dtype == kFP32, uint32_t, uint16_t>::type;
  const int lane = threadIdx.x & 31;
  const uint8_t* exp = data + d.exp_off;
  const uint8_t* hi = data + d.hi_off + seg * kSegmentSymbols;
  const uint16_t* lo = Dtype == kFP32 ? reinterpret_cast<const uint16_t*>(data + d.lo_off) + seg * kSegmentSymbols
                                      : nullptr;
  const uint16_t* words = reinterpret_cast<const uint16_t*>(exp + ref.data + kStateBytes);
  Word* out = static_cast<Word*>(out_base) + seg * kSegmentSymbols;
  const unsigned lanes_below = (1u << lane) - 1u;
  uint32_t x = load_le<uint32_t>(exp + ref.data + 4 * lane);
  int64_t used = 0;
  for (int64_t j = lane; j - lane < ref.symbols; j += 32) {
    const bool active = j < ref.symbols;
    const uint32_t h = active ? __ldg(hi + j) : 0u;
    const DecodeTable& t = set[context(h, CtxBits, Dtype)];
    const uint32_t sym = active ? rans_step(t.sym, t.freq_cum, x) : 0u;
    const bool need = active && x < kRansL;                            // renormalise: one word
    const unsigned mask = __ballot_sync(kFullMask, need);
    const int64_t idx = used + __popc(mask & lanes_below);
    if (need) x = (x << kRenormBits) | (idx < ref.words ? __ldg(words + idx) : 0u);
    used += __popc(mask);
    if (!active) continue;
    if constexpr (Dtype == kFP32)
      out[j] = join32(sym, h, __ldg(lo + j));
    else
      out[j] = join16(Dtype, sym, h);
  }
  if (used != ref.words) return kWords;
  return __all_sync(kFullMask, x == kRansL) ? kOk : kState;
}

template <int Dtype>
__device__ int decode_ctx(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, int64_t seg,
                          const DecodeTable* set, void* out) {
  switch (d.ctx_bits) {
    case 0: return decode_lanes<Dtype, 0>(data, d, ref, seg, set, out);
    case 1: return decode_lanes<Dtype, 1>(data, d, ref, seg, set, out);
    default: return decode_lanes<Dtype, 2>(data, d, ref, seg, set, out);
  }
}

// One block = one warp = one segment. `firsts` holds each tensor's first global segment.
__global__ void __launch_bounds__(32) decode_float_kernel(const uint8_t* __restrict__ data,
                                                          const int64_t* __restrict__ desc,
                                                          const int64_t* __restrict__ firsts, int64_t n_tensors,
                                                          void* const* __restrict__ outs, int32_t* __restrict__ status) {
  extern __shared__ __align__(16) unsigned char smem[];
  DecodeTable* set = reinterpret_cast<DecodeTable*>(smem);
  const int64_t g = blockIdx.x;
  int64_t lo = 0, hi = n_tensors - 1;                                // last tensor with first <= g
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (firsts[mid] <= g) lo = mid; else hi = mid - 1;
  }
  const TensorDesc d = load_desc(desc + lo * kDescFields);
  const uint8_t* exp = data + d.exp_off;
  const int64_t seg = g - d.first_segment;
  SegmentRef ref;
  int st = read_segment(exp, d.exp_len, d, seg, &ref);
  for (int c = 0; st == kOk && c < (1 << d.ctx_bits); ++c) st = build_decode_table(exp, d, ref.table0 + c, set + c);
  if (st == kOk) {
    switch (d.dtype) {
      case kBF16: st = decode_ctx<kBF16>(data, d, ref, seg, set, outs[lo]); break;
      case kFP16: st = decode_ctx<kFP16>(data, d, ref, seg, set, outs[lo]); break;
      default: st = decode_ctx<kFP32>(data, d, ref, seg, set, outs[lo]); break;
    }
  }
  if ((threadIdx.x & 31) == 0) status[g] = st;
}

static at::Tensor decode_float_cuda(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                    int64_t n_segments) {
  const std::vector<TensorDesc> descs = check_args(data, desc, outputs, n_segments);
  const c10::cuda::CUDAGuard guard(data.device());
  at::Tensor status = at::empty({n_segments}, data.options().dtype(at::kInt));
  if (n_segments == 0) return status;
  int64_t max_ctx = 0;
  std::vector<int64_t> host(descs.size() * (kDescFields + 2));      // desc rows | firsts | out ptrs
  const int64_t n = static_cast<int64_t>(descs.size());
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(desc.data_ptr<int64_t>() + i * kDescFields, kDescFields, host.begin() + i * kDescFields);
    host[n * kDescFields + i] = descs[i].first_segment;
    host[n * (kDescFields + 1) + i] = reinterpret_cast<int64_t>(outputs[i].data_ptr());
    max_ctx = std::max(max_ctx, descs[i].ctx_bits);
  }
  at::Tensor meta = at::from_blob(host.data(), {static_cast<int64_t>(host.size())}, at::kLong)
                        .pin_memory().to(data.device(), /*non_blocking=*/true);
  const int64_t* m = meta.data_ptr<int64_t>();
  const size_t smem = sizeof(DecodeTable) << max_ctx;
  auto stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(n_segments < (int64_t{1} << 31), "too many segments for one launch");
  decode_float_kernel<<<static_cast<unsigned>(n_segments), 32, smem, stream>>>(
      data.data_ptr<uint8_t>(), m, m + n * kDescFields, n,
      reinterpret_cast<void* const*>(m + n * (kDescFields + 1)), status.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  meta.record_stream(stream);
  return status;
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) { m.impl("decode_float", &decode_float_cuda); }

}  // namespace wcodec
