"""The W8A16 ops under `compute-sanitizer` (memcheck, then racecheck: cols_kernel's warps add their
sums through shared memory, rows_kernel's CTA stages x's and W's steps there by cp.async):
fp8_to_bf16 on ragged lengths (the tail byte by byte), fp8_linear at every row count 1..16 and at
17..64's edges on ragged shapes with a scale a row, a tensor and a 128 x 128 block, K cut across
CTAs (few rows of W) and not, and chained at 4 and 40 rows (each product read by the next). Exits
non-zero if a decode differs from the C++ twin's or a product from the twin's by more than two
roundings (of the element, or of its row's largest where the sum cancels)."""
import sys

import torch

import cuda_ext
from cuda_ext import fp8

# (N, K, block): k/v-like with K cut across CTAs, a tensor's scale, ragged 128 x 128 blocks, one CTA of W
SHAPES = [(1024, 4096, (1, 4096)), (130, 272, (130, 272)), (300, 400, (128, 128)), (16, 16, (16, 16)),
          (4096, 1024, (128, 128))]


def main() -> int:
    assert cuda_ext.available().cuda, cuda_ext.available().reason
    bad = 0
    for numel in (1, 3, 4, 5, 1000, 4097):
        b = torch.randint(0, 256, (numel,), dtype=torch.uint8)
        bad += not torch.equal(fp8.to_bf16(b.cuda()).cpu().view(torch.int16), fp8.to_bf16(b).view(torch.int16))
    for n, k, block in SHAPES:
        w = fp8.sample_weight(n, k, seed=n)
        scale = torch.rand(-(-n // block[0]), -(-k // block[1])) / 64 + 1e-3
        wc, sc = w.cuda(), scale.cuda()
        for m in (*range(1, 17), 17, 24, 32, 33, 48, 64):
            x = torch.randn(m, k).to(torch.bfloat16)
            got, want = fp8.linear(x.cuda(), wc, sc, block).cpu().float(), fp8.linear(x, w, scale, block).float()
            room = want.abs() * 2.0 ** -7 + want.abs().amax(1, keepdim=True) * 2.0 ** -10   # cancellation: a row's scale
            if not bool(((got - want).abs() <= room).all()):
                print("  mismatch:", n, k, block, m)
                bad += 1
    chain = [(fp8.sample_weight(4096, 4096, seed=s).cuda(), torch.full((1, 1), 1 / 4096, device="cuda")) for s in (1, 2)]
    finite = True
    for rows in (4, 40):
        x = torch.randn(rows, 4096, device="cuda").bfloat16()
        for w, s in chain * 2:
            x = fp8.linear(x, w, s, (4096, 4096))
        finite &= bool(x.isfinite().all())
    torch.cuda.synchronize()
    print(f"fp8 sanitizer: {bad} mismatches; chained output finite: {finite}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
