// The decode step's small ops on the CPU (issue 23, CPU half): step_kernels.py's references in one
// call each, where PyTorch took 5-10 calls (a batch-1 step of the demo was ~1 500 of them, a third
// of its time outside linear16). Their twins on CUDA are step_triton.py's Triton kernels.
//
// Read me first.
// * Bit for bit the references, not "up to float32 summation order": the CPU engine's greedy tokens
//   are compared with the padded engine's (tests/service/engine/test_scheduler.py). So each op does
//   PyTorch's arithmetic in PyTorch's order: a 16-bit result is rounded where PyTorch rounds it
//   (c10::BFloat16 / c10::Half: round to nearest even), and no multiply-add is fused (setup.py's
//   -ffp-contract=off).
// * add_rms_norm's one reduction, the sum of squares of a row, follows ATen's cascade_sum for a
//   contiguous float row (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum) with
//   `lanes` = the Vectorized<float>::size() of the kernel torch dispatches to, given by the caller
//   (step_kernels.norm_lanes finds it: 8 in torch 2.13, whose sum has no AVX512 kernel); the mean is
//   that sum / E, as ATen's CPU mean.
// * decode_attention calls SDPA itself, as paged.Modules does, on the same tensors: exact by
//   construction; it saves the Python calls around it (the gather, the views, the mask). With every
//   row seeing all T keys it passes no mask: SDPA adds 0.0 where the mask allows a key, which
//   changes no score.
//
//   x, h [N, E]   q [N, H, D]   k, v [N, KV, D]   cos, sin [N, D] (sin: first half negated)
//   k_cache, v_cache [slots, KV, D]   slots [N]   tables [B, M]   lengths [B]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <tuple>
#include <vector>

namespace wcodec {
namespace {

constexpr int kMaxLanes = 16;
constexpr int kIlp = 4;                      // row_sum's ilp_factor
constexpr int kLevels = 4;                   // multi_row_sum's num_levels

int64_t ceil_log2(int64_t x) {               // c10::utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v; v >>= 1) ++bits;
  return bits;
}

// ATen's sum of a contiguous float row of n, with vectors of `lanes`: vectors [i * ilp + j] summed
// into ilp vector accumulators through kLevels cascade levels, the accumulators added in turn, then
// the scalar tail, then the lanes in order
float row_sum_squares(const float* sq, int64_t n, int lanes) {
  using Vec = std::array<float, kMaxLanes>;
  const int64_t vectors = n / lanes, size = vectors / kIlp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels), step = int64_t{1} << power;
  const int64_t mask = step - 1;
  Vec acc[kLevels][kIlp] = {};
  auto add_into = [&](Vec& a, const float* v) { for (int l = 0; l < lanes; ++l) a[l] += v[l]; };
  int64_t i = 0;
  for (; i + step <= size;) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_into(acc[0][k], sq + (i * kIlp + k) * lanes);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        add_into(acc[j][k], acc[j - 1][k].data());
        acc[j - 1][k] = Vec{};
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kIlp; ++k) add_into(acc[0][k], sq + (i * kIlp + k) * lanes);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k) add_into(acc[0][k], acc[j][k].data());
  for (int64_t v = size * kIlp; v < vectors; ++v) add_into(acc[0][0], sq + v * lanes);   // row_sum's tail
  for (int k = 1; k < kIlp; ++k) add_into(acc[0][0], acc[0][k].data());
  float total = 0.f;
  for (int64_t e = vectors * lanes; e < n; ++e) total += sq[e];                            // scalar tail
  for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
  return total;
}

