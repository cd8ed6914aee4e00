// CUDA twin of decode_float.cpp: the same steps (read the directory -> build the decode tables ->
// decode lanes -> join planes), spread over threads. One warp decodes one unit -- a whole segment,
// or in kIndexed mode one piece of it started from the resident index (codec/resident.py) -- one
// lane per rANS state, in the lane/word order of docs/FORMAT.md §3. A block of 4, 8 or 16 warps
// decodes units that share a table set; it first builds that set's packed decode tables in shared
// memory (one u32 per slot, tables.build_lut's layout), so a step is one shared load, a few
// multiply-adds, and a ballot + popc that hands out the renormalisation words in lane order. Hi
// bytes are staged into shared memory one chunk (16 steps, or 8) ahead by cp.async, renormalisation
// words through a per-warp ring in shared memory (Lane). Archive data never traps: every read is
// bounded and each unit reports a status. Launches run on the current stream and allocate nothing:
// the caller owns the outputs, the index, the status and the device plan.
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
// Indexed pieces of entry_steps <= 1024 come 4 or more to a segment, so a block of 16 warps decodes
// 16 pieces of 1-4 segments of one table group with one table set: 4x the warps per shared-memory
// table, and 32 warps an SM where the tables of 4 warps had allowed 12.
constexpr int64_t kIndexedWarpsPerBlock = 16;
constexpr int kTableBuilders = 1 << kMaxCtxBits;   // warps that parse a block's tables (one each)
constexpr int kChunk = static_cast<int>(kMinEntrySteps);   // steps per unrolled sub-chunk
constexpr int kCumWords = 260;                     // per-table scratch: cum[257]
constexpr int kRingWords = 512;                    // a warp's ring of renormalisation words (Lane)
constexpr int kPieceWords = 8;                     // words topped up per 16-byte copy
constexpr int kMaxChunkSteps = 2 * kChunk;         // steps a chunk, at most (chunk_steps)
constexpr int kHiBufferBytes = kMaxChunkSteps * kLanes;    // one chunk's hi bytes
// Shared memory: the warps' word rings (warp w's at w * 1 KiB: 1 KiB-aligned, so a word's address
// is one OR), their two hi buffers each, the block's table status; the tables after. Before the
// tables are filled, the cums of their parse use the rings' room. 16 warps: 96 KiB with the tables
// of 2 context bits, 2 blocks an SM; 8 warps: 80 KiB, 2 blocks; 4 warps: 72 KiB, 3 blocks.
constexpr int kRingBytes = 2 * kRingWords;
constexpr int hi_offset(int warps) { return warps * kRingBytes; }
constexpr int status_offset(int warps) { return hi_offset(warps) + warps * 2 * kHiBufferBytes; }
constexpr int scratch_words(int warps) { return status_offset(warps) / 4 + 4; }   // the tables follow
static_assert(kTableBuilders * kCumWords <= status_offset(4) / 4, "the cums fit the rings' room");
constexpr size_t kTableBytes = sizeof(uint32_t) * kProbScale;

std::vector<TensorDesc> check_pieces_args(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                          const at::Tensor& entry_states, const at::Tensor& entry_words,
                                          const at::Tensor& status, int64_t mode, int64_t entry_steps);  // .cpp


// ---- decode lanes + join planes -------------------------------------------------------------------
template <int Dtype>
using WordOf = typename std::conditional<Dtype == kFP32, uint32_t, uint16_t>::type;

// One lane's view of the unit it decodes. The renormalisation words come from a per-warp ring of
// kRingWords words in shared memory, topped up by cp.async once a chunk (chunk_steps steps), never
// inside one: the words consumed since the last top-up (whole 16-byte pieces) are replaced by the
// ones that follow the ring. They are awaited one chunk later, with the next chunk's hi bytes. A
// sub-chunk of kChunk steps takes at most 32 words a step, so the words it may read have landed
// unless the ones before it took nearly all the ring held (`landed`): then it tops up and waits. The
// steps themselves hold no check and no branch: a shared load at wpos + (lanes below it that need
// a word). (Before, every step tested whether the ring needed a refill and whether the words had
// landed: a third of a step's instructions.)
struct Lane {
  uint32_t x;                      // rANS state
  int wpos;                        // words of the segment consumed (warp-uniform)
  int tail;                        // the ring holds words [tail, tail + kRingWords); a multiple of 8
};

