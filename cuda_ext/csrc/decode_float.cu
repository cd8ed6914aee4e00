// CUDA twin of decode_float.cpp: the same steps (read the directory -> build the decode tables ->
// decode lanes -> join planes), spread over threads. One warp decodes one unit -- a whole segment,
// or in kIndexed mode one piece of it started from the resident index (codec/resident.py) -- one
// lane per rANS state, in the lane/word order of docs/FORMAT.md §3. A block of 4 warps decodes 4
// units that share a table set; it first builds that set's packed decode tables in shared memory
// (one u32 per slot, tables.build_lut's layout), so a step is one shared load, a multiply-add, and
// a ballot + popc that hands out the renormalisation words in lane order. Hi bytes are staged into
// shared memory one chunk of 8 steps ahead (cp.async), renormalisation words through a per-warp
// ring in shared memory (Lane). Archive data
// never traps: every read is bounded and each unit reports a status. Launches run on the current
// stream and allocate nothing: the caller owns the outputs, the index, the status and the device plan.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_pipeline.h>

#include <algorithm>
#include <vector>

#include "decode_common.h"
#include "decode_table.cuh"

namespace wcodec {

constexpr int kWarpsPerBlock = 4;                  // = TABLE_GROUP_QUANTUM: one table set per block
// Indexed pieces of entry_steps <= 512 come 8 (or more) to a segment, so a block of 8 warps
// decodes 8 pieces of one segment with one table set: 2x the warps per shared-memory table.
constexpr int kIndexedWarpsPerBlock = 8;
constexpr int kTableBuilders = 1 << kMaxCtxBits;   // warps that parse a block's tables (one each)
constexpr int kChunk = static_cast<int>(kMinEntrySteps);   // steps per unrolled chunk
constexpr int kCumWords = 260;                     // per-table scratch: cum[257]
constexpr int kRingWords = 256;                    // a warp's ring of renormalisation words (Lane)
constexpr int kHiChunkBytes = kChunk * kLanes;     // one chunk's hi bytes; a warp's hi ring holds two
constexpr int kWarpRingBytes = 2 * kRingWords + 2 * kHiChunkBytes;
constexpr int kScratchWords =                      // u32: the tables' cums, later the warps' rings
    std::max(kTableBuilders * kCumWords, kIndexedWarpsPerBlock * kWarpRingBytes / 4);
constexpr size_t kTableBytes = sizeof(uint32_t) * kProbScale;

std::vector<TensorDesc> check_pieces_args(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                          const at::Tensor& entry_states, const at::Tensor& entry_words,
                                          const at::Tensor& status, int64_t mode, int64_t entry_steps);  // .cpp


// ---- decode lanes + join planes -------------------------------------------------------------------
template <int Dtype>
using WordOf = typename std::conditional<Dtype == kFP32, uint32_t, uint16_t>::type;

// One lane's view of the unit it decodes. The renormalisation words come from a per-warp ring of
// kRingWords words in shared memory holding words [fill, fill + kRingWords) of the segment (fill a
// multiple of 32, wpos < fill + 32 between steps): a step takes at most 32 words, all inside the
// ring, each lane the one at wpos + (lanes below it that need one) with one shared load. Each 32
// consumed words, the 32 that follow the ring are requested into the freed slot by cp.async, with
// no register and no wait: they are committed with the next chunk's hi bytes and have landed when
// the chunk after that starts (`landed`). A step that would read past `landed` (only when words
// are consumed far faster than usual) waits for every copy first. (Before, the next refill's
// words were loaded into a register whose select and move waited on the load at once: ncu put 30 %
// of a layer's stall samples on them.)
struct Lane {
  uint32_t x;                      // rANS state
  int wpos;                        // words of the segment consumed (warp-uniform)
  int fill;                        // first word in the ring (warp-uniform)
  int landed;                      // words [.., landed) are in the ring (warp-uniform)
  int committed;                   // what `landed` becomes once the copies committed so far are in
};

__device__ __forceinline__ uint32_t load_word(const uint16_t* words, int n_words, int pos) {
  return pos < n_words ? __ldg(words + pos) : 0u;                   // bounded: zeros past the end
}

__device__ __forceinline__ void fill_ring(const uint16_t* words, int n_words, uint16_t* ring, Lane& st) {
  const int lane = threadIdx.x & 31;
  st.fill = st.wpos & ~31;
#pragma unroll
  for (int i = 0; i < kRingWords; i += 32)
    ring[(st.fill + i + lane) & (kRingWords - 1)] = static_cast<uint16_t>(load_word(words, n_words, st.fill + i + lane));
  st.landed = st.committed = st.fill + kRingWords;
  __syncwarp();
}

// Request words [fill + kRingWords, + 32) into the slot of [fill, fill + 32), now consumed: lanes
// 0-15 copy two words each by cp.async, zero-filled past the segment's words (words 4-byte aligned:
// `vec`), else one word a lane, loaded and stored at once.
__device__ __forceinline__ void refill(const uint16_t* words, int n_words, bool vec, uint16_t* ring, Lane& st) {
  const int lane = threadIdx.x & 31, pos = st.fill + kRingWords;
  uint16_t* slot = ring + (st.fill & (kRingWords - 1));
  if (vec) {
    if (lane < 16) {
      const int at = pos + 2 * lane, left = n_words - at, avail = left >= 2 ? 2 : left > 0 ? left : 0;
      __pipeline_memcpy_async(slot + 2 * lane, words + (avail ? at : 0), 4, 4 - 2 * avail);
    }
  } else {
    __syncwarp();                                                    // every lane has read its word
    slot[lane] = static_cast<uint16_t>(load_word(words, n_words, pos + lane));
  }
  st.fill += 32;
}

// Wait for every copy requested so far: the ring is whole.
__device__ __forceinline__ void land_all(Lane& st) {
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncwarp();
  st.landed = st.committed = st.fill + kRingWords;
}

// The hi bytes of one chunk (kChunk steps x 32 lanes, 256 contiguous bytes) into this warp's
// hi ring, a chunk ahead of use: each lane copies 8 bytes with cp.async (no registers held, no
// wait until the chunk is needed), or byte by byte, zero past the segment's end, where the chunk
// is short or the plane is not 8-byte aligned. The caller waits and syncs the warp before reading.
__device__ __forceinline__ void stage_hi(const uint8_t* hi, bool vec, int base, int n, uint8_t* hr) {
  const int lane = threadIdx.x & 31, at = base + 8 * lane;
  if (vec && base + kHiChunkBytes <= n) {
    __pipeline_memcpy_async(hr + 8 * lane, hi + at, 8);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) hr[8 * lane + i] = at + i < n ? hi[at + i] : 0;
  }
  __pipeline_commit();
}

