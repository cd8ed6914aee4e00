// CUDA twin of decode_quant.cpp (the same steps, spread over threads).
//   decode_bytes       one warp per segment, a block of 4 warps per 4 consecutive segments of one
//                      plane, which share one table (table_group is a multiple of 4 or covers the
//                      plane); the block builds it in shared memory as packed u32 entries
//                      (tables.build_lut's layout). A step: one shared load, a multiply-add, and a
//                      ballot + popc that hands out the renormalisation words in lane order
//                      (docs/FORMAT.md §3); the symbol is the output byte. Steps run in unrolled
//                      chunks of 8, as decode_float.cu's.
//   dequantize_blocks  a block of 256 threads per 4096 weights: join the planes of its GGUF blocks
//                      in shared memory (coalesced reads; a plane's width is a compile-time
//                      constant), then one thread per run of 8 weights (gguf_blocks.h
//                      dequantize_run: the block's scales read once; PTX mul.rn, never fused or
//                      flushed; NaNs as x86 gives them), stored as one 16-byte vector (bf16/f16).
//   reconstruct_int8   one thread per 16 x 16 tile (int8_tiles.h), each tile row loaded and stored
//                      as 16-byte vectors where aligned.
// Archive data never traps: every read is bounded and each segment reports a status. Launches run
// on the current stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "decode_common.h"
#include "decode_table.cuh"
#include "gguf_blocks.h"
#include "int8_tiles.h"

