// CRC-32 of many byte spans at once, in parallel: the checksum of format 1.0 (zlib.crc32, the
// reflected polynomial 0xEDB88320), so a reader can verify an archive's streams on the device
// they were copied to, beside their decode (docs/FORMAT.md §4). Shared by the C++ twin
// (crc32.cpp) and the kernels (crc32.cu), which differ only in how blocks and threads are run.
//
// Read me first: how a sequential checksum becomes parallel work.
// * R(r, D) is the CRC register after feeding D to a register holding r. It is affine in r:
//       R(r, A || B) = shift(R(r, A), |B|) ^ R(0, B),   shift(v, n) = v * x^(8n) mod P   (crc_mul)
//   so the pieces of a span are checksummed independently from r = 0 and folded pairwise.
// * zlib.crc32(D) = ~R(~0, D). Zero bytes fed to a zero register leave it zero, so a span is
//   padded with zeros at the FRONT to a whole number of pieces (the end stays aligned: every
//   piece and every fold has a power-of-two length), and the ~0 start is XORed into the register
//   at the span's first real byte. An empty span's CRC is 0.
// * Pass 0: a block of kCrcFan threads, each a piece of kCrcPiece bytes, folds kCrcFan pieces
//   into one value per 64 KiB unit. Pass p > 0 folds kCrcFan values of pass p - 1 into one,
//   (front-padded with zero values, which fold to nothing), until one value a span is left.
#pragma once
#include <cstdint>
#include <vector>

#include "decode_common.h"

namespace wcodec {

constexpr uint32_t kCrcPoly = 0xEDB88320u;   // zlib's CRC-32, bit-reflected: bit 31 is x^0
constexpr int kCrcPieceLog = 8;               // a thread's piece: 256 bytes
constexpr int kCrcFanLog = 8;                 // a block folds 256 pieces or values
constexpr int kCrcFan = 1 << kCrcFanLog;
constexpr int kCrcUnitLog = kCrcPieceLog + kCrcFanLog;   // pass 0's values: 64 KiB of span each
constexpr int kCrcPowers = 64;

// a * b mod P over GF(2), in the reflected order (bit 31 = x^0, bit 0 = x^31).
WC_HD uint32_t crc_mul(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) p ^= b;
    b = (b >> 1) ^ ((b & 1u) ? kCrcPoly : 0u);         // b = b * x mod P
  }
  return p;
}

// x[k] = x^(8 * 2^k) mod P: multiplying by it shifts a register past 2^k zero bytes.
struct CrcPowers {
  uint32_t x[kCrcPowers];
};

inline CrcPowers crc_powers() {
  CrcPowers p{};
  p.x[0] = 0x80000000u >> 8;                             // x^8
  for (int k = 1; k < kCrcPowers; ++k) p.x[k] = crc_mul(p.x[k - 1], p.x[k - 1]);
  return p;
}

// Sarwate's table: the register after one byte i fed to a zero register.
WC_HD uint32_t crc_table_entry(uint32_t i) {
  for (int k = 0; k < 8; ++k) i = (i >> 1) ^ ((i & 1u) ? kCrcPoly : 0u);
  return i;
}

// R(0, piece) of the zero-padded span: its real bytes [a, b) of `span` (a < b, or none), with
// ~0 entering the register at the span's first byte (a == 0).
WC_HD uint32_t crc_piece(const uint32_t* table, const uint8_t* span, int64_t a, int64_t b) {
  uint32_t r = a == 0 && b > 0 ? 0xFFFFFFFFu : 0u;
  int64_t i = a;
  for (; i < b && (reinterpret_cast<uintptr_t>(span + i) & 3); ++i) r = (r >> 8) ^ table[(r ^ span[i]) & 0xFF];
  for (; i + 4 <= b; i += 4) {                           // little-endian words: bytes in order
    r ^= *reinterpret_cast<const uint32_t*>(span + i);    // aligned
    r = (r >> 8) ^ table[r & 0xFF];
    r = (r >> 8) ^ table[r & 0xFF];
    r = (r >> 8) ^ table[r & 0xFF];
    r = (r >> 8) ^ table[r & 0xFF];
  }
  for (; i < b; ++i) r = (r >> 8) ^ table[(r ^ span[i]) & 0xFF];
  return r;
}

