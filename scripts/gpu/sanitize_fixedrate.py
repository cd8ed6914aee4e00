"""The fixed-rate ops under `compute-sanitizer --tool memcheck`: the GPU transcoder, the decode and
the fused matmul (every row count 1..16 on both kernels, 24..64 on tensor cores, then 80 rows through
decode + cuBLAS; 6100 rows take the wide kernel in CTAs of 6 warps, 16400 in CTAs of 5, 4100 x 3077 K
in 6 ranges (mma_kernel's CTAs of 6 warps); from 7 rows
also x handed over in the kernel's layout) on ragged
shapes with escapes and every bit pattern, with most weights escaping at other offsets of the
escapes, and chained (each linear reading the one before's output). Exits non-zero if a result
differs from the C++ twin's."""
import sys

import torch

import cuda_ext
from cuda_ext import fixedrate as fr_ops
from cuda_ext import ops


def check(good: bool, *case) -> bool:
    """`good`, naming the case when it is not."""
    if not good:
        print("  mismatch:", *case)
    return good


# (rows of x, kernel) run on a matrix: 1..16 on both kernels, 24..80 on tensor cores (80: decode +
# cuBLAS). WIDE: the wide kernel's alone, for 16400 rows (CTAs of 5 warps), where racecheck reports a
# WAR hazard inside cuBLAS's own kernel (nvjet_sm90_tst_128x80_64x8) at 80 rows with every build of
# ours (H200, 2026-11-30). A matrix with no runs holds every bit pattern (encode and decode only).
EVERY = [(n, k) for n in range(1, 17) for k in (0, 1)] + [(n, 0) for n in (24, 40, 64, 80)]
WIDE = [(24, 0), (40, 0)]
MATRICES = (((3, 31), ()), ((37, 1000), EVERY), ((130, 2049), EVERY), ((256, 256), ()), ((4100, 2048), EVERY),
            ((6100, 2048), EVERY),                               # 7-16 rows 6 CTAs an SM; from 17 CTAs of 6 warps
            ((4100, 3077), EVERY),                               # K in 6 ranges: CTAs of 6 warps (128+ SMs)
            ((16400, 1024), WIDE))                               # CTAs of 5 (132 SMs)


def main() -> int:
    assert cuda_ext.available().cuda, cuda_ext.available()
    torch.manual_seed(0)
    ok = True
    for shape, runs in MATRICES:
        w = fr_ops.sample_weight(torch.bfloat16, *shape, seed=shape[1], finite=bool(runs))
        if shape == (256, 256):
            w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).reshape(shape).view(torch.bfloat16)
        fr = fr_ops.encode(w.cuda())
        ok &= check(all(torch.equal(a.cpu(), b) for a, b in zip(fr.arrays, ops.fixedrate_encode(w))), "encode", shape)
        ok &= check(torch.equal(fr_ops.decode(fr).cpu().view(torch.int16), w.view(torch.int16)), "decode", shape)
        for n, kernel in runs:
            x = torch.randn(n, shape[1]).bfloat16()
            got = fr_ops.linear(x.cuda(), fr, kernel).cpu().float()
            err = ((got - x.float() @ w.float().T).abs() / (1 + got.abs())).max().item()
            ok &= check(err <= 0.02, "linear", shape, "rows", n, "kernel", kernel, "error", err)
            if kernel == 0 and fr_ops.SLOT_ROWS <= n <= fr_ops.FUSED_MAX_ROWS:   # x in the kernel's layout
                with fr_ops.fused_rows(fr_ops.FUSED_MAX_ROWS):
                    permuted = fr_ops.linear(fr_ops.permute(x.cuda()), fr).cpu().float()
                ok &= check(torch.equal(permuted, got), "permuted x", shape, "rows", n)
    ok &= escapes_everywhere()
    ok &= chained()
    torch.cuda.synchronize()
    print("fixedrate sanitizer sample:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


def chained() -> bool:
    """Fused linears each reading the one before's output (launched while it ends, on sm_90+): the
    same bits as with a device sync between them."""
    forms = [fr_ops.encode(fr_ops.sample_weight(torch.bfloat16, r, c, seed=r + c, finite=True).cuda() * 0.05)
             for r, c in ((1024, 2048), (2048, 1024), (520, 2048), (2048, 520))]
    ok = True
    for n in (1, 3, 6, 16, 32):
        x = y = torch.randn(n, 2048).bfloat16().cuda()
        for f in forms:
            x = fr_ops.linear(x, f)
        for f in forms:
            y = fr_ops.linear(y, f)
            torch.cuda.synchronize()
        ok &= check(torch.equal(x, y), "chain", "rows", n)
    return ok


def escapes_everywhere() -> bool:
    """Most weights escaping (exponents over 40 values: the kernels' escape windows overflow to
    their slow path) with the escape array at other offsets: the decode bit-exact and the fused
    outputs the same bits as with the array where the encoder put it."""
    g = torch.Generator().manual_seed(5)
    e, m = torch.randint(100, 140, (24, 4096 + 64), generator=g), torch.randint(0, 256, (24, 4096 + 64), generator=g)
    w = ((m & 0x80) << 8 | e << 7 | (m & 0x7F)).to(torch.int16).view(torch.bfloat16)
    fr, ok = fr_ops.encode(w.cuda()), True
    xs = {n: torch.randn(n, fr.cols).bfloat16().cuda() for n in (1, 5, 16, 32)}
    want = {(n, k): fr_ops.linear(x, fr, k) for n, x in xs.items() for k in (0, 1) if k == 0 or n <= 16}
    for shift in range(1, 3):
        esc = torch.cat([torch.zeros(shift, dtype=torch.int16, device="cuda"), fr.esc])[shift:]
        moved = fr_ops.FixedRateWeight(fr.rows, fr.cols, fr.dtype, fr.plane, fr.lo, fr.hi, fr.tile, esc, fr.esc_start)
        ok &= torch.equal(fr_ops.decode(moved).cpu().view(torch.int16), w.view(torch.int16))
        for (n, k), y in want.items():
            ok &= check(torch.equal(fr_ops.linear(xs[n], moved, k).view(torch.int16), y.view(torch.int16)),
                        "escapes shifted by", shift, "rows", n, "kernel", k)
    return ok


if __name__ == "__main__":
    sys.exit(main())
