// The encoder's host-side pieces shared by the C++ twin (encode_float.cpp, which defines them) and
// the CUDA op (encode_float.cu): argument checks, the planes of an encode_planes call with their
// packed tables, and the layout of an exp stream (floatcodec._assemble) from its word counts.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "encode_tables.h"

namespace wcodec {

const Log2Table& log2_table();

// Elements of a plane (uint8 `data`, 1-D, contiguous) of the given dtype code; checks the arguments.
int64_t plane_symbols(const at::Tensor& data, int64_t dtype);

// One plane of a prepare_planes call: its elements and raw planes (on its device), its segments,
// and its first segment in the batch (its first row of fine counts).
struct PlaneShape {
  const uint8_t* in;
  uint8_t *hi, *lo;
  int64_t n, n_seg, dtype, first_seg;
};

// A prepare_planes call: the planes, and its outputs: choices and freqs on the host (pinned for the
// CUDA op, which copies them over without waiting), hi and lo on the planes' device.
struct PrepareBatch {
  std::vector<PlaneShape> planes;
  int64_t total_seg = 0;
  at::Tensor choices;                          // int64 [k, 3]: coded, ctx_bits, table_group
  std::vector<at::Tensor> freqs, hi, lo;       // int32 [4 ceil(n_seg / 4), 256]; uint8 [n] or [0]; [2n] or [0]
  std::vector<at::Tensor> outputs(const at::Device& device) const;   // [choices, (freqs, hi, lo) per plane]
};
PrepareBatch prepare_batch(at::TensorList data, at::IntArrayRef dtypes, bool pinned);

// The cheapest tables of every plane of `b` from their fine counts [total_seg][kFineTables][256] (host
// memory), into b.choices and b.freqs: one task per (plane, candidate), spread over the threads.
void choose_planes(const int32_t* fine, PrepareBatch& b);

// prepare_plane's outputs from a prepare_planes call of that one plane.
std::vector<at::Tensor> first_plane(const std::vector<at::Tensor>& batch);

struct PlaneJob {               // one plane of an encode_planes call
  const uint8_t* in;
  int64_t dtype, n, n_seg, ctx_bits, group, first_seg;
  at::Tensor freqs;               // int32 [>= n_tables, 256], on the host
  std::vector<EncodeEntry> entries;
  std::vector<uint32_t> fc;       // the AVX-512 step's copy: freq << 16 | cum ...
  std::vector<double> inv;        // ... and 1.0 / freq
  int64_t n_tables() const { return ((n_seg + group - 1) / group) << ctx_bits; }
};

std::vector<PlaneJob> plane_jobs(at::TensorList data, at::IntArrayRef dtypes, at::TensorList freqs,
                                 at::IntArrayRef ctx_bits, at::IntArrayRef groups);

// Where an exp stream's parts go: head = its bytes before the first segment (directory, tables,
// zero pad); segment s at seg_off[s], seg_off[n_seg] = the stream's length.
struct StreamLayout {
  std::vector<uint8_t> head;
  std::vector<int64_t> seg_off;
};
StreamLayout stream_layout(const PlaneJob& p, const int64_t* counts);

}  // namespace wcodec
