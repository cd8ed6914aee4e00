"""The fixed-rate ops under `compute-sanitizer --tool memcheck`: the GPU transcoder, the decode and
the fused matmul (every row count 1..16 on both kernels, 24..64 on tensor cores, then 80 rows through
decode + cuBLAS) on ragged shapes with
escapes and every bit pattern. Exits non-zero if a result differs from the C++ twin's."""
import sys

import torch

import cuda_ext
from cuda_ext import fixedrate as fr_ops
from cuda_ext import ops


def main() -> int:
    assert cuda_ext.available().cuda, cuda_ext.available()
    ok = True
    for shape, finite in (((3, 31), False), ((37, 1000), True), ((130, 2049), True), ((256, 256), False),
                          ((4100, 2048), True)):
        w = fr_ops.sample_weight(torch.bfloat16, *shape, seed=shape[1], finite=finite)
        if shape == (256, 256):
            w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).reshape(shape).view(torch.bfloat16)
        fr = fr_ops.encode(w.cuda())
        ok &= all(torch.equal(a.cpu(), b) for a, b in zip(fr.arrays, ops.fixedrate_encode(w)))
        ok &= torch.equal(fr_ops.decode(fr).cpu().view(torch.int16), w.view(torch.int16))
        if finite:
            for n, kernel in [(n, k) for n in range(1, 17) for k in (0, 1)] + [(n, 0) for n in (24, 40, 64, 80)]:
                x = torch.randn(n, shape[1]).bfloat16()
                got = fr_ops.linear(x.cuda(), fr, kernel).cpu().float()
                ok &= bool(((got - x.float() @ w.float().T).abs() <= 0.02 * (1 + got.abs())).all())
    torch.cuda.synchronize()
    print("fixedrate sanitizer sample:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