namespace wcodec {

std::vector<TensorDesc> check_bytes_args(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                                         const at::Tensor& status);                                       // .cpp
const gguf::BlockLayout& check_blocks_args(at::TensorList planes, int64_t ggml_type, at::TensorList outs);  // .cpp

namespace {

constexpr int kWarps = 4;                                 // = TABLE_GROUP_QUANTUM


// ---- decode lanes: one segment -----------------------------------------------------------------------
constexpr int kChunk = static_cast<int>(kMinEntrySteps);            // steps per unrolled chunk

// One chunk of kChunk steps. `Full` chunks (every symbol inside the segment) skip the end checks.
template <bool Full>
__device__ __forceinline__ void decode_byte_chunk(const uint32_t* lut, const uint16_t* words, int n_words, int base,
                                                  int n, uint32_t& x, int& wpos, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const int j = base + k * kLanes + lane;
    const bool active = Full || j < n;
    uint32_t xn = x;
    const uint32_t sym = rans_step_packed(lut[x & (kProbScale - 1)], xn);     // x = D(x)
    const bool need = active && xn < kRansL;                                   // renormalise: one word
    const unsigned mask = __ballot_sync(kFullMask, need);
    const int pos = wpos + __popc(mask & below);
    const uint32_t w = (need && pos < n_words) ? __ldg(words + pos) : 0u;       // bounded: zeros past the end
    x = need ? (xn << kRenormBits) | w : (active ? xn : x);
    wpos += __popc(mask);
    if (Full || active) out[j] = static_cast<uint8_t>(sym);
  }
}

__device__ int decode_segment(const uint8_t* exp, const SegmentRef& ref, const uint32_t* lut, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  if (ref.words > ref.symbols) return kWords;       // a step takes at most one word a lane: never decodable
  const uint16_t* words = reinterpret_cast<const uint16_t*>(exp + ref.data + kStateBytes);
  const int n = static_cast<int>(ref.symbols), n_words = static_cast<int>(ref.words);
  uint32_t x = load_le<uint32_t>(exp + ref.data + 4 * lane);
  int wpos = 0;
  for (int base = 0; base < n; base += kChunk * kLanes) {
    if (base + kChunk * kLanes <= n)
      decode_byte_chunk<true>(lut, words, n_words, base, n, x, wpos, out);
    else
      decode_byte_chunk<false>(lut, words, n_words, base, n, x, wpos, out);
  }
  if (wpos != n_words) return kWords;
  return __all_sync(kFullMask, x == kRansL) ? kOk : kState;
}

struct BytesPlan {                 // desc rows | first block of each row | output pointers (int64)
  const int64_t* desc;
  const int64_t* firsts;
  const int64_t* outs;
  int64_t n;
};

__global__ void __launch_bounds__(32 * kWarps) decode_bytes_kernel(const uint8_t* __restrict__ data, BytesPlan plan,
                                                                    int32_t* __restrict__ status) {
  __shared__ __align__(16) uint32_t lut[kProbScale];
  __shared__ uint32_t cum[260];
  __shared__ int table_status;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.x;
  const int64_t lo = plan_row(plan.firsts, plan.n, b);
  const TensorDesc d = load_desc(plan.desc + lo * kDescFields);
  const uint8_t* exp = data + d.exp_off;
  const int64_t seg0 = (b - plan.firsts[lo]) * kWarps, seg = seg0 + warp;
  if (threadIdx.x == 0) table_status = kOk;
  __syncthreads();
  if (warp == 0) {
    SegmentRef ref0;
    int st = read_segment(exp, d.exp_len, d, seg0, &ref0);
    if (st == kOk) st = build_decode_table(exp, d, ref0.table0, lut, cum);
    if (lane == 0) table_status = st;
  }
  __syncthreads();
  if (seg >= segment_count(d)) return;
  SegmentRef ref;
  int result = table_status != kOk ? table_status : read_segment(exp, d.exp_len, d, seg, &ref);
  if (result == kOk)
    result = decode_segment(exp, ref, lut, reinterpret_cast<uint8_t*>(plan.outs[lo]) + seg * kSegmentSymbols);
  if (lane == 0) status[d.first_segment + seg] = result;
}

constexpr int kDqThreads = 256;
constexpr int kDqWeights = 4096;                          // weights per block of threads: 16 a thread
constexpr int kDqBytes = kDqWeights / 32 * 34;           // their block bytes at most (Q8_0: 34 per 32)
constexpr int kDqRun = 8;                                 // weights a thread dequantizes at once

struct Planes {
  const uint8_t* p[gguf::kMaxPlanes];
};

// Plane bytes [0, nb * W) -> bytes [start, start + W) of each of nb blocks in shared memory.
template <int W>
__device__ __forceinline__ void join_plane(const uint8_t* src, int nb, int type_size, int start, uint8_t* blocks) {
  for (int i = threadIdx.x; i < nb * W; i += kDqThreads) blocks[(i / W) * type_size + start + i % W] = __ldg(src + i);
}

// gguf_blocks.join, for GGUF blocks [b0, b0 + nb): plane k holds bytes [start, start + width) of
// every block. The widths of every layout are spelled out so that i / W is a multiply.
__device__ void join_blocks(const gguf::BlockLayout& l, const Planes& planes, int64_t b0, int nb, uint8_t* blocks) {
  for (int k = 0; k < l.n_planes; ++k) {
    const int w = l.planes[k].width, start = l.planes[k].start;
    const uint8_t* src = planes.p[k] + b0 * w;
    switch (w) {
      case 1: join_plane<1>(src, nb, l.type_size, start, blocks); break;
      case 4: join_plane<4>(src, nb, l.type_size, start, blocks); break;
      case 12: join_plane<12>(src, nb, l.type_size, start, blocks); break;
      case 16: join_plane<16>(src, nb, l.type_size, start, blocks); break;
      case 32: join_plane<32>(src, nb, l.type_size, start, blocks); break;
      case 64: join_plane<64>(src, nb, l.type_size, start, blocks); break;
      case 128: join_plane<128>(src, nb, l.type_size, start, blocks); break;
      default:
        for (int i = threadIdx.x; i < nb * w; i += kDqThreads) blocks[(i / w) * l.type_size + start + i % w] = __ldg(src + i);
    }
  }
}

// GGUF blocks [b0, b0 + kDqWeights / block_size) of one tensor: join their planes into shared
// memory, then thread t dequantizes the runs of 8 weights starting at 8 t and 8 t + 2048.
template <int64_t Code, typename Store>
__global__ void __launch_bounds__(kDqThreads) dequantize_kernel(gguf::BlockLayout l, Planes planes, int64_t n_blocks,
                                                                Store store) {
  __shared__ uint8_t blocks[kDqBytes];
  const int per = kDqWeights / l.block_size;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * per;
  const int nb = static_cast<int>(n_blocks - b0 < per ? n_blocks - b0 : per);
  join_blocks(l, planes, b0, nb, blocks);
  __syncthreads();
  const int shift = l.block_size == 256 ? 8 : 5;                     // block sizes: 32 or QK_K = 256
  const int64_t first = b0 * l.block_size;
  for (int w = threadIdx.x * kDqRun; w < (nb << shift); w += kDqThreads * kDqRun) {
    float y[kDqRun];
    gguf::dequantize_run(Code, blocks + (w >> shift) * l.type_size, w & (l.block_size - 1), kDqRun, y);
    store.run(first + w, y);
  }
}

template <typename Store>
__global__ void reconstruct_int8_kernel(const uint8_t* resid, const uint8_t* modes, const float* scales, int64_t rows,
                                        int64_t cols, int64_t tiles, Store store) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < tiles) int8::reconstruct_tile(resid, modes, scales, rows, cols, t, store);
}

template <bool BF16>
__device__ __forceinline__ uint32_t to16(float v) { return BF16 ? gguf::f32_to_bf16(v) : gguf::f32_to_f16(v); }

