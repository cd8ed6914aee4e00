// CUDA twin of crc32.cpp: zlib.crc32 of many spans of a device buffer, so a load verifies the
// streams it copied beside their decode. One block of kCrcFan threads per value of a pass
// (crc32.h): in pass 0 each thread checksums one 256-byte piece from its bytes, in later passes
// takes one value of the pass before; the block folds its 256 inputs by shuffles within each warp,
// then across the warps. Launches run on the current stream; archive bytes never trap (a span is
// only read inside data, checked on the host).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "crc32.h"

namespace wcodec {

CrcPlan crc_plan(const at::Tensor& data, const at::Tensor& spans);   // crc32.cpp

constexpr unsigned kCrcFullMask = 0xFFFFFFFFu;
constexpr int kCrcWarps = kCrcFan / 32;

__global__ void __launch_bounds__(kCrcFan) crc_pass_kernel(CrcView v, int p, const uint8_t* __restrict__ data,
                                                          const uint32_t* __restrict__ in, uint32_t* __restrict__ out,
                                                          CrcPowers powers) {
  __shared__ uint32_t table[256], folded[kCrcWarps];
  const int t = threadIdx.x, lane = t & 31;
  table[t] = crc_table_entry(t);
  __syncthreads();
  const int64_t b = blockIdx.x, i = plan_row(v.pass(p), v.n, b), j = b - v.pass(p)[i];
  uint32_t x = crc_input(v, p, data, in, i, j, t, table);
#pragma unroll
  for (int l = 0; l < 5; ++l) {                                      // levels 0-4: within the warp
    const uint32_t right = __shfl_down_sync(kCrcFullMask, x, 1 << l);
    if ((lane & ((2 << l) - 1)) == 0) x = crc_fold(x, right, powers, p, l);
  }
  if (lane == 0) folded[t >> 5] = x;
  __syncthreads();
  if (t >= 32) return;
  x = lane < kCrcWarps ? folded[lane] : 0u;
#pragma unroll
  for (int l = 5; l < kCrcFanLog; ++l) {                             // levels 5-7: across the warps
    const uint32_t right = __shfl_down_sync(kCrcFullMask, x, 1 << (l - 5));
    if ((lane & ((2 << (l - 5)) - 1)) == 0) x = crc_fold(x, right, powers, p, l);
  }
  if (lane == 0) out[b] = x;
}

__global__ void crc_finish_kernel(const int64_t* __restrict__ lens, int64_t n, const uint32_t* __restrict__ last,
                                  int64_t* __restrict__ crcs) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) crcs[i] = crc_finish(last[i], lens[i]);
}

static at::Tensor crc32_spans_cuda(const at::Tensor& data, const at::Tensor& spans) {
  const CrcPlan plan = crc_plan(data, spans);
  const c10::cuda::CUDAGuard guard(data.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor crcs = at::empty({plan.n}, data.options().dtype(at::kLong));
  if (plan.n == 0) return crcs;
  const at::Tensor packed =
      at::tensor(plan.packed, at::TensorOptions().dtype(at::kLong)).to(data.device(), /*non_blocking=*/true);
  const CrcView v = crc_view(packed.data_ptr<int64_t>(), plan.n);
  int64_t most = 0;
  for (int p = 0; p < plan.passes; ++p) most = std::max(most, plan.blocks(p));
  TORCH_CHECK(most < (int64_t{1} << 31), "too many 64 KiB units for one checksum launch");
  at::Tensor values = at::empty({2, most}, data.options().dtype(at::kInt));
  static const CrcPowers powers = crc_powers();
  const uint32_t* in = nullptr;
  for (int p = 0; p < plan.passes; ++p) {
    uint32_t* out = reinterpret_cast<uint32_t*>(values[p & 1].data_ptr<int32_t>());
    crc_pass_kernel<<<static_cast<unsigned>(plan.blocks(p)), kCrcFan, 0, stream>>>(v, p, data.data_ptr<uint8_t>(),
                                                                                in, out, powers);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    in = out;
  }
  crc_finish_kernel<<<static_cast<unsigned>((plan.n + 255) / 256), 256, 0, stream>>>(v.lens, plan.n, in,
                                                                                      crcs.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return crcs;
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) { m.impl("crc32_spans", &crc32_spans_cuda); }

}  // namespace wcodec
