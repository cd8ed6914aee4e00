"""The fused fixed-rate kernel against cuBLAS in one line, for A/B runs of kernel builds (issue 24):
the trained-like Llama-3-8B layer's seven matmuls (q, k, v, o, gate, up, down; each side one CUDA
graph of its seven calls, `bench/fixedrate_gpu.py`'s timing) at 1, 4, 8, 16 and 32 rows of x,
printed as `LABEL n=1 R1 n=4 R4 ...` where R is the tensor-core kernel's time over cuBLAS bf16's.
Swap the extension's library between runs, alternating, to compare builds in one call
(docs/BENCHMARKS.md, 2026-11-29).

    python bench/experiments/fixedrate_ab.py main
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fine_decode import LAYER_8B  # noqa: E402
from fixedrate_gpu import graph_ms  # noqa: E402
from gpu_bench import weights  # noqa: E402

from cuda_ext import fixedrate as fr_ops  # noqa: E402

ROWS = (1, 4, 8, 16, 32)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "build"
    layer = {k: w.cuda() for k, w in weights(LAYER_8B, seed=1).items()}
    forms = {k: fr_ops.encode(w) for k, w in layer.items()}
    out = []
    for n in ROWS:
        g = torch.Generator(device="cuda").manual_seed(n)
        xs = {k: torch.randn(n, w.shape[1], device="cuda", generator=g).bfloat16() for k, w in layer.items()}
        cublas = graph_ms(lambda: [F.linear(xs[k], layer[k]) for k in layer], 20)
        fused = graph_ms(lambda: [fr_ops.linear(xs[k], forms[k], 0) for k in layer], 20)
        out.append(f"n={n} {fused / cublas:.3f}")
    print(label, " ".join(out), flush=True)


if __name__ == "__main__":
    main()
