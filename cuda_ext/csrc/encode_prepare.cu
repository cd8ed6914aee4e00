// The CUDA twin of encode_prepare.cpp: prepare_planes / prepare_plane give the same outputs.
//   count symbols   ONE launch for every plane of the batch: a block per segment of any plane
//                   (per-warp shared histograms), the hi / lo planes written as it reads
//   choose tables   the fine counts cross to the host in one copy (pinned; a few KiB a segment, never
//                   the plane), choose_planes (encode_prepare.cpp) prices every (plane, candidate) on
//                   the host's threads, and the choices and tables go back without a wait (pinned)
// One wait per batch, not one per plane. Launches run on the current stream; counts are 64-bit.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "encode_host.h"

namespace wcodec {

constexpr int kCountThreads = 256, kCountWarps = kCountThreads / 32;

// Segment `seg` of plane p: split its elements into hi / lo, count them into fine (its row of counts).
template <int Dtype>
__device__ void count_segment(const PlaneShape& p, int64_t seg, int32_t (*hist)[kFineBins], int32_t* __restrict__ fine) {
  const int64_t i0 = seg * kSegmentSymbols, end = p.n < i0 + kSegmentSymbols ? p.n : i0 + kSegmentSymbols;
  int32_t* mine = hist[threadIdx.x / 32];
  for (int64_t i = i0 + threadIdx.x; i < end; i += kCountThreads) {
    uint32_t sym, h, l;
    split_element(Dtype, p.in, i, sym, h, l);
    if (Dtype != kU8) p.hi[i] = static_cast<uint8_t>(h);
    if (Dtype == kFP32) p.lo[2 * i] = l & 0xFF, p.lo[2 * i + 1] = l >> 8;
    atomicAdd(&mine[(fine_context(Dtype, h) << 8) | sym], 1);
  }
  __syncthreads();
  for (int k = threadIdx.x; k < kFineBins; k += kCountThreads) {
    int32_t c = 0;
    for (int w = 0; w < kCountWarps; ++w) c += hist[w][k];
    fine[k] = c;
  }
}

// Block b counts segment b of the batch: plane i holds segments [firsts[i], firsts[i] + n_seg).
__global__ void __launch_bounds__(kCountThreads) count_symbols(const PlaneShape* __restrict__ planes,
                                                               const int64_t* __restrict__ firsts, int64_t n_planes,
                                                               int32_t* __restrict__ fine) {
  __shared__ int32_t hist[kCountWarps][kFineBins];
  for (int k = threadIdx.x; k < kCountWarps * kFineBins; k += kCountThreads) hist[k / kFineBins][k % kFineBins] = 0;
  __syncthreads();
  const PlaneShape p = planes[plan_row(firsts, n_planes, blockIdx.x)];
  const int64_t seg = blockIdx.x - p.first_seg;
  int32_t* row = fine + static_cast<int64_t>(blockIdx.x) * kFineBins;
  switch (p.dtype) {                                       // one plane per block: no divergence
    case kBF16: count_segment<kBF16>(p, seg, hist, row); break;
    case kFP16: count_segment<kFP16>(p, seg, hist, row); break;
    case kFP32: count_segment<kFP32>(p, seg, hist, row); break;
    default: count_segment<kU8>(p, seg, hist, row); break;
  }
}

// The planes (PlaneShape rows, then each one's first segment) in one pinned buffer, sent without a wait.
static at::Tensor upload_shapes(const PrepareBatch& b, const at::Device& device) {
  const int64_t k = static_cast<int64_t>(b.planes.size()), shape_bytes = k * static_cast<int64_t>(sizeof(PlaneShape));
  at::Tensor host = at::empty({shape_bytes + 8 * k}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  memcpy(host.data_ptr<uint8_t>(), b.planes.data(), shape_bytes);
  int64_t* firsts = reinterpret_cast<int64_t*>(host.data_ptr<uint8_t>() + shape_bytes);
  for (int64_t i = 0; i < k; ++i) firsts[i] = b.planes[i].first_seg;
  return host.to(device, /*non_blocking=*/true);
}

static std::vector<at::Tensor> prepare_planes_cuda(at::TensorList data, at::IntArrayRef dtypes) {
  PrepareBatch b = prepare_batch(data, dtypes, /*pinned=*/true);
  if (data.empty()) return b.outputs(at::kCPU);
  const c10::cuda::CUDAGuard guard(data[0].device());
  if (b.total_seg) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const at::Tensor shapes = upload_shapes(b, data[0].device());
    const int64_t k = static_cast<int64_t>(b.planes.size());
    const uint8_t* base = shapes.data_ptr<uint8_t>();
    at::Tensor fine = at::empty({b.total_seg, kFineBins}, data[0].options().dtype(at::kInt));
    count_symbols<<<static_cast<unsigned>(b.total_seg), kCountThreads, 0, stream>>>(
        reinterpret_cast<const PlaneShape*>(base), reinterpret_cast<const int64_t*>(base + k * sizeof(PlaneShape)), k,
        fine.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor fine_host = at::empty(fine.sizes(), fine.options().device(at::kCPU).pinned_memory(true));
    fine_host.copy_(fine, /*non_blocking=*/true);
    stream.synchronize();                                            // the batch's one wait: its counts
    choose_planes(fine_host.data_ptr<int32_t>(), b);
  }
  return b.outputs(data[0].device());
}

static std::vector<at::Tensor> prepare_plane_cuda(const at::Tensor& data, int64_t dtype) {
  return first_plane(prepare_planes_cuda({data}, {dtype}));
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) {
  m.impl("prepare_plane", &prepare_plane_cuda);
  m.impl("prepare_planes", &prepare_planes_cuda);
}

}  // namespace wcodec
