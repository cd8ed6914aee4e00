// The fixed-rate GPU form's CPU twin (codec/fixedrate.py line for line): encode a 16-bit weight,
// decode it back, and the matmul reference (decode, then float32). The CUDA twin is fixedrate.cu;
// the op schemas are declared here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "fixedrate.h"
#include "fixedrate_host.h"

namespace wcodec {

FrShape fr_check(const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& tile,
                 const at::Tensor& esc, const at::Tensor& esc_start, int64_t cols) {
  TORCH_CHECK(plane.dim() == 2 && plane.scalar_type() == at::kByte && plane.is_contiguous(), "plane: uint8 [rows, groups*32]");
  const int64_t rows = plane.size(0), groups = plane.size(1) / kFrGroup;
  const int64_t blocks = (groups + kFrBlockGroups - 1) / kFrBlockGroups;
  const int64_t tiles = (groups + kFrTileGroups - 1) / kFrTileGroups;
  TORCH_CHECK(plane.size(1) == groups * kFrGroup && cols > (groups - 1) * kFrGroup && cols <= groups * kFrGroup,
              "plane has ", plane.size(1), " columns, not whole groups holding ", cols);
  TORCH_CHECK(lo.scalar_type() == at::kInt && lo.is_contiguous() && lo.numel() == rows * groups * kFrLoWords, "lo: int32 [rows, groups*2]");
  TORCH_CHECK(hi.scalar_type() == at::kInt && hi.is_contiguous() && hi.numel() == rows * groups, "hi: int32 [rows, groups]");
  TORCH_CHECK(tile.scalar_type() == at::kShort && tile.is_contiguous() && tile.numel() == rows * tiles, "tile: int16 [rows, tiles]");
  TORCH_CHECK(esc.scalar_type() == at::kShort && esc.dim() == 1 && esc.is_contiguous(), "esc: int16 [n]");
  TORCH_CHECK(esc_start.scalar_type() == at::kInt && esc_start.is_contiguous() && esc_start.numel() == rows * blocks,
              "esc_start: int32 [rows, blocks]");
  for (const auto* t : {&lo, &hi, &tile, &esc, &esc_start})
    TORCH_CHECK(t->device() == plane.device(), "all arrays on one device");
  TORCH_CHECK(esc.numel() < (int64_t{1} << 31), "too many escapes");
  return {rows, cols, groups, tiles, blocks};
}

std::tuple<at::Tensor, int64_t> fr_escape_starts(const at::Tensor& tile, int64_t blocks) {
  const int64_t rows = tile.size(0), tiles = tile.size(1);
  auto counts = at::bitwise_and(at::bitwise_right_shift(tile.to(at::kLong), 8), 0xFF);
  auto padded = at::constant_pad_nd(counts, {0, blocks * kFrBlockTiles - tiles});
  auto per_block = padded.view({rows * blocks, kFrBlockTiles}).sum(1);
  auto inclusive = per_block.cumsum(0);
  const int64_t total = rows * blocks ? inclusive[-1].item<int64_t>() : 0;     // a host sync (load time only)
  TORCH_CHECK(total < (int64_t{1} << 31), "too many escapes for int32 escape starts");
  return {(inclusive - per_block).to(at::kInt).view({rows, blocks}), total};
}

FrShape fr_check_permuted(const at::Tensor& xp, int64_t rows, const at::Tensor& plane, const at::Tensor& lo,
                          const at::Tensor& hi, const at::Tensor& tile, const at::Tensor& esc, const at::Tensor& esc_start,
                          int64_t cols) {
  const FrShape s = fr_check(plane, lo, hi, tile, esc, esc_start, cols);
  TORCH_CHECK(rows >= kFrSlotRows && rows <= kFrMaxRows, "a permuted x holds ", kFrSlotRows, " to ", kFrMaxRows,
              " rows, not ", rows);
  TORCH_CHECK(xp.dim() == 2 && xp.size(0) == fr_permuted_rows(rows) && xp.size(1) == s.tiles * kFrTile &&
                  xp.is_contiguous() && xp.device() == plane.device(),
              "permuted x: contiguous [", fr_permuted_rows(rows), ", ", s.tiles * kFrTile, "] on the arrays' device");
  TORCH_CHECK(xp.scalar_type() == at::kBFloat16 || xp.scalar_type() == at::kHalf, "x: bfloat16 or float16");
  return s;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fr_alloc(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.element_size() == 2 && w.is_contiguous(), "the fixed-rate form takes a contiguous 2-D 16-bit weight");
  const int64_t rows = w.size(0), groups = (w.size(1) + kFrGroup - 1) / kFrGroup;
  const int64_t tiles = (groups + kFrTileGroups - 1) / kFrTileGroups;
  TORCH_CHECK(w.size(1) > 0, "a weight with no columns");
  auto u8 = w.options().dtype(at::kByte), i32 = w.options().dtype(at::kInt);
  return {at::empty({rows, groups * kFrGroup}, u8), at::empty({rows, groups * kFrLoWords}, i32),
          at::empty({rows, groups}, i32), at::empty({rows, tiles}, w.options().dtype(at::kShort))};
}

namespace {

std::vector<at::Tensor> encode_cpu(const at::Tensor& w_in) {
  auto [plane, lo, hi, tile] = fr_alloc(w_in);
  const auto* w = reinterpret_cast<const uint16_t*>(w_in.data_ptr());
  const int64_t rows = w_in.size(0), cols = w_in.size(1), groups = hi.size(1), tiles = tile.size(1);
  auto* tw = reinterpret_cast<uint16_t*>(tile.data_ptr<int16_t>());
  at::parallel_for(0, rows * tiles, 64, [&](int64_t a, int64_t z) {
    for (int64_t t = a; t < z; ++t) {
      const int64_t r = t / tiles, g = r * groups + (t % tiles) * kFrTileGroups, c0 = (t % tiles) * kFrTile;
      fr_encode_tile(w + r * cols + c0, std::min<int64_t>(kFrTile, cols - c0), static_cast<int>(groups - (t % tiles) * kFrTileGroups),
                     plane.data_ptr<uint8_t>() + g * kFrGroup, reinterpret_cast<uint32_t*>(lo.data_ptr<int32_t>()) + g * kFrLoWords,
                     reinterpret_cast<uint32_t*>(hi.data_ptr<int32_t>()) + g, tw + t);
    }
  });
  const int64_t blocks = (groups + kFrBlockGroups - 1) / kFrBlockGroups;
  auto [esc_start, total] = fr_escape_starts(tile, blocks);
  auto esc = at::empty({total}, tile.options());
  auto* e = reinterpret_cast<uint16_t*>(esc.data_ptr<int16_t>());
  at::parallel_for(0, rows * tiles, 64, [&](int64_t a, int64_t z) {
    for (int64_t t = a; t < z; ++t) {
      const int64_t r = t / tiles, c0 = (t % tiles) * kFrTile;
      fr_tile_entries(w + r * cols + c0, std::min<int64_t>(kFrTile, cols - c0), tw[t] & 0xFF,
                      e + fr_tile_start(esc_start.data_ptr<int32_t>(), tw, r, tiles, blocks, t % tiles));
    }
  });
  return {plane, lo, hi, tile, esc, esc_start};
}

// decode, one row, tile by tile as the kernels do: fields 4 at a time (unpack_codes + base), the
// tile's entries patched in (its first: the block's esc_start, then a running count), the words.
void decode_row(const FrShape& s, int64_t r, const uint8_t* plane, const uint32_t* lo, const uint32_t* hi,
                const uint16_t* tile, const uint16_t* esc, int64_t n_esc, const int32_t* esc_start, uint16_t* out) {
  int64_t first = 0;
  for (int64_t t = 0; t < s.tiles; ++t) {
    uint8_t field[kFrTile];
    const uint32_t word = tile[r * s.tiles + t], base4 = (word & 0xFFu) * 0x01010101u;
    const int64_t g0 = r * s.groups + t * kFrTileGroups, groups = std::min<int64_t>(kFrTileGroups, s.groups - t * kFrTileGroups);
    for (int64_t j = 0; j < groups; ++j)
      for (int q = 0; q < 8; ++q) {
        const uint32_t f4 = fr_fields4(lo[(g0 + j) * kFrLoWords], lo[(g0 + j) * kFrLoWords + 1], hi[g0 + j], q, base4);
        for (int b = 0; b < 4; ++b) field[j * kFrGroup + 4 * q + b] = static_cast<uint8_t>(f4 >> 8 * b);
      }
    if (t % kFrBlockTiles == 0) first = esc_start[r * s.blocks + t / kFrBlockTiles];
    for (int64_t k = first; k < first + (word >> 8); ++k) {
      const uint32_t e = k >= 0 && k < n_esc ? esc[k] : 0;             // bounds: never read past esc
      field[e & kFrPosMask] = static_cast<uint8_t>(e >> kFrFieldShift);
    }
    first += word >> 8;
    const uint8_t* p = plane + g0 * kFrGroup;
    uint16_t* o = out + r * s.cols + t * kFrTile;
    for (int64_t i = 0, n = std::min<int64_t>(kFrTile, s.cols - t * kFrTile); i < n; ++i) o[i] = fr_join(p[i], p[i ^ 1], field[i]);
  }
}

void decode_cpu(const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& tile,
                const at::Tensor& esc, const at::Tensor& esc_start, int64_t cols, const at::Tensor& out) {
  const FrShape s = fr_check(plane, lo, hi, tile, esc, esc_start, cols);
  TORCH_CHECK(out.element_size() == 2 && out.is_contiguous() && out.numel() == s.rows * cols && out.device() == plane.device(),
              "out: contiguous 16-bit [rows, cols] on the arrays' device");
  at::parallel_for(0, s.rows, 16, [&](int64_t a, int64_t z) {
    for (int64_t r = a; r < z; ++r)
      decode_row(s, r, plane.data_ptr<uint8_t>(), reinterpret_cast<const uint32_t*>(lo.data_ptr<int32_t>()),
                 reinterpret_cast<const uint32_t*>(hi.data_ptr<int32_t>()),
                 reinterpret_cast<const uint16_t*>(tile.data_ptr<int16_t>()),
                 reinterpret_cast<const uint16_t*>(esc.data_ptr<int16_t>()), esc.numel(), esc_start.data_ptr<int32_t>(),
                 reinterpret_cast<uint16_t*>(out.data_ptr()));
  });
}

// The matmul's reference: decode, then y = x W^T in float32, rounded once to x's dtype.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& plane, const at::Tensor& lo, const at::Tensor& hi,
                      const at::Tensor& tile, const at::Tensor& esc, const at::Tensor& esc_start, int64_t cols,
                      int64_t kernel) {
  TORCH_CHECK(kernel == 0 || kernel == 1, "kernel: 0 (tensor cores) or 1 (CUDA cores)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == plane.size(1), "x: [rows, groups*32] (zero-padded past cols)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "x: bfloat16 or float16");
  auto w = at::empty({plane.size(0), cols}, x.options());
  decode_cpu(plane, lo, hi, tile, esc, esc_start, cols, w);
  return at::matmul(x.narrow(1, 0, cols).to(at::kFloat), w.to(at::kFloat).t()).to(x.scalar_type());
}

// The layout as an index: int64 [fr_permuted_rows(rows), tiles * 128], element (r, c) of x (zero-padded
// to the layout's rows and columns) at index[r][c] of the permuted buffer, on the CPU.
at::Tensor permuted_index(int64_t rows, int64_t cols) {
  TORCH_CHECK(rows >= kFrSlotRows && rows <= kFrMaxRows && cols > 0, "a permuted x holds ", kFrSlotRows, " to ",
              kFrMaxRows, " rows, not ", rows);
  const int64_t width = (cols + kFrTile - 1) / kFrTile * kFrTile, padded = fr_permuted_rows(rows);
  auto index = at::empty({padded, width}, at::TensorOptions().dtype(at::kLong));
  auto* at = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < padded; ++r)
    for (int64_t c = 0; c < width; ++c) at[r * width + c] = fr_permuted_at(rows, r, c);
  return index;
}