// Steps a chunk: 16 for 16-bit elements (ncu: the ring top-up, the hi-byte copy and the loop cost
// 86 instructions a chunk, 11 a step at 8 steps); 8 where RECORD writes an index entry every 8
// steps or fp32 holds a chunk's lo values in registers.
template <int Dtype, bool Record>
constexpr int chunk_steps() { return Record || Dtype == kFP32 ? kChunk : kMaxChunkSteps; }

// cp.async of 16 bytes, the first `src_bytes` from global memory and the rest zeros (one
// instruction: __pipeline_memcpy_async's zero-fill takes a branch per size).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, int src_bytes) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(src_bytes) : "memory");
}

// The output element of a step from its packed table entry v (tables.build_lut: sym in bits
// 12-19) and the hi byte: join16 / join32 of v's symbol, with fewer instructions. The 16-bit
// results are exact in their low 16 bits (what the store writes): for bf16 the sign and mantissa
// come from hk * 0x101 (hk in both bytes), bits 7-14 from v >> 5.
template <int Dtype>
__device__ __forceinline__ uint32_t join_packed(uint32_t v, uint32_t hk, uint32_t lo) {
  if constexpr (Dtype == kBF16) {
    uint32_t r;                                                      // (a & 0x807F) | (b & ~0x807F): one LOP3
    asm("lop3.b32 %0, %1, %2, %3, 0xE2;" : "=r"(r) : "r"(hk * 0x101u), "n"(0x807F), "r"(v >> (kLutSymShift - 7)));
    return r;
  }
  else if constexpr (Dtype == kFP16) return ((v >> (kLutSymShift - 8)) & ~0xFFu) | hk;
  else return join32((v >> kLutSymShift) & 0xFF, hk, lo);
}

// The word at byte offset `at` (2 x its position in the segment) of the ring at shared address
// ring_s (1 KiB-aligned): one OR.
__device__ __forceinline__ uint32_t ring_word(uint32_t ring_s, uint32_t at) {
  unsigned short w;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(w) : "r"(ring_s | (at & (kRingBytes - 2))) : "memory");
  return w;
}

__device__ __forceinline__ uint32_t load_word(const uint16_t* words, int n_words, int pos) {
  return pos < n_words ? __ldg(words + pos) : 0u;                   // bounded: zeros past the end
}

// The unvectorised copies, out of line: inlined, the compiler hoisted their eight addresses out of
// the chunk loop, 16 registers that the 64-register kernel then spilled on every chunk.
__device__ __noinline__ void copy_words_slow(const uint16_t* words, int n_words, uint16_t* slot, int p) {
#pragma unroll
  for (int i = 0; i < kPieceWords; ++i) slot[i] = static_cast<uint16_t>(load_word(words, n_words, p + i));
}

__device__ __noinline__ void copy_hi_slow(const uint8_t* hi, int at, int n, uint8_t* dst, int bytes) {
  for (int i = 0; i < bytes; ++i) dst[i] = at + i < n ? hi[at + i] : 0;
}

// Request words [from, to) of the segment (multiples of kPieceWords, at most 32 pieces) into their
// ring slots: a lane a 16-byte piece by cp.async where the words are 16-byte aligned (`vec`),
// zero-filled past the segment's words; else loaded and stored at once.
__device__ __forceinline__ void request_words(const uint16_t* words, int n_words, bool vec, uint16_t* ring, int from,
                                              int to) {
  const int p = from + kPieceWords * (threadIdx.x & 31);
  if (p >= to) return;
  uint16_t* slot = ring + (p & (kRingWords - 1));
  if (vec && to <= n_words) {                                        // every piece whole (warp-uniform)
    __pipeline_memcpy_async(slot, words + p, 16);
  } else if (vec) {
    const int left = n_words - p, avail = left >= kPieceWords ? kPieceWords : left > 0 ? left : 0;
    copy16_async(slot, words + (avail ? p : 0), 2 * avail);
  } else {
    copy_words_slow(words, n_words, slot, p);
  }
}

