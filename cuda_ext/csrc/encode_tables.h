// Choosing a plane's tables on the host (floatcodec._cheapest), shared by the C++ twin and the
// CUDA op (which counts on the device and chooses here). Integer maths only: the same choice as
// codec/tables.py on every machine (encode_common.h says why).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "encode_common.h"

namespace wcodec {

// Counts [256] -> frequencies summing to M (tables.normalize): rare symbols get 1, the others a
// floor of their share of the rest, then slots go one at a time to where they cost least.
inline void settle_row(const int64_t* c, int64_t diff, const Log2Table& L, uint32_t* f);

inline void normalize_row(const int64_t* c, const Log2Table& L, uint32_t* f) {
  int64_t total = 0, rest_total = 0, rare = 0;
  for (int s = 0; s < 256; ++s) total += c[s];
  for (int s = 0; s < 256; ++s) {
    const bool is_rare = c[s] > 0 && c[s] * kProbScale < total;
    rare += is_rare;
    rest_total += (c[s] > 0 && !is_rare) ? c[s] : 0;
  }
  const int64_t rest = kProbScale - rare;
  rest_total = std::max<int64_t>(rest_total, 1);
  for (int s = 0; s < 256; ++s) {
    const bool is_rare = c[s] > 0 && c[s] * kProbScale < total;
    f[s] = is_rare ? 1u : c[s] > 0 ? static_cast<uint32_t>(std::max<int64_t>(1, c[s] * rest / rest_total)) : 0u;
  }
  while (total > 0) {
    int64_t sum = 0;
    for (int s = 0; s < 256; ++s) sum += f[s];
    if (sum == kProbScale) return;
    settle_row(c, kProbScale - sum, L, f);
  }
}

// One round of tables._settle: a row short of M grows its `diff` cheapest-to-grow symbols by one,
// a row over M shrinks its -diff cheapest-to-shrink ones. Ties go to the lower symbol (NumPy's
// stable argsort), so (key, symbol) is a total order and a partial sort picks the same set.
inline void settle_row(const int64_t* c, int64_t diff, const Log2Table& L, uint32_t* f) {
  int64_t key[256];
  int idx[256];
  for (int s = 0; s < 256; ++s) {
    idx[s] = s;
    key[s] = diff > 0 ? (c[s] > 0 ? -(c[s] * (L.v[f[s] + 1] - L.v[f[s]])) : 1)      // -(bits saved)
                      : (f[s] > 1 ? c[s] * (L.v[f[s]] - L.v[f[s] - 1]) : kNever);   // bits lost
  }
  const int k = static_cast<int>(std::min<int64_t>(diff > 0 ? diff : -diff, 256));
  std::partial_sort(idx, idx + k, idx + 256, [&](int a, int b) { return key[a] < key[b] || (key[a] == key[b] && a < b); });
  for (int r = 0; r < k; ++r) {
    const int s = idx[r];
    if (diff > 0 && c[s] > 0) ++f[s];
    if (diff < 0 && f[s] > 1) --f[s];
  }
}

// Coded bits of a table's counts, fixed point (tables.cost_fixed): sum of c * (P - log2 f).
inline int64_t cost_fixed(const int64_t* c, const uint32_t* f, const Log2Table& L) {
  int64_t bits = 0;
  for (int s = 0; s < 256; ++s)
    if (c[s] > 0) bits += c[s] * ((int64_t{kProbBits} << kLog2FracBits) - L.v[f[s]]);
  return bits;
}

// Fine counts [n_seg][kFineTables][256] -> counts [n_tables][256] of one ctx_bits / table_group
// (floatcodec._grouped): table (set, ctx) sums the set's segments and the fine rows of that ctx.
inline void group_counts(const int32_t* fine, int64_t n_seg, int ctx_bits, int64_t group, int64_t* out) {
  const int64_t n_tables = ((n_seg + group - 1) / group) << ctx_bits;
  std::fill(out, out + n_tables * 256, int64_t{0});
  for (int64_t seg = 0; seg < n_seg; ++seg)
    for (int c4 = 0; c4 < kFineTables; ++c4) {
      int64_t* row = out + (((seg / group) << ctx_bits) + (c4 >> (kMaxCtxBits - ctx_bits))) * 256;
      const int32_t* src = fine + (seg * kFineTables + c4) * 256;
      for (int s = 0; s < 256; ++s) row[s] += src[s];
    }
}

// Normalise every table of one choice and price it, tables and their offsets included
// (floatcodec._cost_fixed). `pfor(n, fn)` runs fn(i) for i in [0, n), in parallel if it likes.
template <class ParallelFor>
int64_t price_choice(const int32_t* fine, int64_t n_seg, int ctx_bits, int64_t group, const Log2Table& L,
                     std::vector<uint32_t>& freqs, ParallelFor pfor) {
  const int64_t n_tables = ((n_seg + group - 1) / group) << ctx_bits;
  std::vector<int64_t> counts(n_tables * 256);
  group_counts(fine, n_seg, ctx_bits, group, counts.data());
  freqs.assign(n_tables * 256, 0);
  std::vector<int64_t> bits(n_tables);
  pfor(n_tables, [&](int64_t j) {
    normalize_row(counts.data() + j * 256, L, freqs.data() + j * 256);
    bits[j] = cost_fixed(counts.data() + j * 256, freqs.data() + j * 256, L) +
              ((8 * serialized_size(freqs.data() + j * 256)) << kLog2FracBits);
  });
  int64_t total = (8 * 4 * (n_tables + 1)) << kLog2FracBits;
  for (int64_t b : bits) total += b;
  return total;
}

// The (ctx_bits, table_group) pairs floatcodec._cheapest tries, in its order: ctx_bits outer.
struct Candidate {
  int ctx_bits;
  int64_t group;
};
constexpr int kMaxCandidates = (kMaxCtxBits + 1) * 4;

inline int candidates(int64_t n_seg, int max_ctx_bits, Candidate* out) {
  int64_t groups[4];
  const int n_groups = candidate_groups(n_seg, groups);
  int m = 0;
  for (int ctx_bits = 0; ctx_bits <= max_ctx_bits; ++ctx_bits)
    for (int g = 0; g < n_groups; ++g) out[m++] = Candidate{ctx_bits, groups[g]};
  return m;
}

// The best of the candidates priced so far: the first of least cost (the reference's strict <).
inline bool cheaper(const Choice& best, int64_t cost) { return best.table_group == 0 || cost < best.cost; }

// coded = false when storing the plane raw is no larger than the tables, segments and symbols.
inline bool worth_coding(int64_t cost, int64_t n_seg, int64_t n) {
  return cost + ((n_seg * kSegmentOverheadBits) << kLog2FracBits) < ((8 * n) << kLog2FracBits);
}

}  // namespace wcodec
