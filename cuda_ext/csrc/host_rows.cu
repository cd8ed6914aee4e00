// CUDA twin of host_rows.cpp: the table stays in page-locked host memory and each gathered row is
// read by the GPU over the bus, through the table's device mapping (its address under unified
// addressing), into `out` on the GPU. Block (row i, part y): its threads copy 16-byte words when
// the table, out and a row are 16-byte aligned, else single bytes; an id outside [0, V) writes
// zeros. A launch on the current stream with no host sync, so a captured decode step holds it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

namespace wcodec {

void check_host_rows_args(const at::Tensor& table, const at::Tensor& ids, const at::Tensor& out);   // .cpp

constexpr int kRowThreads = 256;

template <typename Word>
__global__ void __launch_bounds__(kRowThreads) gather_rows_kernel(const Word* __restrict__ table, int64_t rows,
                                                                  int64_t row_words, const int64_t* __restrict__ ids,
                                                                  Word* __restrict__ out) {
  const int64_t i = blockIdx.x, id = ids[i];
  const int64_t w = static_cast<int64_t>(blockIdx.y) * kRowThreads + threadIdx.x;
  if (w >= row_words) return;
  Word v{};                                                        // zeros for an id outside the table
  if (id >= 0 && id < rows) v = table[id * row_words + w];
  out[i * row_words + w] = v;
}

static const void* mapped(const at::Tensor& table) {
  cudaPointerAttributes a{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(&a, table.data_ptr()));
  TORCH_CHECK(a.type == cudaMemoryTypeHost && a.devicePointer != nullptr,
              "gather_host_rows: the table must be page-locked host memory (pin_memory)");
  return a.devicePointer;
}

template <typename Word>
static void launch(const void* table, int64_t rows, int64_t row_bytes, const at::Tensor& ids, const at::Tensor& out) {
  const int64_t row_words = row_bytes / static_cast<int64_t>(sizeof(Word));
  const dim3 grid(static_cast<unsigned>(ids.size(0)), static_cast<unsigned>((row_words + kRowThreads - 1) / kRowThreads));
  gather_rows_kernel<Word><<<grid, kRowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const Word*>(table), rows, row_words, ids.data_ptr<int64_t>(), static_cast<Word*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

static void gather_host_rows_cuda(const at::Tensor& table, const at::Tensor& ids, const at::Tensor& out) {
  check_host_rows_args(table, ids, out);
  TORCH_CHECK(table.device().is_cpu() && out.is_cuda(), "gather_host_rows: on CUDA the table is in host memory, "
              "ids and out on the GPU");
  TORCH_CHECK(ids.size(0) <= 0x7FFFFFFF, "gather_host_rows: at most 2^31 - 1 ids a call");
  const int64_t row_bytes = table.size(1) * table.element_size();
  if (ids.size(0) == 0 || row_bytes == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const void* src = mapped(table);
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  if (wide)
    launch<uint4>(src, table.size(0), row_bytes, ids, out);
  else
    launch<uint8_t>(src, table.size(0), row_bytes, ids, out);
}

TORCH_LIBRARY_IMPL(wcodec, CUDA, m) {
  m.impl("gather_host_rows", &gather_host_rows_cuda);
}

}  // namespace wcodec