// Top the ring up: request the words that follow it in place of the whole pieces consumed since the
// last top-up (at most 512 words, 64 pieces: a second request, rarely).
__device__ __forceinline__ void top_up(const uint16_t* words, int n_words, bool vec, uint16_t* ring, Lane& st) {
  const int tail = st.wpos & ~(kPieceWords - 1), from = st.tail + kRingWords, to = tail + kRingWords;
  request_words(words, n_words, vec, ring, from, to);
  if (to - from > kPieceWords * kLanes) request_words(words, n_words, vec, ring, from + kPieceWords * kLanes, to);
  st.tail = tail;
}

// The hi bytes of one chunk (Steps steps x 32 lanes, contiguous, from symbol `base`) into one of
// this warp's hi buffers, ahead of use: each lane copies Steps bytes with cp.async (no registers
// held, no wait until the chunk starts) where `fast` (the chunk lies in the segment and the plane is
// Steps-byte aligned), else byte by byte, zero past the segment's end. The caller commits.
template <int Steps>
__device__ __forceinline__ void stage_hi(const uint8_t* hi, bool fast, int base, int n, uint8_t* hr) {
  const int lane = threadIdx.x & 31, at = base + Steps * lane;
  if (fast) {
    __pipeline_memcpy_async(hr + Steps * lane, hi + at, Steps);
  } else {
    copy_hi_slow(hi, at, n, hr + Steps * lane, Steps);
  }
}

// The fp32 lo values of one chunk, loaded a chunk ahead into registers. Past the end: zero.
template <bool Full>
__device__ __forceinline__ void load_lo(const uint16_t* lo, int base, int n, uint32_t (&l)[kChunk]) {
  const int lane = threadIdx.x & 31;
  const uint16_t* lp = lo + (base + lane);
#pragma unroll
  for (int k = 0; k < kChunk; ++k) l[k] = Full || base + k * kLanes + lane < n ? __ldg(lp + k * kLanes) : 0u;
}

// The shared address of the packed table entry for state x and hi byte hk, in multiply-adds:
// lut_s + 16 KiB x context + 4 (x mod M) = lut_s + (hk & C) K + 4x - 16 KiB (x >> P), mod 2^32 (C
// holds the context bits of hk, K moves them to 16 KiB units). Written in PTX: the compiler would
// fold the last two back into a mask and a shift, ALU work, and the step was ALU-bound (ncu: the
// ALU pipe 68 % busy at 75 % of issue slots, the FMA pipe 36 %).
__device__ __forceinline__ uint32_t mad_lo(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

template <int Dtype, int CtxBits>
__device__ __forceinline__ uint32_t entry_address(uint32_t lut_s, uint32_t x, uint32_t q, uint32_t hk) {
  constexpr int shift = (Dtype == kFP16 ? 8 : 7) - CtxBits;       // context(): the lowest context bit of hk
  uint32_t base = lut_s;
  if constexpr (CtxBits > 0) base = mad_lo(hk & (((1u << CtxBits) - 1) << shift), (4u * kProbScale) >> shift, lut_s);
  return mad_lo(q, 0u - 4u * kProbScale, mad_lo(x, 4u, base));
}

// One renormalisation of a full step, in PTX so that the need predicate feeds both the ballot and a
// predicated multiply-add (x = x * 2^16 + word; a PRMT before, ALU work) and the count of lanes
// below comes from a multiply (mask * 2^(32 - lane): the bits below this lane, at the top). `at`:
// the words consumed, in bytes; ring_s: the 1 KiB-aligned ring.
__device__ __forceinline__ void renorm_full(uint32_t& x, uint32_t& at, uint32_t ring_s, uint32_t below_mul) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t.reg .b32 m, b, c, a, w;\n\t"
      "setp.lt.u32 p, %0, %4;\n\t"                                 // need: x < L
      "vote.sync.ballot.b32 m, p, -1;\n\t"
      "mul.lo.u32 b, m, %3;\n\t"
      "popc.b32 c, b;\n\t"
      "mad.lo.u32 a, c, 2, %1;\n\t"
      "and.b32 a, a, %5;\n\t"
      "or.b32 a, a, %2;\n\t"
      "ld.shared.u16 w, [a];\n\t"
      "@p mad.lo.u32 %0, %0, %6, w;\n\t"                          // x << 16 | w
      "popc.b32 c, m;\n\t"
      "mad.lo.u32 %1, c, 2, %1;\n\t}"
      : "+r"(x), "+r"(at)
      : "r"(ring_s), "r"(below_mul), "n"(kRansL), "n"(kRingBytes - 2), "n"(1u << kRenormBits)
      : "memory");
}