// x + h rounded to T; then RMSNorm as llama.RMSNorm: float32 squares, their mean, rsqrt, the
// product rounded to T, times the weight (rounded to T)
template <typename T>
void add_rms_norm_rows(const T* x, const T* h, const T* w, T* total, T* out, int64_t rows, int64_t n, float eps,
                       int lanes) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<float> f(n), sq(n);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      T* tr = total + r * n;
      for (int64_t e = 0; e < n; ++e) {
        const T t = h ? static_cast<T>(static_cast<float>(xr[e]) + static_cast<float>(h[r * n + e])) : xr[e];
        if (h) tr[e] = t;
        f[e] = static_cast<float>(t);
        sq[e] = f[e] * f[e];
      }
      const float mean = row_sum_squares(sq.data(), n, lanes) / static_cast<float>(n);
      const float scale = 1.f / std::sqrt(mean + eps);
      T* o = out + r * n;
      for (int64_t e = 0; e < n; ++e)
        o[e] = static_cast<T>(static_cast<float>(w[e]) * static_cast<float>(static_cast<T>(f[e] * scale)));
    }
  });
}

template <>
void add_rms_norm_rows<float>(const float* x, const float* h, const float* w, float* total, float* out, int64_t rows,
                              int64_t n, float eps, int lanes) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<float> sq(n);
    for (int64_t r = r0; r < r1; ++r) {
      const float* t = h ? total + r * n : x + r * n;
      if (h)
        for (int64_t e = 0; e < n; ++e) total[r * n + e] = x[r * n + e] + h[r * n + e];
      for (int64_t e = 0; e < n; ++e) sq[e] = t[e] * t[e];
      const float mean = row_sum_squares(sq.data(), n, lanes) / static_cast<float>(n);
      const float scale = 1.f / std::sqrt(mean + eps);
      for (int64_t e = 0; e < n; ++e) {
        const float normed = t[e] * scale;
        out[r * n + e] = w[e] * normed;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& h,
                                                    const at::Tensor& weight, double eps, int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "add_rms_norm: lanes must be 8 or 16 (ATen's vector of floats), not ",
              lanes);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "add_rms_norm: x must be [N, E] and the weight [E]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && (!h || h->scalar_type() == x.scalar_type()),
              "add_rms_norm: x, h and the weight must have one dtype");
  TORCH_CHECK(!h || h->sizes() == x.sizes(), "add_rms_norm: h must be x's shape");
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto hc = h ? h->contiguous() : at::Tensor();
  auto total = h ? at::empty_like(xc) : xc.clone();       // an op's outputs alias no input
  auto out = at::empty_like(xc);
  const int64_t rows = xc.size(0), n = xc.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), h ? hc.data_ptr<scalar_t>() : nullptr,
                                wc.data_ptr<scalar_t>(), h ? total.data_ptr<scalar_t>() : nullptr,
                                out.data_ptr<scalar_t>(), rows, n, static_cast<float>(eps), static_cast<int>(lanes));
  });
  return {total, out};
}

// out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin[i] (x.roll(D/2)), each product and the sum
// rounded to T, as the reference's three tensor ops round them
template <typename T>
void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const T b = static_cast<T>(static_cast<float>(x[(i + half) % d]) * static_cast<float>(sin[i]));
    out[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

template <>
void rotate<float>(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[(i + half) % d] * sin[i];
    out[i] = a + b;
  }
}

at::Tensor rope_store_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
              q.size(2) == k.size(2) && q.size(2) % 2 == 0, "rope_store: q [N, H, D], k and v [N, KV, D], D even");
  const int64_t n = q.size(0), heads = q.size(1), kv = k.size(1), d = q.size(2);
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({n, d}) && sin.sizes() == cos.sizes(), "rope_store: cos, sin [N, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kv && k_cache.size(2) == d && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "rope_store: the caches must be contiguous [slots, KV, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == n, "rope_store: slots int64 [N]");
  const auto dtype = q.scalar_type();
  for (const auto& t : {k, v, cos, sin, k_cache, v_cache})
    TORCH_CHECK(t.scalar_type() == dtype, "rope_store: every tensor but slots must be q's dtype");
  for (const auto& t : {q, k, v})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == d, "rope_store: q, k, v must have contiguous heads");
  auto cc = cos.contiguous(), sc = sin.contiguous(), sl = slots.contiguous();
  const int64_t* slot = sl.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "rope_store: slot ", slot[t], " is outside the cache");
  auto out = at::empty({n, heads, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rope_store", [&] {
    const auto *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const auto *cp = cc.data_ptr<scalar_t>(), *sp = sc.data_ptr<scalar_t>();
    auto *op = out.data_ptr<scalar_t>(), *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t *c = cp + t * d, *s = sp + t * d;
      for (int64_t hh = 0; hh < heads; ++hh) rotate(qp + t * q.stride(0) + hh * d, c, s, op + (t * heads + hh) * d, d);
      for (int64_t hh = 0; hh < kv; ++hh) {
        rotate(kp + t * k.stride(0) + hh * d, c, s, kc + (slot[t] * kv + hh) * d, d);
        std::copy_n(vp + t * v.stride(0) + hh * d, d, vc + (slot[t] * kv + hh) * d);
      }
    }
  });
  return out;
}

