// The C++ twin of crc32.cu, and the op's schema:
//   crc32_spans(data, spans)  zlib.crc32 of each span [offset, offset + length) of the uint8
//                             `data` (spans: CPU int64 [n, 2]) -> int64 [n] on data's device.
// The same passes as the kernels (crc32.h: pieces -> 64 KiB units -> folds of 256), a block at a
// time, so the CPU tests check the kernels' arithmetic against zlib.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "crc32.h"

namespace wcodec {

// Check the arguments and lay out the passes.
CrcPlan crc_plan(const at::Tensor& data, const at::Tensor& spans) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1 && data.is_contiguous(),
              "data must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(spans.device().is_cpu() && spans.scalar_type() == at::kLong && spans.dim() == 2 &&
                  spans.size(1) == 2 && spans.is_contiguous(),
              "spans must be a contiguous CPU int64 tensor [n, 2] of (offset, length)");
  const int64_t n = spans.size(0), *s = spans.data_ptr<int64_t>();
  std::vector<int64_t> offs, lens;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t off = s[2 * i], len = s[2 * i + 1];
    TORCH_CHECK(off >= 0 && len >= 0 && off <= data.numel() && len <= data.numel() - off, "span ", i, " (", off,
                ", ", len, ") lies outside data of ", data.numel(), " bytes");
    offs.push_back(off);
    lens.push_back(len);
  }
  CrcPlan plan;
  plan.n = n;
  plan.packed = offs;
  plan.packed.insert(plan.packed.end(), lens.begin(), lens.end());
  for (const auto& counts : crc_pass_counts(lens)) {
    plan.packed.push_back(0);
    for (int64_t c : counts) plan.packed.push_back(plan.packed.back() + c);
    ++plan.passes;
  }
  return plan;
}

// The blocks of pass `p`, one "thread" after another: pass 0 from the bytes, later passes from
// the values before. Each block folds its kCrcFan inputs in the kernel's tree order.
static void crc_pass_cpu(const CrcPlan& plan, int p, const uint8_t* data, const uint32_t* in, uint32_t* out) {
  static const CrcPowers powers = crc_powers();
  uint32_t table[256];
  for (uint32_t i = 0; i < 256; ++i) table[i] = crc_table_entry(i);
  const CrcView v = plan.view();
  at::parallel_for(0, plan.blocks(p), 1, [&](int64_t begin, int64_t end) {
    uint32_t x[kCrcFan];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t i = plan_row(v.pass(p), v.n, b), j = b - v.pass(p)[i];
      for (int t = 0; t < kCrcFan; ++t) x[t] = crc_input(v, p, data, in, i, j, t, table);
      for (int l = 0; l < kCrcFanLog; ++l)
        for (int t = 0; t < kCrcFan; t += 2 << l) x[t] = crc_fold(x[t], x[t + (1 << l)], powers, p, l);
      out[b] = x[0];
    }
  });
}

static at::Tensor crc32_spans_cpu(const at::Tensor& data, const at::Tensor& spans) {
  const CrcPlan plan = crc_plan(data, spans);
  std::vector<uint32_t> in, out;
  for (int p = 0; p < plan.passes; ++p) {
    out.assign(plan.blocks(p), 0u);
    crc_pass_cpu(plan, p, data.data_ptr<uint8_t>(), in.data(), out.data());
    in.swap(out);
  }
  at::Tensor crcs = at::empty({plan.n}, spans.options());
  for (int64_t i = 0; i < plan.n; ++i) crcs.data_ptr<int64_t>()[i] = crc_finish(in[i], plan.view().lens[i]);
  return crcs;
}

TORCH_LIBRARY_FRAGMENT(wcodec, m) { m.def("crc32_spans(Tensor data, Tensor spans) -> Tensor"); }

TORCH_LIBRARY_IMPL(wcodec, CPU, m) { m.impl("crc32_spans", &crc32_spans_cpu); }

}  // namespace wcodec