// One sub-chunk of kChunk steps, its words in the ring. `Full` sub-chunks (every step inside the
// unit and the segment) skip the end checks and renormalise in the multiply-add above; the others
// test `left`, this lane's symbols before the end. `hs` points at this lane's hi byte of the
// sub-chunk's first step, `o` at its output. Both look up and step alike.
template <int Dtype, int CtxBits, bool Full>
__device__ __forceinline__ void decode_chunk(const uint32_t* lut, uint32_t ring_s, int left, const uint8_t* hs,
                                             const uint32_t (&l)[kChunk], Lane& st, WordOf<Dtype>* o) {
  const int lane = threadIdx.x & 31;
  const unsigned lanes_below = (1u << lane) - 1u;
  const uint32_t below_mul = lane ? 1u << (32 - lane) : 0u;
  const uint32_t lut_s = static_cast<uint32_t>(__cvta_generic_to_shared(lut));
  uint32_t at = 2u * st.wpos;                                        // words consumed, in bytes: one LEA a word
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const uint32_t hk = hs[k * kLanes];
    uint32_t v, xn = st.x;
    asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(entry_address<Dtype, CtxBits>(lut_s, st.x, st.x >> kProbBits, hk)));
    rans_step_packed(v, xn);
    if constexpr (Full) {
      renorm_full(xn, at, ring_s, below_mul);
      st.x = xn;
    } else {
      const bool active = k * kLanes < left;
      const bool need = active && xn < kRansL;                         // renormalise: one word
      const unsigned mask = __ballot_sync(kFullMask, need);
      const uint32_t w = ring_word(ring_s, at + 2u * __popc(mask & lanes_below));   // every lane: no branch
      xn = need ? __byte_perm(w, xn, 0x5410) : xn;                     // (xn << 16) | w
      if (active) st.x = xn;
      at += 2u * __popc(mask);
      if (!active) continue;
    }
    if constexpr (Dtype == kFP32)
      __stcg(o + k * kLanes, join_packed<Dtype>(v, hk, l[k]));
    else
      __stcg(reinterpret_cast<unsigned short*>(o) + k * kLanes,
             static_cast<unsigned short>(join_packed<Dtype>(v, hk, 0)));
  }
  st.wpos = static_cast<int>(at >> 1);
}

struct Index {                      // the resident index (kRecord writes it, kIndexed reads it)
  uint32_t* states;                 // [entries, 32]
  uint32_t* words;                  // [entries]
};