// The fp32 lo values of one chunk, loaded a chunk ahead into registers. Past the end: zero.
template <bool Full>
__device__ __forceinline__ void load_lo(const uint16_t* lo, int base, int n, uint32_t (&l)[kChunk]) {
  const int lane = threadIdx.x & 31;
  const uint16_t* lp = lo + (base + lane);
#pragma unroll
  for (int k = 0; k < kChunk; ++k) l[k] = Full || base + k * kLanes + lane < n ? __ldg(lp + k * kLanes) : 0u;
}

// One chunk of kChunk steps. `Full` chunks (every symbol inside the segment) skip the end checks.
template <int Dtype, int CtxBits, bool Full>
__device__ __forceinline__ void decode_chunk(const uint32_t* lut, const uint16_t* words, int n_words, bool vec,
                                             uint16_t* ring, int base, int n, const uint8_t* hr,
                                             const uint32_t (&l)[kChunk], Lane& st, WordOf<Dtype>* out) {
  const int lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
  uint32_t hc[kChunk];                                               // the chunk's hi bytes, read up front
#pragma unroll
  for (int k = 0; k < kChunk; ++k) hc[k] = hr[k * kLanes + lane];
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const int j = base + k * kLanes + lane;
    const bool active = Full || j < n;
    if (st.wpos + 32 > st.landed) land_all(st);                       // warp-uniform; rare
    uint32_t xn = st.x;
    const uint32_t hk = hc[k];
    const uint32_t sym = rans_step_packed(lut[(context(hk, CtxBits, Dtype) << kProbBits) | (st.x & (kProbScale - 1))], xn);
    const bool need = active && xn < kRansL;                           // renormalise: one word
    const unsigned mask = __ballot_sync(kFullMask, need);
    if (need) xn = (xn << kRenormBits) | ring[(st.wpos + __popc(mask & lanes_below)) & (kRingWords - 1)];
    if (Full || active) st.x = xn;
    st.wpos += __popc(mask);
    if (st.wpos - st.fill >= 32) {                                    // warp-uniform: refill 32 words
      __syncwarp();                                                   // every lane has read its word
      refill(words, n_words, vec, ring, st);
      __syncwarp();
    }
    if (Full || active) {
      if constexpr (Dtype == kFP32)
        __stcg(out + j, join32(sym, hk, l[k]));
      else
        __stcg(reinterpret_cast<unsigned short*>(out) + j, join16(Dtype, sym, hk));
    }
  }
}

