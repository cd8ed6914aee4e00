"""Does the fixed-rate form's row-major layout cost the fused kernel DRAM bandwidth (issue 24)? A
load-only replica of the tensor-core kernel's walk (its grid, 4 warps a CTA, up to 7 CTAs an SM,
split-K as `launch` picks it, one tile ahead): each lane reads its group's 32 plane bytes, 8 code
bytes, 4 high-code bytes and its tile's word, then spins WORK rounds of integer work standing in
for the decode. Layout 0 is the form as stored ([rows][groups]); layout 1 interleaves a warp's 8
rows, so that a tile step's bytes are contiguous ([row groups of 8][tiles][8 rows][4 groups]).
Prints GB/s for each of the 8B layer's matrix shapes beside a plain streaming read of the same
bytes. Needs cupy (the lent GPU box has it).

    python bench/experiments/fixedrate_layout_probe.py
"""
from __future__ import annotations

import cupy as cp
import numpy as np

SRC = r"""
template <int L>
__device__ __forceinline__ void ld(const uint4* __restrict__ plane, const uint2* __restrict__ lo,
    const unsigned* __restrict__ hi, const unsigned* __restrict__ tw, long long rg, int row, int t, int lane,
    int groups, int tiles, int s, uint4& p0, uint4& p1, uint2& l, unsigned& h, unsigned& w) {
  long long g, gw;
  if (L == 0) { g = (long long)row * groups + s * 4 + t; gw = (long long)row * tiles + s; }
  else { g = (rg * tiles + s) * 32 + lane; gw = (rg * tiles + s) * 8 + (lane >> 2); }
  p0 = __ldg(plane + 2 * g); p1 = __ldg(plane + 2 * g + 1); l = __ldg(lo + g); h = __ldg(hi + g); w = __ldg(tw + gw);
}
template <int L>
__global__ void __launch_bounds__(128, 7) walk(const uint4* __restrict__ plane, const uint2* __restrict__ lo,
    const unsigned* __restrict__ hi, const unsigned* __restrict__ tw, int rows, int groups, int tiles,
    int splits_cta, int work, unsigned* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const long long rg = (long long)blockIdx.x * (4 / splits_cta) + warp / splits_cta;
  const int row = (int)min(rg * 8 + (lane >> 2), (long long)rows - 1);
  const int k = warp % splits_cta, t0 = tiles * k / splits_cta, t1 = tiles * (k + 1) / splits_cta;
  unsigned acc = 0, ah, aw, bh, bw;
  uint4 a0, a1, b0, b1;
  uint2 al, bl;
  ld<L>(plane, lo, hi, tw, rg, row, t, lane, groups, tiles, t0, a0, a1, al, ah, aw);
  for (int s = t0; s < t1; ++s) {
    if (s + 1 < t1) ld<L>(plane, lo, hi, tw, rg, row, t, lane, groups, tiles, s + 1, b0, b1, bl, bh, bw);
    unsigned v = a0.x ^ a0.y ^ a0.z ^ a0.w ^ a1.x ^ a1.y ^ a1.z ^ a1.w ^ al.x ^ al.y ^ ah ^ aw;
    for (int i = 0; i < work; ++i) v = v * 1664525u + 1013904223u + (v >> 7);
    acc += v;
    a0 = b0, a1 = b1, al = bl, ah = bh, aw = bw;
  }
  if (acc == 0x12345678u) out[0] = acc;                             // keeps the loads
}
"""
SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096)]   # gate/up, down, q/o, k/v


def event_ms(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / n


def main() -> None:
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=["walk<0>", "walk<1>"])
    out = cp.zeros(1, cp.uint32)
    words = lambda n: cp.random.randint(0, 2**31, size=n, dtype=cp.uint32)   # noqa: E731
    for rows, cols in SHAPES:
        groups, tiles = cols // 32, cols // 128
        arrays = [words(rows * groups * 8), words(rows * groups * 2), words(rows * groups), words(rows * tiles)]
        nbytes = sum(a.nbytes for a in arrays)
        row_groups, splits = (rows + 7) // 8, 1
        while splits < 4 and row_groups * splits < 4096 and splits * 4 <= tiles:
            splits *= 2
        ctas = (row_groups + 4 // splits - 1) // (4 // splits)
        flat = cp.zeros(nbytes // 4, cp.float32)
        line = f"{rows}x{cols} {nbytes / 1e6:.1f} MB, split {splits}: streaming sum {nbytes / event_ms(flat.sum) / 1e6:.0f} GB/s"
        for work in (0, 16, 48):
            for layout in (0, 1):
                f = mod.get_function(f"walk<{layout}>")
                args = (*arrays, np.int32(rows), np.int32(groups), np.int32(tiles), np.int32(splits), np.int32(work), out)
                ms = event_ms(lambda: f((ctas,), (128,), args))
                line += f" | work {work} layout {layout}: {nbytes / ms / 1e6:.0f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
