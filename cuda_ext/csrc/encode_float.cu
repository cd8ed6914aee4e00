// The CUDA twin of encode_float.cpp: the same steps (encode_common.h) and the same bytes, spread
// over threads. Launches run on the current stream; element counts and offsets are 64-bit.
// (encode_prepare.cu counts the symbols and has the tables chosen.)
//   encode_planes   encode lanes: a warp per segment of every plane at once, one lane per thread.
//                   rANS encodes IN REVERSE: a warp walks its segment's steps last to first; each
//                   step's emitting lanes place their words just below ptr in lane order (ballot +
//                   popc), so the words end up in the decoder's order. Then the word counts go to
//                   the host, which lays out each stream (stream_layout), and scatter_segments copies
//                   states and words into place.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "encode_host.h"

namespace wcodec {

constexpr int kEncodeWarps = 4;                  // a block encodes 4 segments of one plane: one table set
constexpr int64_t kSlot = kSegmentSymbols;       // scratch words per segment (one at most per symbol)
constexpr unsigned kFull = 0xFFFFFFFFu;

// ---- encode lanes -------------------------------------------------------------------------------
struct PlaneDev {                // one plane, as the kernel sees it
  const uint8_t* in;
  int64_t dtype, n, ctx_bits, group, first_seg, entry0;
};

// Block b of the launch encodes segments [4 j, 4 j + 4) of plane i: firsts[i] = its first block.
__global__ void __launch_bounds__(32 * kEncodeWarps) encode_lanes(const PlaneDev* __restrict__ planes, int64_t n_planes,
                                                                  const int64_t* __restrict__ firsts,
                                                                  const EncodeEntry* __restrict__ entries,
                                                                  uint16_t* __restrict__ words, uint32_t* __restrict__ states,
                                                                  int64_t* __restrict__ counts) {
  __shared__ EncodeEntry set[kFineBins];
  const int64_t i = plan_row(firsts, n_planes, blockIdx.x);
  const PlaneDev p = planes[i];
  const int64_t seg = (blockIdx.x - firsts[i]) * kEncodeWarps + threadIdx.x / 32;
  const int64_t set0 = p.entry0 + ((((blockIdx.x - firsts[i]) * kEncodeWarps) / p.group) << p.ctx_bits) * 256;
  for (int k = threadIdx.x; k < (256 << p.ctx_bits); k += 32 * kEncodeWarps) set[k] = entries[set0 + k];
  __syncthreads();
  const int64_t n_seg = (p.n + kSegmentSymbols - 1) / kSegmentSymbols;
  if (seg >= n_seg) return;
  const int lane = threadIdx.x & 31, cb = static_cast<int>(p.ctx_bits);
  const int64_t s0 = seg * kSegmentSymbols, len = p.n - s0 < kSegmentSymbols ? p.n - s0 : kSegmentSymbols;
  const int64_t g = p.first_seg + seg;
  uint16_t* const end = words + (g + 1) * kSlot;
  uint16_t* ptr = end;
  uint32_t x = kRansL;
  for (int64_t t = (len + kLanes - 1) / kLanes - 1; t >= 0; --t) {           // last step first
    const int64_t j = t * kLanes + lane;
    EncodeEntry e{0, 0, 0};
    if (j < len) {
      uint32_t sym, hi, lo;
      split_element(p.dtype, p.in, s0 + j, sym, hi, lo);
      e = set[((p.dtype == kU8 ? 0 : context(hi, cb, p.dtype)) << 8) | sym];
    }
    const bool emit = j < len && rans_emits(x, e);
    const unsigned mask = __ballot_sync(kFull, emit);
    const int count = __popc(mask);
    if (emit) {                                      // lane order within the step, below ptr
      ptr[-count + __popc(mask & ((1u << lane) - 1u))] = static_cast<uint16_t>(x & 0xFFFF);
      x >>= kRenormBits;
    }
    if (j < len) x = rans_encode_state(x, e);        // x = C(s, x)
    ptr -= count;
  }
  states[g * kLanes + lane] = x;
  if (lane == 0) counts[g] = end - ptr;
}

// ---- assemble -----------------------------------------------------------------------------------
// Segment g: its states, then its words (ending at the end of its scratch slot), then zeros, to
// dst[g] .. dst[g] + size[g] (rows of `where`: destination address, size).
__global__ void scatter_segments(const int64_t* __restrict__ where, const uint32_t* __restrict__ states,
                                 const uint16_t* __restrict__ words, const int64_t* __restrict__ counts) {
  const int64_t g = blockIdx.x;
  uint8_t* dst = reinterpret_cast<uint8_t*>(where[2 * g]);
  const int64_t size = where[2 * g + 1], c = counts[g];
  const uint8_t* st = reinterpret_cast<const uint8_t*>(states + g * kLanes);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(words + (g + 1) * kSlot - c);
  for (int64_t k = threadIdx.x; k < size; k += blockDim.x)
    dst[k] = k < kStateBytes ? st[k] : k < kStateBytes + 2 * c ? w[k - kStateBytes] : 0;
}

static at::Tensor to_device(const std::vector<int64_t>& v, const at::Tensor& like) {
  return at::tensor(v, at::kLong).to(like.device());
}

// The planes and their packed tables in one device buffer: PlaneDev rows, then EncodeEntry rows.
struct Upload {
  at::Tensor meta, firsts;        // device: the buffer, and each plane's first block
  int64_t blocks = 0, total_seg = 0, plane_bytes = 0;
};

static Upload upload_planes(const std::vector<PlaneJob>& jobs, const at::Tensor& like) {
  std::vector<PlaneDev> devs;
  std::vector<int64_t> firsts;
  std::vector<EncodeEntry> entries;
  Upload up;
  for (const PlaneJob& p : jobs) {
    TORCH_CHECK(p.group % kEncodeWarps == 0 || p.group >= p.n_seg, "table_group must be a multiple of 4 or cover the plane");
    devs.push_back(PlaneDev{p.in, p.dtype, p.n, p.ctx_bits, p.group, p.first_seg, static_cast<int64_t>(entries.size())});
    entries.insert(entries.end(), p.entries.begin(), p.entries.end());
    firsts.push_back(up.blocks);
    up.blocks += (p.n_seg + kEncodeWarps - 1) / kEncodeWarps, up.total_seg += p.n_seg;
  }
  up.plane_bytes = static_cast<int64_t>(devs.size() * sizeof(PlaneDev));
  const int64_t entry_bytes = static_cast<int64_t>(entries.size() * sizeof(EncodeEntry));
  at::Tensor meta = at::empty({up.plane_bytes + entry_bytes}, at::kByte);
  memcpy(meta.data_ptr<uint8_t>(), devs.data(), up.plane_bytes);
  memcpy(meta.data_ptr<uint8_t>() + up.plane_bytes, entries.data(), entry_bytes);
  up.meta = meta.to(like.device());
  up.firsts = to_device(firsts, like);
  return up;
}

// Each plane's stream, its head (directory and tables) copied in, and where each segment goes
// (rows of address, size for scatter_segments).
static std::vector<at::Tensor> lay_out_streams(const std::vector<PlaneJob>& jobs, const at::Tensor& counts_host,
                                               const at::Tensor& like, std::vector<int64_t>& where) {
  std::vector<at::Tensor> out;
  for (const PlaneJob& p : jobs) {
    const StreamLayout lay = stream_layout(p, counts_host.data_ptr<int64_t>() + p.first_seg);
    at::Tensor stream_out = at::empty({lay.seg_off[p.n_seg]}, like.options());
    stream_out.narrow(0, 0, lay.seg_off[0]).copy_(at::from_blob(const_cast<uint8_t*>(lay.head.data()),
                                                                {lay.seg_off[0]}, at::kByte));
    for (int64_t s = 0; s < p.n_seg; ++s) {
      where[2 * (p.first_seg + s)] = reinterpret_cast<int64_t>(stream_out.data_ptr<uint8_t>() + lay.seg_off[s]);
      where[2 * (p.first_seg + s) + 1] = lay.seg_off[s + 1] - lay.seg_off[s];
    }
    out.push_back(stream_out);
  }
  return out;
}

static std::vector<at::Tensor> encode_planes_cuda(at::TensorList data, at::IntArrayRef dtypes, at::TensorList freqs,
                                                  at::IntArrayRef ctx_bits, at::IntArrayRef groups) {
  std::vector<PlaneJob> jobs = plane_jobs(data, dtypes, freqs, ctx_bits, groups);
  if (jobs.empty()) return {};
  const c10::cuda::CUDAGuard guard(data[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Upload up = upload_planes(jobs, data[0]);
  const auto opts = data[0].options();
  at::Tensor words = at::empty({up.total_seg * kSlot}, opts.dtype(at::kShort));
  at::Tensor states = at::empty({up.total_seg * kLanes}, opts.dtype(at::kInt));
  at::Tensor counts = at::empty({up.total_seg}, opts.dtype(at::kLong));
  const uint8_t* meta = up.meta.data_ptr<uint8_t>();
  encode_lanes<<<up.blocks, 32 * kEncodeWarps, 0, stream>>>(
      reinterpret_cast<const PlaneDev*>(meta), static_cast<int64_t>(jobs.size()), up.firsts.data_ptr<int64_t>(),
      reinterpret_cast<const EncodeEntry*>(meta + up.plane_bytes), reinterpret_cast<uint16_t*>(words.data_ptr()),
      reinterpret_cast<uint32_t*>(states.data_ptr()), counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor counts_host = counts.cpu();                          // waits for the encode
  std::vector<int64_t> where(2 * up.total_seg);
  std::vector<at::Tensor> out = lay_out_streams(jobs, counts_host, data[0], where);
  const at::Tensor where_dev = to_device(where, data[0]);
  scatter_segments<<<up.total_seg, 256, 0, stream>>>(where_dev.data_ptr<int64_t>(), reinterpret_cast<uint32_t*>(states.data_ptr()),
                                                     reinterpret_cast<uint16_t*>(words.data_ptr()), counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) {
  m.impl("encode_planes", &encode_planes_cuda);
}

}  // namespace wcodec
