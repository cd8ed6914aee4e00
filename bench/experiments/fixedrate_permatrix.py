"""The fused kernel's time over cuBLAS's for each distinct matrix of the 8B and the 7B layer, at 1, 4
and 8 rows of x, one line a matrix, for A/B runs that swap the extension's library (as
`fixedrate_ab.py`). Each side is one CUDA graph over enough trained-like copies of the matrix that
its working set (256 MB of bf16 or more) does not stay in the H200's L2: a single 1024 x 4096
matrix timed alone would be read from L2 after its first replay (docs/BENCHMARKS.md, 2026-11-29).

    python bench/experiments/fixedrate_permatrix.py LABEL [--rows 5,8]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fine_decode import LAYER_8B  # noqa: E402
from fixedrate_ab import fused_over_cublas  # noqa: E402  (this script's folder)
from fixedrate_gpu import served_shapes  # noqa: E402
from gpu_bench import LAYER as LAYER_7B  # noqa: E402
from gpu_bench import weights  # noqa: E402

from cuda_ext import fixedrate as fr_ops  # noqa: E402

ROWS = (1, 4, 8)
WORKING_SET = 256e6                                      # bytes of bf16 a graph reads, at least


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "build"
    rows = tuple(int(n) for n in sys.argv[sys.argv.index("--rows") + 1].split(",")) if "--rows" in sys.argv else ROWS
    for layer, shapes in (("8b", LAYER_8B), ("7b", LAYER_7B), ("7b-served", served_shapes(LAYER_7B))):
        seen = set()
        for name, shape in shapes.items():
            if shape in seen:                             # k as v, up as gate: the same kernel launch
                continue
            seen.add(shape)
            copies = max(2, math.ceil(WORKING_SET / (shape[0] * shape[1] * 2)))
            ws = [weights({name: shape}, seed=s)[name].cuda() for s in range(copies)]
            forms = [fr_ops.encode(w) for w in ws]
            out = []
            for n in rows:
                x = torch.randn(n, shape[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).bfloat16()
                ratio, cublas = fused_over_cublas([(x, w, f) for w, f in zip(ws, forms)], 3)
                out.append(f"n={n} {ratio:.3f} (cuBLAS {cublas * 1e3 / copies:.1f} us)")
            print(label, layer, name, f"{shape[0]}x{shape[1]}", " ".join(out), flush=True)
            del ws, forms


if __name__ == "__main__":
    main()
