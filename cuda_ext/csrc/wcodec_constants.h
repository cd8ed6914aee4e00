// Format constants of .wcodec v1 for the C++ and CUDA decoders. codec/constants.py is the source
// of truth; tests/cuda_ext/test_constants.py checks that every value here matches it.
#pragma once
#include <cstdint>

namespace wcodec {

constexpr int kProbBits = 12;                    // PROB_BITS: frequencies sum to M
constexpr uint32_t kProbScale = 1u << kProbBits; // PROB_SCALE (M)
constexpr uint32_t kRansL = 1u << 16;            // RANS_L: decoder invariant L <= x < 2^32
constexpr int kRenormBits = 16;                  // RENORM_BITS
constexpr int kLanes = 32;                       // LANES: one warp, one lane per state
constexpr int64_t kSegmentSteps = 4096;          // SEGMENT_STEPS: symbols per lane in a full segment
constexpr int64_t kSegmentSymbols = 131072;      // SEGMENT_SYMBOLS = LANES * SEGMENT_STEPS
constexpr int kSegmentAlign = 16;                // SEGMENT_ALIGN
constexpr int kStateBytes = 4 * kLanes;          // STATE_BYTES
constexpr int kTableBitmapBytes = 32;            // TABLE_BITMAP_BYTES
constexpr int kMaxCtxBits = 2;                   // MAX_CTX_BITS
constexpr int64_t kMinCodedElements = 4096;      // MIN_CODED_ELEMENTS: smaller float tensors stay raw
constexpr int64_t kTableGroups[] = {4, 8, 16};   // TABLE_GROUPS: segments per table set, besides "all"
constexpr int kLog2FracBits = 24;                // LOG2_FRAC_BITS: encoder costs in fixed-point bits

// Per-tensor descriptor rows (int64), built by cuda_ext/plan.py. Offsets are relative to the
// start of the data buffer handed to the op.
enum DescField : int {
  kDescExpOff = 0, kDescExpLen, kDescHiOff, kDescLoOff, kDescNumel, kDescCtxBits,
  kDescTableGroup, kDescDtype, kDescFirstSegment, kDescFields
};
enum DtypeCode : int { kBF16 = 0, kFP16 = 1, kFP32 = 2, kU8 = 3 };   // kU8: a byte plane coded alone (decode_bytes)

// What one launch decodes (codec/resident.py): whole segments from the file's states; the same
// while recording the resident index every entry_steps steps; or pieces of entry_steps steps,
// each started from its index entry and checked against the next.
enum Mode : int64_t { kBulk = 0, kRecord = 1, kIndexed = 2 };
constexpr int64_t kMinEntrySteps = 8;            // a GPU warp decodes in chunks of 8 steps

// Status per segment (per piece in kIndexed mode), turned into CorruptStreamError on the host (cuda_ext/plan.py: STATUS_TEXT).
enum Status : int32_t {
  kOk = 0,
  kWords = 1,        // the segment used more or fewer words than it holds
  kState = 2,        // a lane did not end at L
  kDirectory = 3,    // the stream's directory points outside the stream or is misaligned
  kTable = 4,        // a table is malformed (sum != M, present symbol with freq 0, overruns)
};

}  // namespace wcodec
