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

// ---- asynchronous global -> shared copies (sm_80+) ---------------------------------------------
// Copies `bytes` (0..16) valid bytes and zero-fills the rest of the 16; with 0 nothing is read.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Per-warp staging, after the block's decode tables. Steps run in chunks of kChunkSteps; the hi
// (and fp32 lo) planes of the next chunk and the words it may need are copied in while this one
// decodes. Layout: hi[2][kChunkSymbols] | ring[kRingWords] u16 | lo[2][kChunkSymbols] u16 (fp32).
constexpr int kChunkSteps = 8;
constexpr int kChunkSymbols = kChunkSteps * kLanes;                  // 256
constexpr int kRingWords = 4 * kChunkSymbols;                        // 4 chunks' worst case (1 word/symbol)
constexpr int kWarpsPerBlock = 4;                                    // = TABLE_GROUP_QUANTUM: one table set
constexpr size_t kStagingBytes = 2 * kChunkSymbols + 2 * kRingWords;
constexpr size_t kStagingBytesFP32 = kStagingBytes + 4 * kChunkSymbols;

struct Staging {
  uint8_t* hi;          // [2][kChunkSymbols]
  uint16_t* ring;       // [kRingWords]
  uint16_t* lo;         // [2][kChunkSymbols], fp32 only
};

__device__ __forceinline__ Staging staging_of(unsigned char* base) {
  return Staging{base, reinterpret_cast<uint16_t*>(base + 2 * kChunkSymbols),
                 reinterpret_cast<uint16_t*>(base + kStagingBytes)};
}

// Bytes of a 16-byte piece that lie before `remaining` (0..16).
__device__ __forceinline__ int piece_bytes(int64_t remaining) {
  return remaining <= 0 ? 0 : remaining >= 16 ? 16 : static_cast<int>(remaining);
}

// Copy [first, last) bytes of `src` (length `len`) to `dst` in 16-byte pieces spread over the warp.
__device__ __forceinline__ void stage_bytes(uint8_t* dst, const uint8_t* src, int64_t first, int64_t last,
                                            int64_t len) {
  for (int64_t p = first + 16 * (threadIdx.x & 31); p < last; p += 16 * kLanes) {
    const int bytes = piece_bytes(len - p);
    copy16_async(dst + (p - first), bytes ? src + p : src, bytes);
  }
}

// Words [from, to) (multiples of 8) into the ring; past n_words the ring gets zeros, never reads.
__device__ __forceinline__ void stage_words(uint16_t* ring, const uint8_t* words, int64_t from, int64_t to,
                                            int64_t n_words) {
  for (int64_t w = from + 8 * (threadIdx.x & 31); w < to; w += 8 * kLanes) {
    const int bytes = piece_bytes(2 * (n_words - w));
    copy16_async(ring + (w & (kRingWords - 1)), bytes ? words + 2 * w : words, bytes);
  }
}

// ---- decode lanes + join planes -------------------------------------------------------------------
// Global streaming stores: the decoded weights are not read again by this kernel.
__device__ __forceinline__ void store_out(uint16_t* p, uint16_t v) { __stcs(reinterpret_cast<unsigned short*>(p), v); }
__device__ __forceinline__ void store_out(uint32_t* p, uint32_t v) { __stcs(reinterpret_cast<unsigned int*>(p), v); }

// One chunk of kChunkSteps steps. Full chunks (all but a segment's last) run branch-free: the
// renormalising word is always read from the ring (which holds zeros past the segment's words)
// and selected, so the warp never diverges around its ballot.
template <int Dtype, int CtxBits, bool Full, typename Word>
__device__ __forceinline__ void decode_chunk(int base, int n, const uint8_t* hs, const uint16_t* ls,
                                             const DecodeTable* set, const uint16_t* ring, uint32_t& x,
                                             int& used, Word* out) {
  const int lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int k = 0; k < kChunkSteps; ++k) {
    const int j = base + k * kLanes + lane;
    const bool active = Full || j < n;
    const uint32_t h = hs[k * kLanes + lane];
    const DecodeTable& t = set[context(h, CtxBits, Dtype)];
    uint32_t xn = x;
    const uint32_t sym = rans_step(t.sym, t.freq_cum, xn);
    const bool need = active && xn < kRansL;                           // renormalise: one word
    const unsigned mask = __ballot_sync(kFullMask, need);
    const uint32_t w = ring[(used + __popc(mask & lanes_below)) & (kRingWords - 1)];
    x = need ? (xn << kRenormBits) | w : (active ? xn : x);
    used += __popc(mask);
    if (Full || active) {
      if constexpr (Dtype == kFP32)
        store_out(out + j, join32(sym, h, ls[k * kLanes + lane]));
      else
        store_out(out + j, join16(Dtype, sym, h));
    }
  }
}

