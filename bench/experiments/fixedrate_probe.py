"""One fused fixed-rate matmul, launched a few times, for Nsight Compute (issue 24): the
trained-like Llama-3-8B layer's MATRIX at ROWS rows of x with kernel KERNEL (0 tensor cores,
1 CUDA cores).

    ncu -k regex:"gemv_kernel|mma_kernel" python bench/experiments/fixedrate_probe.py gate 1 1
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_bench import weights  # noqa: E402
from fine_decode import LAYER_8B  # noqa: E402

from cuda_ext import fixedrate as fr_ops  # noqa: E402


def main() -> None:
    matrix, rows, kernel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    w = weights({matrix: LAYER_8B[matrix]}, seed=1)[matrix].cuda()
    fr = fr_ops.encode(w)
    x = torch.randn(rows, w.shape[1], device="cuda").bfloat16()
    for _ in range(3):
        fr_ops.linear(x, fr, kernel)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