// Runs of kDqRun weights at element i (a multiple of 8): vector stores when the output is 16-byte
// aligned (`vec`, decided at launch), else one element at a time.
struct StoreF32 {
  float* o;
  bool vec;
  __device__ void run(int64_t i, const float* y) const {
    if (vec) {
      reinterpret_cast<float4*>(o + i)[0] = make_float4(y[0], y[1], y[2], y[3]);
      reinterpret_cast<float4*>(o + i)[1] = make_float4(y[4], y[5], y[6], y[7]);
      return;
    }
#pragma unroll
    for (int j = 0; j < kDqRun; ++j) o[i + j] = y[j];
  }
};
template <bool BF16>
struct Store16 {
  uint16_t* o;
  bool vec;
  __device__ static uint32_t cast(float v) { return to16<BF16>(v); }
  __device__ void run(int64_t i, const float* y) const {
    if (vec) {                                                        // little-endian: element 2k low
      reinterpret_cast<uint4*>(o + i)[0] = make_uint4(cast(y[0]) | (cast(y[1]) << 16), cast(y[2]) | (cast(y[3]) << 16),
                                                      cast(y[4]) | (cast(y[5]) << 16), cast(y[6]) | (cast(y[7]) << 16));
      return;
    }
#pragma unroll
    for (int j = 0; j < kDqRun; ++j) o[i + j] = static_cast<uint16_t>(cast(y[j]));
  }
};

// Tile rows (int8_tiles.h store.row): a full row at a 16-byte aligned address as vector stores.
struct RowF32 {
  float* o;
  __device__ void row(int64_t at, const float* y, int w) const {
    float* p = o + at;
    if (w == int8::kTile && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
#pragma unroll
      for (int k = 0; k < int8::kTile / 4; ++k)
        reinterpret_cast<float4*>(p)[k] = make_float4(y[4 * k], y[4 * k + 1], y[4 * k + 2], y[4 * k + 3]);
      return;
    }
#pragma unroll
    for (int j = 0; j < int8::kTile; ++j)
      if (j < w) p[j] = y[j];
  }
};
template <bool BF16>
struct Row16 {
  uint16_t* o;
  __device__ static uint32_t cast(float v) { return to16<BF16>(v); }
  __device__ void row(int64_t at, const float* y, int w) const {
    uint16_t* p = o + at;
    if (w == int8::kTile && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
      uint32_t u[int8::kTile / 2];                                    // little-endian: element 2k low
#pragma unroll
      for (int k = 0; k < int8::kTile / 2; ++k) u[k] = cast(y[2 * k]) | (cast(y[2 * k + 1]) << 16);
      reinterpret_cast<uint4*>(p)[0] = make_uint4(u[0], u[1], u[2], u[3]);
      reinterpret_cast<uint4*>(p)[1] = make_uint4(u[4], u[5], u[6], u[7]);
      return;
    }
#pragma unroll
    for (int j = 0; j < int8::kTile; ++j)
      if (j < w) p[j] = static_cast<uint16_t>(cast(y[j]));
  }
};

}  // namespace