struct Index {                      // the resident index (kRecord writes it, kIndexed reads it)
  uint32_t* states;                 // [entries, 32]
  uint32_t* words;                  // [entries]
};

// Decode steps [u.t0, u.t1) of one segment. Returns the unit's status.
template <int Dtype, int CtxBits>
__device__ int decode_unit(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u,
                           int64_t mode, int64_t entry_steps, const uint32_t* lut, Index index, uint16_t* ring,
                           void* out_base) {
  const int lane = threadIdx.x & 31;
  const uint8_t* exp = data + d.exp_off;
  const int64_t seg0 = u.seg * kSegmentSymbols;
  const uint8_t* hi = data + d.hi_off + seg0;
  const uint16_t* lo = Dtype == kFP32 ? reinterpret_cast<const uint16_t*>(data + d.lo_off) + seg0 : nullptr;
  const uint16_t* words = reinterpret_cast<const uint16_t*>(exp + ref.data + kStateBytes);
  WordOf<Dtype>* out = static_cast<WordOf<Dtype>*>(out_base) + seg0;
  const int n = static_cast<int>(ref.symbols), n_words = static_cast<int>(ref.words);
  if (u.t0 >= u.t1) return kOk;                                      // a piece past a short segment's end
  Lane st;
  if (u.entry >= 0) {
    st.x = index.states[u.entry * kLanes + lane];
    st.wpos = static_cast<int>(min(index.words[u.entry], 1u << 30));
  } else {
    st.x = load_le<uint32_t>(exp + ref.data + 4 * lane);
    st.wpos = 0;
  }
  fill_ring(words, n_words, ring, st);
  uint8_t* hring = reinterpret_cast<uint8_t*>(ring + kRingWords);   // two chunks' hi bytes
  const bool vec = (reinterpret_cast<uintptr_t>(hi) & 7) == 0, wvec = (reinterpret_cast<uintptr_t>(words) & 3) == 0;
  uint32_t l[kChunk], ln[kChunk];
  const int t0 = static_cast<int>(u.t0), t1 = static_cast<int>(u.t1);
  stage_hi(hi, vec, t0 * kLanes, n, hring);
  if constexpr (Dtype == kFP32) load_lo<false>(lo, t0 * kLanes, n, l);
  __pipeline_wait_prior(0);
  __syncwarp();
  for (int t = t0, c = 0; t < t1; t += kChunk, c ^= 1) {
    const int base = t * kLanes, next = base + kChunk * kLanes;
    if (t + kChunk < t1) {
      stage_hi(hi, vec, next, n, hring + (c ^ 1) * kHiChunkBytes);     // commits the words requested so far too
      st.committed = st.fill + kRingWords;
      if constexpr (Dtype == kFP32) {
        if (next + kChunk * kLanes <= n) load_lo<true>(lo, next, n, ln);
        else load_lo<false>(lo, next, n, ln);
      }
    }
    if (mode == kRecord && t % entry_steps == 0) {                   // an entry point of the index
      const int64_t e = record_entry(d, entry_steps, u.seg, t);
      index.states[e * kLanes + lane] = st.x;
      if (lane == 0) index.words[e] = static_cast<uint32_t>(st.wpos);
    }
    const uint8_t* hr = hring + c * kHiChunkBytes;
    if (next <= n)
      decode_chunk<Dtype, CtxBits, true>(lut, words, n_words, wvec, ring, base, n, hr, l, st, out);
    else
      decode_chunk<Dtype, CtxBits, false>(lut, words, n_words, wvec, ring, base, n, hr, l, st, out);
    if constexpr (Dtype == kFP32) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) l[k] = ln[k];
    }
    __pipeline_wait_prior(0);                                        // the next chunk's hi bytes are in,
    __syncwarp();                                                    // and every lane is done with this one
    st.landed = st.committed;
  }
  __pipeline_commit();                                               // no copy outlives the unit
  __pipeline_wait_prior(0);
  const bool to_entry = u.end_entry >= 0;
  const uint32_t want_x = to_entry ? index.states[u.end_entry * kLanes + lane] : kRansL;
  const int64_t want_words = to_entry ? static_cast<int64_t>(index.words[u.end_entry]) : ref.words;
  if (st.wpos != want_words) return kWords;
  return __all_sync(kFullMask, st.x == want_x) ? kOk : kState;
}