// Decode steps [u.t0, u.t1) of one segment (Record: mode kRecord, writing the index as it goes; a
// template argument so that the other modes hold none of its registers). Returns the unit's status.
// hr: this warp's two hi buffers.
template <int Dtype, int CtxBits, bool Record>
__device__ int decode_unit(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u,
                           int64_t entry_steps, const uint32_t* lut, Index index, uint16_t* ring, uint8_t* hr,
                           void* out_base) {
  constexpr int Steps = chunk_steps<Dtype, Record>(), ChunkSymbols = Steps * kLanes;
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
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const bool vec = (reinterpret_cast<uintptr_t>(hi) & (Steps - 1)) == 0;
  const bool wvec = (reinterpret_cast<uintptr_t>(words) & 15) == 0;
  st.tail = st.wpos & ~(kPieceWords - 1);
  for (int i = 0; i < kRingWords; i += kPieceWords * kLanes)
    request_words(words, n_words, wvec, ring, st.tail + i, st.tail + kRingWords);
  uint32_t l[kChunk], ln[kChunk];
  const int t0 = static_cast<int>(u.t0), t1 = static_cast<int>(u.t1), end = min(n, t1 * kLanes);
  uint32_t* rec_states = nullptr;                                    // Record: this lane's entry states
  uint32_t* rec_words = nullptr;
  if constexpr (Record) {
    const int64_t e0 = record_entry(d, entry_steps, u.seg, 0);
    rec_states = index.states + e0 * kLanes + lane;
    rec_words = index.words + e0;
  }
  const int entry_mask = static_cast<int>(entry_steps) - 1;
  // Where the unit must end, loaded now: the loop holds no index registers.
  const bool to_entry = u.end_entry >= 0;
  const uint32_t want_x = to_entry ? index.states[u.end_entry * kLanes + lane] : kRansL;
  const uint32_t want_words = to_entry ? index.words[u.end_entry] : static_cast<uint32_t>(n_words);
  // One commit group a chunk: G_c = the words requested at chunk c and the hi bytes of chunk c + 1,
  // awaited when chunk c + 1 starts. The first group holds the ring's fill and chunk 0's hi bytes.
  // A chunk starting at step t: its hi bytes copy by cp.async when t + Steps <= hi_fast; its steps
  // run without end checks when t + Steps <= full_end (every symbol inside the unit and segment).
  const int hi_fast = vec ? n / kLanes : 0, full_end = min(t1, n / kLanes);
  stage_hi<Steps>(hi, t0 + Steps <= hi_fast, t0 * kLanes, n, hr);
  __pipeline_commit();
  if constexpr (Dtype == kFP32) load_lo<false>(lo, t0 * kLanes, n, l);
  int landed = 0;                                                    // the ring's words [.., landed) are in
  // Chunk c's start: its hi bytes and every word requested so far are in; top the ring up, stage
  // the next chunk's hi bytes into the other buffer, prefetch fp32 lo values, write RECORD's entry.
  auto begin_chunk = [&](int t, int c) {
    const int next = (t + Steps) * kLanes;
    __pipeline_wait_prior(0);
    __syncwarp();
    landed = st.tail + kRingWords;
    top_up(words, n_words, wvec, ring, st);
    if (t + Steps < t1) stage_hi<Steps>(hi, t + 2 * Steps <= hi_fast, next, n, hr + ((c + 1) & 1) * kHiBufferBytes);
    __pipeline_commit();
    if constexpr (Dtype == kFP32) {
      if (t + kChunk < t1) {
        if (next + kChunk * kLanes <= n) load_lo<true>(lo, next, n, ln);
        else load_lo<false>(lo, next, n, ln);
      }
    }
    if constexpr (Record) {
      if ((t & entry_mask) == 0) {                                   // an entry point of the index
        const int e = t / static_cast<int>(entry_steps);
        rec_states[e * kLanes] = st.x;
        if (lane == 0) rec_words[e] = static_cast<uint32_t>(st.wpos);
      }
    }
  };
  // Before each sub-chunk: rare, the steps before took nearly every word the ring held: top up, wait.
  auto ensure_words = [&]() {
    if (st.wpos + kChunk * kLanes > landed) {
      __syncwarp();                                                  // every lane has read the slots refilled
      top_up(words, n_words, wvec, ring, st);
      __pipeline_commit();
      __pipeline_wait_prior(0);
      __syncwarp();
      landed = st.tail + kRingWords;
    }
  };
  auto end_chunk = [&]() {
    if constexpr (Dtype == kFP32) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) l[k] = ln[k];
    }
  };
  int t = t0, c = 0;
  for (; t + Steps <= full_end; t += Steps, ++c) {                   // whole chunks: no end checks
    begin_chunk(t, c);
    const uint8_t* hs = hr + (c & 1) * kHiBufferBytes + lane;
    WordOf<Dtype>* o = out + t * kLanes + lane;
#pragma unroll
    for (int h = 0; h < Steps / kChunk; ++h) {
      ensure_words();
      decode_chunk<Dtype, CtxBits, true>(lut, ring_s, 0, hs + h * kChunk * kLanes, l, st, o + h * kChunk * kLanes);
    }
    end_chunk();
  }
  for (; t < t1; t += Steps, ++c) {                                  // the unit's short last chunk
    begin_chunk(t, c);
    const uint8_t* hs = hr + (c & 1) * kHiBufferBytes + lane;
    WordOf<Dtype>* o = out + t * kLanes + lane;
    for (int h = 0; h < Steps / kChunk; ++h) {
      const int at = (t + h * kChunk) * kLanes;
      if (at >= end) break;
      ensure_words();
      decode_chunk<Dtype, CtxBits, false>(lut, ring_s, end - at - lane, hs + h * kChunk * kLanes, l, st,
                                          o + h * kChunk * kLanes);
    }
    end_chunk();
  }
  __pipeline_wait_prior(0);                                          // no copy outlives the unit
  __syncwarp();
  if (static_cast<uint32_t>(st.wpos) != want_words) return kWords;
  return __all_sync(kFullMask, st.x == want_x) ? kOk : kState;
}