static void decode_bytes_cuda(const at::Tensor& data, const at::Tensor& desc, at::TensorList outputs,
                              const at::Tensor& status) {
  const std::vector<TensorDesc> descs = check_bytes_args(data, desc, outputs, status);
  const int64_t n = static_cast<int64_t>(descs.size());
  std::vector<int64_t> host(desc.data_ptr<int64_t>(), desc.data_ptr<int64_t>() + n * kDescFields);
  int64_t blocks = 0;
  const uintptr_t base = reinterpret_cast<uintptr_t>(data.data_ptr());
  for (const TensorDesc& d : descs) {
    TORCH_CHECK(d.table_group % kWarps == 0 || d.table_group >= segment_count(d),
                "table_group must be a multiple of ", kWarps, " or cover the plane");
    TORCH_CHECK((base + static_cast<uintptr_t>(d.exp_off)) % 2 == 0,
                "a stream must start at an even address on the GPU (its words are u16 loads)");
    host.push_back(blocks);
    blocks += (segment_count(d) + kWarps - 1) / kWarps;
  }
  for (const auto& o : outputs) host.push_back(reinterpret_cast<int64_t>(o.data_ptr()));
  if (blocks == 0) return;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "too many segments for one launch");
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor plan = at::tensor(host, at::kLong).to(data.device(), /*non_blocking=*/false);
  const int64_t* p = plan.data_ptr<int64_t>();
  decode_bytes_kernel<<<static_cast<unsigned>(blocks), 32 * kWarps, 0, c10::cuda::getCurrentCUDAStream()>>>(
      data.data_ptr<uint8_t>(), BytesPlan{p, p + n * kDescFields, p + n * (kDescFields + 1), n},
      status.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Store>
static void launch_dequantize(const gguf::BlockLayout& l, const Planes& planes, int64_t n_blocks, Store store) {
  const int64_t per = kDqWeights / l.block_size;
  const int64_t grid = (n_blocks + per - 1) / per;
  TORCH_CHECK(grid < (int64_t{1} << 31), "too many blocks for one launch");
  const dim3 g(static_cast<unsigned>(grid));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  switch (l.code) {                                  // one kernel per type: dequantize_run's switch folds away
    case 2: dequantize_kernel<2><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    case 3: dequantize_kernel<3><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    case 6: dequantize_kernel<6><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    case 7: dequantize_kernel<7><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    case 8: dequantize_kernel<8><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    case 12: dequantize_kernel<12><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    case 13: dequantize_kernel<13><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    case 14: dequantize_kernel<14><<<g, kDqThreads, 0, stream>>>(l, planes, n_blocks, store); break;
    default: TORCH_CHECK(false, "no CUDA dequantizer for GGML type ", l.code);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

static void dequantize_one_cuda(const gguf::BlockLayout& l, at::TensorList planes, const at::Tensor& out) {
  const int64_t n_blocks = out.numel() / l.block_size;
  if (n_blocks == 0) return;
  Planes ptrs{};
  for (int k = 0; k < l.n_planes; ++k) ptrs.p[k] = planes[k].data_ptr<uint8_t>();
  const bool vec = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  if (out.scalar_type() == at::kFloat)
    launch_dequantize(l, ptrs, n_blocks, StoreF32{out.data_ptr<float>(), vec});
  else if (out.scalar_type() == at::kBFloat16)
    launch_dequantize(l, ptrs, n_blocks, Store16<true>{reinterpret_cast<uint16_t*>(out.data_ptr()), vec});
  else
    launch_dequantize(l, ptrs, n_blocks, Store16<false>{reinterpret_cast<uint16_t*>(out.data_ptr()), vec});
}

// A launch per tensor of the list. (One launch for the whole list, through a device plan with a row
// per tensor, was measured: 2.5 ms slower on 56 large tensors, 8B layer shapes, on an H100.)
static void dequantize_blocks_cuda(at::TensorList planes, int64_t ggml_type, at::TensorList outs) {
  const gguf::BlockLayout& l = check_blocks_args(planes, ggml_type, outs);
  TORCH_CHECK((l.block_size == 32 || l.block_size == 256) && l.type_size * (kDqWeights / l.block_size) <= kDqBytes,
              "GGML type ", ggml_type, ": block size ", l.block_size, " / ", l.type_size, " bytes do not fit the kernel");
  if (outs.empty()) return;
  const c10::cuda::CUDAGuard guard(outs[0].device());
  for (size_t t = 0; t < outs.size(); ++t) dequantize_one_cuda(l, planes.slice(t * l.n_planes, l.n_planes), outs[t]);
}

void check_int8_args(const at::Tensor& resid, const at::Tensor& modes, const at::Tensor& scales,
                     const at::Tensor& out);                                                            // .cpp

static void reconstruct_int8_cuda(const at::Tensor& resid, const at::Tensor& modes, const at::Tensor& scales,
                                  const at::Tensor& out) {
  check_int8_args(resid, modes, scales, out);
  const int64_t rows = out.size(0), cols = out.size(1);
  const int64_t tiles = modes.numel();
  if (tiles == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const int threads = 128;
  const unsigned grid = static_cast<unsigned>((tiles + threads - 1) / threads);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const uint8_t* r = resid.data_ptr<uint8_t>();
  const uint8_t* m = modes.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  if (out.scalar_type() == at::kFloat)
    reconstruct_int8_kernel<<<grid, threads, 0, stream>>>(r, m, s, rows, cols, tiles, RowF32{out.data_ptr<float>()});
  else if (out.scalar_type() == at::kBFloat16)
    reconstruct_int8_kernel<<<grid, threads, 0, stream>>>(r, m, s, rows, cols, tiles,
                                                          Row16<true>{reinterpret_cast<uint16_t*>(out.data_ptr())});
  else
    reconstruct_int8_kernel<<<grid, threads, 0, stream>>>(r, m, s, rows, cols, tiles,
                                                          Row16<false>{reinterpret_cast<uint16_t*>(out.data_ptr())});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) {
  m.impl("decode_bytes", &decode_bytes_cuda);
  m.impl("dequantize_blocks", &dequantize_blocks_cuda);
  m.impl("reconstruct_int8", &reconstruct_int8_cuda);
}

}  // namespace wcodec