// The permuted op's reference: x back in place (permuted_index), then linear_cpu.
at::Tensor linear_permuted_cpu(const at::Tensor& xp, int64_t rows, const at::Tensor& plane, const at::Tensor& lo,
                               const at::Tensor& hi, const at::Tensor& tile, const at::Tensor& esc,
                               const at::Tensor& esc_start, int64_t cols) {
  const FrShape s = fr_check_permuted(xp, rows, plane, lo, hi, tile, esc, esc_start, cols);
  const auto index = permuted_index(rows, cols).narrow(0, 0, rows).narrow(1, 0, s.groups * kFrGroup);
  const auto x = xp.reshape(-1).index_select(0, index.reshape(-1)).view({rows, s.groups * kFrGroup});
  return linear_cpu(x, plane, lo, hi, tile, esc, esc_start, cols, 0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wcodec, m) {
  m.def("fixedrate_encode(Tensor w) -> Tensor[]");
  m.def("fixedrate_decode(Tensor plane, Tensor lo, Tensor hi, Tensor tile, Tensor esc, Tensor esc_start, int cols, "
        "Tensor(a!) out) -> ()");
  m.def("fixedrate_linear(Tensor x, Tensor plane, Tensor lo, Tensor hi, Tensor tile, Tensor esc, Tensor esc_start, "
        "int cols, int kernel=0) -> Tensor");
  m.def("fixedrate_linear_permuted(Tensor xp, int rows, Tensor plane, Tensor lo, Tensor hi, Tensor tile, Tensor esc, "
        "Tensor esc_start, int cols) -> Tensor");
  m.def("fixedrate_permuted_index(int rows, int cols) -> Tensor", &permuted_index);
}

TORCH_LIBRARY_IMPL(wcodec, CPU, m) {
  m.impl("fixedrate_encode", &encode_cpu);
  m.impl("fixedrate_decode", &decode_cpu);
  m.impl("fixedrate_linear", &linear_cpu);
  m.impl("fixedrate_linear_permuted", &linear_permuted_cpu);
}

}  // namespace wcodec