template <int Dtype>
__device__ int decode_ctx(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u,
                          int64_t mode, int64_t entry_steps, const uint32_t* lut, Index index, uint16_t* ring,
                          void* out) {
  switch (d.ctx_bits) {
    case 0: return decode_unit<Dtype, 0>(data, d, ref, u, mode, entry_steps, lut, index, ring, out);
    case 1: return decode_unit<Dtype, 1>(data, d, ref, u, mode, entry_steps, lut, index, ring, out);
    default: return decode_unit<Dtype, 2>(data, d, ref, u, mode, entry_steps, lut, index, ring, out);
  }
}

// The device plan (cuda_ext/plan.py: device_plan): desc rows | first block of each tensor |
// output pointers, all int64.
struct DevicePlan {
  const int64_t* desc;
  const int64_t* firsts;
  void* const* outs;
  int64_t n;
};

// Warps per block for a launch: kIndexedWarpsPerBlock when every block of them holds pieces of one
// segment (cuda_ext/plan.py: warps_per_block mirrors this), else kWarpsPerBlock.
int64_t warps_per_block(int64_t mode, int64_t entry_steps) {
  return pieces_per_segment(mode, entry_steps) % kIndexedWarpsPerBlock == 0 ? kIndexedWarpsPerBlock : kWarpsPerBlock;
}

// One block = W warps = W consecutive units of one tensor, which share one table set (W = 4:
// table_group is a multiple of 4 or the whole tensor, and a segment's pieces are a multiple of 4
// or 1; W = 8: the units are pieces of one segment).
template <int W>
__global__ void __launch_bounds__(32 * W, W == kWarpsPerBlock ? 1 : 3) decode_kernel(
    const uint8_t* __restrict__ data, DevicePlan plan, Index index, int32_t* __restrict__ status, int64_t mode,
    int64_t entry_steps) {
  extern __shared__ __align__(16) uint32_t smem[];  // scratch: cum [4][260], then the warps' rings | tables
  static_assert(W * kWarpRingBytes <= 4 * kScratchWords, "the rings fit the scratch");
  __shared__ int table_status;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.x;
  const int64_t lo = plan_row(plan.firsts, plan.n, b);
  const TensorDesc d = load_desc(plan.desc + lo * kDescFields);
  const uint8_t* exp = data + d.exp_off;
  const int64_t u0 = (b - plan.firsts[lo]) * W, u = u0 + warp;
  const bool mine = u < unit_count(d, mode, entry_steps);            // the tensor's last block may be short
  if (threadIdx.x == 0) table_status = kOk;
  __syncthreads();
  SegmentRef ref0;                                                   // the block's table set: parse
  int st0 = read_segment(exp, d.exp_len, d, unit_of(d, mode, entry_steps, u0).seg, &ref0);
  if (st0 == kOk && warp < (1 << d.ctx_bits)) st0 = parse_cum(exp, d, ref0.table0 + warp, smem + warp * kCumWords);
  if (st0 != kOk && lane == 0) atomicMax(&table_status, st0);
  __syncthreads();
  uint32_t* luts = smem + kScratchWords;
  if (table_status == kOk) {                                         // ... and fill, every thread a run
    const uint32_t run = (kProbScale << d.ctx_bits) / (32 * W), first = threadIdx.x * run, t = first / kProbScale;
    fill_lut(smem + t * kCumWords, luts + t * kProbScale, first % kProbScale, first % kProbScale + run);
  }
  __syncthreads();                                                   // tables ready; the scratch is the rings'
  if (!mine) return;
  const Unit un = unit_of(d, mode, entry_steps, u);
  uint16_t* ring = reinterpret_cast<uint16_t*>(reinterpret_cast<uint8_t*>(smem) + warp * kWarpRingBytes);
  SegmentRef ref;
  int result = table_status != kOk ? table_status : read_segment(exp, d.exp_len, d, un.seg, &ref);
  if (result == kOk) {
    switch (d.dtype) {
      case kBF16: result = decode_ctx<kBF16>(data, d, ref, un, mode, entry_steps, luts, index, ring, plan.outs[lo]); break;
      case kFP16: result = decode_ctx<kFP16>(data, d, ref, un, mode, entry_steps, luts, index, ring, plan.outs[lo]); break;
      default: result = decode_ctx<kFP32>(data, d, ref, un, mode, entry_steps, luts, index, ring, plan.outs[lo]); break;
    }
  }
  if (lane == 0) status[un.status] = result;
}