// One warp, one segment. Indices within a segment fit 32 bits (<= 131072 symbols and words).
template <int Dtype, int CtxBits>
__device__ int decode_lanes(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, int64_t seg,
                            const DecodeTable* set, const Staging& st, void* out_base) {
  using Word = typename std::conditional<Dtype == kFP32, uint32_t, uint16_t>::type;
  const int lane = threadIdx.x & 31;
  const uint8_t* exp = data + d.exp_off;
  const uint8_t* hi = data + d.hi_off + seg * kSegmentSymbols;
  const uint8_t* lo = Dtype == kFP32 ? data + d.lo_off + 2 * seg * kSegmentSymbols : nullptr;
  const uint8_t* words = exp + ref.data + kStateBytes;
  Word* out = static_cast<Word*>(out_base) + seg * kSegmentSymbols;
  const int n = static_cast<int>(ref.symbols), n_words = static_cast<int>(ref.words);
  auto stage_chunk = [&](int c) {
    const int first = c * kChunkSymbols;
    stage_bytes(st.hi + (c & 1) * kChunkSymbols, hi, first, first + kChunkSymbols, n);
    if constexpr (Dtype == kFP32)
      stage_bytes(reinterpret_cast<uint8_t*>(st.lo + (c & 1) * kChunkSymbols), lo, 2 * first,
                  2 * (first + kChunkSymbols), 2 * n);
  };
  uint32_t x = load_le<uint32_t>(exp + ref.data + 4 * lane);
  int used = 0, loaded = 3 * kChunkSymbols;                          // the ring holds words [.., loaded)
  stage_chunk(0);
  stage_words(st.ring, words, 0, loaded, n_words);
  copies_commit();
  for (int c = 0; c * kChunkSymbols < n; ++c) {
    copies_wait();
    __syncwarp();
    // This chunk reads words [used, used + 256), chunk c+1 at most [.., used + 512): fill the ring
    // to round_down8(used) + 768, which overwrites only words before `used`.
    const int target = (used & ~7) + 3 * kChunkSymbols;
    if ((c + 1) * kChunkSymbols < n) stage_chunk(c + 1);
    if (target > loaded) stage_words(st.ring, words, loaded, target, n_words), loaded = target;
    copies_commit();
    const int base = c * kChunkSymbols;
    const uint8_t* hs = st.hi + (c & 1) * kChunkSymbols;
    const uint16_t* ls = st.lo + (c & 1) * kChunkSymbols;
    if (base + kChunkSymbols <= n)
      decode_chunk<Dtype, CtxBits, true>(base, n, hs, ls, set, st.ring, x, used, out);
    else
      decode_chunk<Dtype, CtxBits, false>(base, n, hs, ls, set, st.ring, x, used, out);
  }
  copies_wait();
  if (used != n_words) return kWords;
  return __all_sync(kFullMask, x == kRansL) ? kOk : kState;
}

template <int Dtype>
__device__ int decode_ctx(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, int64_t seg,
                          const DecodeTable* set, const Staging& st, void* out) {
  switch (d.ctx_bits) {
    case 0: return decode_lanes<Dtype, 0>(data, d, ref, seg, set, st, out);
    case 1: return decode_lanes<Dtype, 1>(data, d, ref, seg, set, st, out);
    default: return decode_lanes<Dtype, 2>(data, d, ref, seg, set, st, out);
  }
}