template <int Dtype, bool Record>
__device__ int decode_ctx(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u,
                          int64_t entry_steps, const uint32_t* lut, Index index, uint16_t* ring, uint8_t* hr,
                          void* out) {
  switch (d.ctx_bits) {
    case 0: return decode_unit<Dtype, 0, Record>(data, d, ref, u, entry_steps, lut, index, ring, hr, out);
    case 1: return decode_unit<Dtype, 1, Record>(data, d, ref, u, entry_steps, lut, index, ring, hr, out);
    default: return decode_unit<Dtype, 2, Record>(data, d, ref, u, entry_steps, lut, index, ring, hr, out);
  }
}

// The unit in mode `mode`: RECORD's index writes are a template argument (decode_unit).
template <int Dtype>
__device__ int decode_mode(const uint8_t* data, const TensorDesc& d, const SegmentRef& ref, const Unit& u,
                           int64_t mode, int64_t entry_steps, const uint32_t* lut, Index index, uint16_t* ring,
                           uint8_t* hr, void* out) {
  if (mode == kRecord) return decode_ctx<Dtype, true>(data, d, ref, u, entry_steps, lut, index, ring, hr, out);
  return decode_ctx<Dtype, false>(data, d, ref, u, entry_steps, lut, index, ring, hr, out);
}

// The device plan (cuda_ext/plan.py: device_plan): desc rows | first block of each tensor |
// output pointers, all int64.
struct DevicePlan {
  const int64_t* desc;
  const int64_t* firsts;
  void* const* outs;
  int64_t n;
};

// The most segments one block may span in a launch: blocks of whole segments must not straddle a
// table group (table_group is 4, 8, 16 or the whole tensor: the lowest power of two in it).
int64_t segment_span(const std::vector<TensorDesc>& descs) {
  int64_t span = int64_t{1} << 30;
  for (const TensorDesc& d : descs)
    if (d.table_group < segment_count(d)) span = std::min(span, d.table_group & -d.table_group);
  return span;
}

// Warps per block for a launch of `units` units on a GPU of `sms` multiprocessors (cuda_ext/plan.py:
// warps_per_block mirrors this): the larger of 16 and 8 whose blocks each lie in one segment or in
// whole segments of one table group, and still number one an SM or more; else 4. Big blocks share
// a table set among more warps; a small launch needs blocks on every SM more.
int64_t warps_per_block(int64_t mode, int64_t entry_steps, int64_t units, int64_t sms, int64_t span) {
  const int64_t per = pieces_per_segment(mode, entry_steps);
  for (const int64_t w : {kIndexedWarpsPerBlock, kIndexedWarpsPerBlock / 2})
    if ((per % w == 0 || (w % per == 0 && w / per <= span)) && units >= w * sms) return w;
  return kWarpsPerBlock;
}