static void decode_pieces_cuda(const at::Tensor& data, const at::Tensor& desc, const at::Tensor& plan,
                               at::TensorList outputs, const at::Tensor& entry_states, const at::Tensor& entry_words,
                               const at::Tensor& status, int64_t mode, int64_t entry_steps) {
  const std::vector<TensorDesc> descs =
      check_pieces_args(data, desc, outputs, entry_states, entry_words, status, mode, entry_steps);
  const int64_t n = static_cast<int64_t>(descs.size());
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.device() == data.device() && plan.is_contiguous() &&
                  plan.numel() == n * (kDescFields + 2),
              "plan must be the device plan of desc (cuda_ext.plan.device_plan), on data's device");
  const int64_t warps = warps_per_block(mode, entry_steps);
  int64_t blocks = 0, max_ctx = 0;
  for (const TensorDesc& d : descs) {
    TORCH_CHECK(d.table_group % kWarpsPerBlock == 0 || d.table_group >= segment_count(d),
                "table_group must be a multiple of ", kWarpsPerBlock, " or cover the tensor");
    blocks += (unit_count(d, mode, entry_steps) + warps - 1) / warps;
    max_ctx = std::max(max_ctx, d.ctx_bits);
  }
  if (blocks == 0) return;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "too many units for one launch");
  const c10::cuda::CUDAGuard guard(data.device());
  const size_t smem = (kTableBytes << max_ctx) + kScratchWords * sizeof(uint32_t);
  static bool attr_set[64] = {};                                     // per device: the largest case
  const int dev = data.get_device();
  if (dev >= 64 || !attr_set[dev]) {
    const int most = static_cast<int>((kTableBytes << kMaxCtxBits) + kScratchWords * 4);
    C10_CUDA_CHECK(cudaFuncSetAttribute(decode_kernel<kWarpsPerBlock>, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
    C10_CUDA_CHECK(cudaFuncSetAttribute(decode_kernel<kIndexedWarpsPerBlock>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, most));
    if (dev < 64) attr_set[dev] = true;
  }
  const int64_t* p = plan.data_ptr<int64_t>();
  const DevicePlan dp{p, p + n * kDescFields, reinterpret_cast<void* const*>(p + n * (kDescFields + 1)), n};
  const Index index{mode == kBulk ? nullptr : reinterpret_cast<uint32_t*>(entry_states.data_ptr()),
                    mode == kBulk ? nullptr : reinterpret_cast<uint32_t*>(entry_words.data_ptr())};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned grid = static_cast<unsigned>(blocks);
  if (warps == kIndexedWarpsPerBlock)
    decode_kernel<kIndexedWarpsPerBlock><<<grid, 32 * kIndexedWarpsPerBlock, smem, stream>>>(
        data.data_ptr<uint8_t>(), dp, index, status.data_ptr<int32_t>(), mode, entry_steps);
  else
    decode_kernel<kWarpsPerBlock><<<grid, 32 * kWarpsPerBlock, smem, stream>>>(
        data.data_ptr<uint8_t>(), dp, index, status.data_ptr<int32_t>(), mode, entry_steps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) { m.impl("decode_pieces", &decode_pieces_cuda); }

}  // namespace wcodec
