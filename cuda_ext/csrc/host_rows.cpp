// gather_host_rows: rows `ids` [N] of a [V, E] table -> out [N, E] (llama.cpp's get_rows of an
// input layer kept on the CPU). An id outside [0, V) gives a row of zeros: never a read outside
// the table, and no device assert (the CUDA twin runs inside captured decode steps).
//
// The CPU op (table, ids, out on the CPU) is the twin of host_rows.cu, where the table stays in
// page-locked host memory and the GPU reads the gathered rows through its mapping.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace wcodec {

void check_host_rows_args(const at::Tensor& table, const at::Tensor& ids, const at::Tensor& out) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous(), "gather_host_rows: table must be a contiguous [V, E] tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "gather_host_rows: ids must be a contiguous int64 [N] tensor");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0) && out.size(1) == table.size(1),
              "gather_host_rows: out must be a contiguous [N, E] tensor, N = ids' length, E = the table's");
  TORCH_CHECK(out.scalar_type() == table.scalar_type(), "gather_host_rows: out's dtype ", out.scalar_type(),
              " is not the table's ", table.scalar_type());
  TORCH_CHECK(ids.device() == out.device(), "gather_host_rows: ids and out must be on one device");
}

static void gather_host_rows_cpu(const at::Tensor& table, const at::Tensor& ids, const at::Tensor& out) {
  check_host_rows_args(table, ids, out);
  TORCH_CHECK(table.device().is_cpu(), "gather_host_rows: the table must be in host memory");
  const int64_t rows = table.size(0), n = ids.size(0);
  const size_t row_bytes = static_cast<size_t>(table.size(1)) * table.element_size();
  const auto* src = static_cast<const uint8_t*>(table.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* row = dst + static_cast<size_t>(i) * row_bytes;
    if (id[i] >= 0 && id[i] < rows)
      std::memcpy(row, src + static_cast<size_t>(id[i]) * row_bytes, row_bytes);
    else
      std::memset(row, 0, row_bytes);
  }
}

TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("gather_host_rows(Tensor table, Tensor ids, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("gather_host_rows", &gather_host_rows_cpu);
}

}  // namespace wcodec