// One block = W warps = W consecutive units of one tensor, which share one table set: they lie in
// one segment, or in whole segments of one table group (warps_per_block).
template <int W>
__global__ void __launch_bounds__(32 * W, W == kWarpsPerBlock ? 1 : 2) decode_kernel(
    const uint8_t* __restrict__ data, DevicePlan plan, Index index, int32_t* __restrict__ status, int64_t mode,
    int64_t entry_steps) {
  extern __shared__ __align__(1024) uint32_t smem[];  // rings | hi buffers | status, then the tables
  static_assert(W <= kIndexedWarpsPerBlock, "the rings fit the scratch");
  int& table_status = reinterpret_cast<int*>(smem)[status_offset(W) / 4];
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
  uint32_t* luts = smem + scratch_words(W);
  if (table_status == kOk) {                                         // ... and fill, every warp a region
    const uint32_t run = (kProbScale << d.ctx_bits) / W, first = warp * run, t = first / kProbScale;
    fill_region(smem + t * kCumWords, luts + t * kProbScale, first % kProbScale, first % kProbScale + run);
  }
  __syncthreads();                                                   // tables ready; the scratch is the rings'
  if (!mine) return;
  const Unit un = unit_of(d, mode, entry_steps, u);
  uint16_t* ring = reinterpret_cast<uint16_t*>(reinterpret_cast<uint8_t*>(smem) + warp * kRingBytes);
  uint8_t* hr = reinterpret_cast<uint8_t*>(smem) + hi_offset(W) + warp * 2 * kHiBufferBytes;
  SegmentRef ref;
  int result = table_status != kOk ? table_status : read_segment(exp, d.exp_len, d, un.seg, &ref);
  if (result == kOk) {
    switch (d.dtype) {
      case kBF16:
        result = decode_mode<kBF16>(data, d, ref, un, mode, entry_steps, luts, index, ring, hr, plan.outs[lo]);
        break;
      case kFP16:
        result = decode_mode<kFP16>(data, d, ref, un, mode, entry_steps, luts, index, ring, hr, plan.outs[lo]);
        break;
      default:
        result = decode_mode<kFP32>(data, d, ref, un, mode, entry_steps, luts, index, ring, hr, plan.outs[lo]);
        break;
    }
  }
  if (lane == 0) status[un.status] = result;
}

// The kernel for blocks of `warps` warps (one of warps_per_block's answers).
static auto kernel_for(int64_t warps) {
  return warps == kIndexedWarpsPerBlock       ? decode_kernel<kIndexedWarpsPerBlock>
         : warps == kIndexedWarpsPerBlock / 2 ? decode_kernel<kIndexedWarpsPerBlock / 2>
                                              : decode_kernel<kWarpsPerBlock>;
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
  int64_t units = 0, max_ctx = 0;
  for (const TensorDesc& d : descs) {
    TORCH_CHECK(d.table_group % kWarpsPerBlock == 0 || d.table_group >= segment_count(d),
                "table_group must be a multiple of ", kWarpsPerBlock, " or cover the tensor");
    units += unit_count(d, mode, entry_steps);
    max_ctx = std::max(max_ctx, d.ctx_bits);
  }
  const c10::cuda::CUDAGuard guard(data.device());
  static int sms[64] = {};                                           // per device: SM count, attributes set
  const int dev = data.get_device();
  int count = dev < 64 ? sms[dev] : 0;
  if (!count) {
    const int most = static_cast<int>((kTableBytes << kMaxCtxBits) + scratch_words(kIndexedWarpsPerBlock) * 4);
    for (const int64_t w : {int64_t{kWarpsPerBlock}, kIndexedWarpsPerBlock / 2, kIndexedWarpsPerBlock})
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel_for(w), cudaFuncAttributeMaxDynamicSharedMemorySize, most));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    if (dev < 64) sms[dev] = count;
  }
  const int64_t warps = warps_per_block(mode, entry_steps, units, count, segment_span(descs));
  int64_t blocks = 0;
  for (const TensorDesc& d : descs) blocks += (unit_count(d, mode, entry_steps) + warps - 1) / warps;
  if (blocks == 0) return;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "too many units for one launch");
  const size_t smem = (kTableBytes << max_ctx) + scratch_words(static_cast<int>(warps)) * sizeof(uint32_t);
  const int64_t* p = plan.data_ptr<int64_t>();
  const DevicePlan dp{p, p + n * kDescFields, reinterpret_cast<void* const*>(p + n * (kDescFields + 1)), n};
  const Index index{mode == kBulk ? nullptr : reinterpret_cast<uint32_t*>(entry_states.data_ptr()),
                    mode == kBulk ? nullptr : reinterpret_cast<uint32_t*>(entry_words.data_ptr())};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const unsigned grid = static_cast<unsigned>(blocks);
  kernel_for(warps)<<<grid, static_cast<unsigned>(32 * warps), smem, stream>>>(
      data.data_ptr<uint8_t>(), dp, index, status.data_ptr<int32_t>(), mode, entry_steps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) { m.impl("decode_pieces", &decode_pieces_cuda); }

}  // namespace wcodec