// A few rows' attention runs on the calling thread: SDPA's parallel_for opened an OpenMP region a
// layer for microseconds of work, waking a sleeping worker (the server's OMP_WAIT_POLICY=PASSIVE).
// omp_set_num_threads sets the calling thread's own team size, restored on leaving.
constexpr int64_t kSerialScores = 1 << 14;   // rows x query heads x keys up to which it is serial

struct SerialRegion {
  int before = 0;
  explicit SerialRegion(bool on) {
    if (on && (before = omp_get_max_threads()) > 1) omp_set_num_threads(1);
  }
  ~SerialRegion() {
    if (before > 1) omp_set_num_threads(before);
  }
};

// paged._decode: each row's keys gathered by block (one narrow where a lone row's blocks follow
// each other), the G = H / KV query heads of a KV head as SDPA's query length, SDPA
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& tables, const at::Tensor& lengths, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && q.size(2) == k_cache.size(2),
              "decode_attention: q [B, H, D], the caches [slots, KV, D]");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lengths.dim() == 1 && lengths.size(0) == q.size(0),
              "decode_attention: tables [B, M] and lengths [B]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "decode_attention: tables and lengths must be int64");
  const int64_t b = q.size(0), h = q.size(1), kv = k_cache.size(1), d = q.size(2), m = tables.size(1);
  TORCH_CHECK(kv > 0 && h % kv == 0 && block_size > 0 && k_cache.size(0) % block_size == 0,
              "decode_attention: H a multiple of KV, the caches whole blocks");
  auto len = lengths.contiguous();
  const int64_t* lp = len.data_ptr<int64_t>();
  int64_t keys = 0;
  bool all = true;
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= m * block_size, "decode_attention: a length outside its table");
    keys = std::max(keys, lp[r]);
  }
  for (int64_t r = 0; r < b; ++r) all = all && lp[r] == keys;
  auto tab = tables.contiguous();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t used = (keys + block_size - 1) / block_size, cache_blocks = k_cache.size(0) / block_size;
  bool follow = b == 1;
  for (int64_t i = 0; i < b * m; ++i) TORCH_CHECK(tp[i] >= 0 && tp[i] < cache_blocks, "decode_attention: a block "
                                                  "outside the cache");
  for (int64_t i = 1; follow && i < used; ++i) follow = tp[i] == tp[0] + i;
  auto gather = [&](const at::Tensor& cache) {                                      // [B, KV, T, D]
    if (follow) return cache.narrow(0, tp[0] * block_size, keys).unsqueeze(0).transpose(1, 2);
    return cache.view({-1, block_size, kv, d}).index_select(0, tab.flatten()).view({b, m * block_size, kv, d})
        .narrow(1, 0, keys).transpose(1, 2);
  };
  c10::optional<at::Tensor> mask;
  if (!all) mask = (at::arange(keys, len.options()) < len.unsqueeze(1)).view({b, 1, 1, keys});   // [B, 1, 1, T]
  SerialRegion serial(b * h * keys <= kSerialScores);
  auto out = at::scaled_dot_product_attention(q.unsqueeze(2).reshape({b, kv, h / kv, d}), gather(k_cache),
                                              gather(v_cache), mask, 0.0, false, scale);
  return out.view({b, h, 1, d}).select(2, 0).contiguous();                          // [B, H, D]
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("add_rms_norm(Tensor x, Tensor? h, Tensor weight, float eps, int lanes) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lengths, int block_size, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("rope_store", &rope_store_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace wcodec
