"""Where the fused kernel should stop (cuda_ext.fixedrate.FUSED_ROWS): the served 7B layer's joined
matrices (qkv, o, gate/up, down, as the paged engine multiplies them) at 16-64 rows of x, timed as
cuBLAS bf16 on the decoded weights, as served (the fused kernel up to FUSED_ROWS, above that decode
+ cuBLAS) and with the fused kernel forced (kernel 0, up to FUSED_MAX_ROWS); each side one CUDA graph
of the four calls. (BENCHMARKS.md: on an H200 at 12:03 on 2026-11-29 the fused kernel at 40-64 rows
was slower than decode + cuBLAS; from 19:04 wide_kernel is faster there, 1.72 against 2.36 of
cuBLAS's time at 64 rows, but FUSED_ROWS stays 32 so that a prompt of 33-64 tokens is prefilled
with cuBLAS's sums: fused up to 64, the demo's greedy tokens parted from decoded mode's.)

    python bench/experiments/fused_rows.py [--rows 16,24,32,40,48,56,64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from fixedrate_gpu import graph_ms, served_shapes  # noqa: E402
from gpu_bench import LAYER, weights  # noqa: E402

from cuda_ext import fixedrate as fr  # noqa: E402

SHAPES = served_shapes(LAYER)        # the 7B layer joined: qkv [12288, 4096], o, gate_up [22016, 4096], down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")], default=[16, 24, 32, 40, 48, 56, 64])
    args = ap.parse_args()
    layer = {k: w.cuda() for k, w in weights(SHAPES, seed=3).items()}
    forms = {k: fr.encode(w) for k, w in layer.items()}
    print(torch.cuda.get_device_name(), "7B layer, joined matrices: ms, and ÷ cuBLAS")
    for n in args.rows:
        xs = {k: torch.randn(n, w.shape[1], device="cuda").bfloat16() for k, w in layer.items()}
        cublas = graph_ms(lambda: [F.linear(xs[k], layer[k]) for k in layer], 10)
        served = graph_ms(lambda: [fr.linear(xs[k], forms[k]) for k in layer], 10)
        fused = graph_ms(lambda: [fr.linear(xs[k], forms[k], 0) for k in layer], 10)
        print(f"rows {n:2d} cuBLAS {cublas:.4f}  served {served:.4f} ({served / cublas:.3f})  "
              f"fused {fused:.4f} ({fused / cublas:.3f})", flush=True)


if __name__ == "__main__":
    main()