// The passes' layout, packed as int64: offs[n] | lens[n] | firsts[passes][n + 1], where
// firsts[p][i] is span i's first value in pass p (crc32.cpp: crc_plan; copied to the device as is).
struct CrcView {
  const int64_t* offs;
  const int64_t* lens;
  const int64_t* firsts;
  int64_t n;

  WC_HD const int64_t* pass(int p) const { return firsts + p * (n + 1); }
  WC_HD int64_t count(int p, int64_t i) const { return pass(p)[i + 1] - pass(p)[i]; }
};

WC_HD CrcView crc_view(const int64_t* packed, int64_t n) { return CrcView{packed, packed + n, packed + 2 * n, n}; }

// Input t of block j of span i in pass p: pass 0 a piece of the zero-padded span (real bytes
// [a, b), its register from 0), later passes a value of the pass before (0 where padded).
WC_HD uint32_t crc_input(const CrcView& v, int p, const uint8_t* data, const uint32_t* in, int64_t i, int64_t j,
                         int t, const uint32_t* table) {
  if (p == 0) {
    const int64_t pad = (v.count(0, i) << kCrcUnitLog) - v.lens[i];
    const int64_t start = (j << kCrcUnitLog) + (static_cast<int64_t>(t) << kCrcPieceLog) - pad;
    const int64_t end = start + (int64_t{1} << kCrcPieceLog);
    return end <= 0 ? 0u : crc_piece(table, data + v.offs[i], start < 0 ? 0 : start, end);
  }
  const int64_t k = j * kCrcFan + t - (v.count(p, i) * kCrcFan - v.count(p - 1, i));
  return k < 0 ? 0u : in[v.pass(p - 1)[i] + k];
}

// Fold two neighbours at level l of pass p: each input spans 2^(8 + 8p) bytes, so the right one
// spans 2^(8 + 8p + l): R(A || B) = shift(R(A), |B|) ^ R(B).
WC_HD uint32_t crc_fold(uint32_t left, uint32_t right, const CrcPowers& powers, int p, int l) {
  return crc_mul(left, powers.x[kCrcPieceLog + kCrcFanLog * p + l]) ^ right;
}

// Values each pass leaves per span: pass 0 one per 64 KiB unit (at least one), then one per
// kCrcFan values before, until every span has one.
inline std::vector<std::vector<int64_t>> crc_pass_counts(const std::vector<int64_t>& lens) {
  std::vector<std::vector<int64_t>> passes(1);
  int64_t most = 1;
  for (int64_t len : lens) {
    passes[0].push_back(len > 0 ? (len + (int64_t{1} << kCrcUnitLog) - 1) >> kCrcUnitLog : 1);
    most = passes[0].back() > most ? passes[0].back() : most;
  }
  for (; most > 1; most = (most + kCrcFan - 1) / kCrcFan) {
    std::vector<int64_t> next;
    for (int64_t c : passes.back()) next.push_back((c + kCrcFan - 1) / kCrcFan);
    passes.push_back(next);
  }
  return passes;
}

// A host's plan of the passes (crc32.cpp: crc_plan): `packed` as CrcView reads it.
struct CrcPlan {
  int64_t n = 0;
  int passes = 0;
  std::vector<int64_t> packed;

  CrcView view() const { return crc_view(packed.data(), n); }
  int64_t blocks(int p) const { return view().pass(p)[n]; }
};

// The finished checksum of a span from its last value.
WC_HD int64_t crc_finish(uint32_t v, int64_t len) { return len > 0 ? static_cast<int64_t>(~v) : 0; }

}  // namespace wcodec