// One block = 4 warps = 4 consecutive segments of one tensor, which share one table set
// (table_group is a multiple of 4 or the whole tensor). `firsts` holds each tensor's first block.
__global__ void __launch_bounds__(32 * kWarpsPerBlock) decode_float_kernel(
    const uint8_t* __restrict__ data, const int64_t* __restrict__ desc, const int64_t* __restrict__ firsts,
    int64_t n_tensors, void* const* __restrict__ outs, int32_t* __restrict__ status, size_t staging_bytes) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int table_status;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Staging st = staging_of(smem + warp * staging_bytes);
  DecodeTable* set = reinterpret_cast<DecodeTable*>(smem + kWarpsPerBlock * staging_bytes);
  const int64_t b = blockIdx.x;
  int64_t lo = 0, hi = n_tensors - 1;                                // last tensor with first <= b
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (firsts[mid] <= b) lo = mid; else hi = mid - 1;
  }
  const TensorDesc d = load_desc(desc + lo * kDescFields);
  const uint8_t* exp = data + d.exp_off;
  const int64_t seg = (b - firsts[lo]) * kWarpsPerBlock + warp;
  const bool mine = seg < segment_count(d);                          // the tensor's last block may be short
  const int64_t seg0 = (b - firsts[lo]) * kWarpsPerBlock;            // the block's table set is seg0's
  if (threadIdx.x == 0) table_status = kOk;
  __syncthreads();
  SegmentRef ref0;
  int st0 = read_segment(exp, d.exp_len, d, seg0, &ref0);
  if (st0 == kOk && warp < (1 << d.ctx_bits)) st0 = build_decode_table(exp, d, ref0.table0 + warp, set + warp);
  if (st0 != kOk && lane == 0) atomicMax(&table_status, st0);
  __syncthreads();
  if (!mine) return;
  SegmentRef ref;
  int result = table_status != kOk ? table_status : read_segment(exp, d.exp_len, d, seg, &ref);
  if (result == kOk) {
    switch (d.dtype) {
      case kBF16: result = decode_ctx<kBF16>(data, d, ref, seg, set, st, outs[lo]); break;
      case kFP16: result = decode_ctx<kFP16>(data, d, ref, seg, set, st, outs[lo]); break;
      default: result = decode_ctx<kFP32>(data, d, ref, seg, set, st, outs[lo]); break;
    }
  }
  if (lane == 0) status[d.first_segment + seg] = result;
}

static at::Tensor decode_float_cuda(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                    int64_t n_segments) {
  const std::vector<TensorDesc> descs = check_args(data, desc, outputs, n_segments);
  const c10::cuda::CUDAGuard guard(data.device());
  at::Tensor status = at::empty({n_segments}, data.options().dtype(at::kInt));
  if (n_segments == 0) return status;
  int64_t max_ctx = 0, blocks = 0;
  bool fp32 = false;
  std::vector<int64_t> host(descs.size() * (kDescFields + 2));      // desc rows | first blocks | outputs
  const int64_t n = static_cast<int64_t>(descs.size());
  for (int64_t i = 0; i < n; ++i) {
    const TensorDesc& d = descs[i];
    TORCH_CHECK(d.table_group % kWarpsPerBlock == 0 || d.table_group >= segment_count(d),
                "table_group of row ", i, " must be a multiple of ", kWarpsPerBlock, " or cover the tensor");
    std::copy_n(desc.data_ptr<int64_t>() + i * kDescFields, kDescFields, host.begin() + i * kDescFields);
    host[n * kDescFields + i] = blocks;
    host[n * (kDescFields + 1) + i] = reinterpret_cast<int64_t>(outputs[i].data_ptr());
    blocks += (segment_count(d) + kWarpsPerBlock - 1) / kWarpsPerBlock;
    max_ctx = std::max(max_ctx, d.ctx_bits);
    fp32 = fp32 || d.dtype == kFP32;
  }
  at::Tensor meta = at::from_blob(host.data(), {static_cast<int64_t>(host.size())}, at::kLong)
                        .pin_memory().to(data.device(), /*non_blocking=*/true);
  const int64_t* m = meta.data_ptr<int64_t>();
  const size_t staging = fp32 ? kStagingBytesFP32 : kStagingBytes;
  const size_t smem = kWarpsPerBlock * staging + (sizeof(DecodeTable) << max_ctx);
  if (smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(decode_float_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  auto stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(blocks < (int64_t{1} << 31), "too many segments for one launch");
  decode_float_kernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, smem, stream>>>(
      data.data_ptr<uint8_t>(), m, m + n * kDescFields, n,
      reinterpret_cast<void* const*>(m + n * (kDescFields + 1)), status.data_ptr<int32_t>(), staging);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  meta.record_stream(stream);
  return status;
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) { m.impl("decode_float", &decode_float_cuda); }

}  // namespace wcodec
