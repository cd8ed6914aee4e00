"""The fused fixed-rate kernel against cuBLAS in one line, for A/B runs of kernel builds (issue 24):
the trained-like Llama-3-8B layer's seven matmuls (q, k, v, o, gate, up, down; each side one CUDA
graph of its seven calls, `bench/fixedrate_gpu.py`'s timing) at 1, 4, 8, 16 and 32 rows of x,
printed as `LABEL n=1 R1 n=4 R4 ...` where R is the tensor-core kernel's time over cuBLAS bf16's.
With `--7b`, Llama-2-7B's layer instead (MLP 11008, no GQA: the generation bench's model, whose
gate and up fill the H200's CTA slots differently).
Swap the extension's library between runs, alternating, to compare builds in one call
(docs/BENCHMARKS.md, 2026-11-29).

    python bench/experiments/fixedrate_ab.py main [--7b] [--rows 1,2,3,4]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fine_decode import LAYER_8B  # noqa: E402
from fixedrate_gpu import graph_ms  # noqa: E402
from gpu_bench import LAYER as LAYER_7B  # noqa: E402
from gpu_bench import weights  # noqa: E402

from cuda_ext import fixedrate as fr_ops  # noqa: E402

ROWS = (1, 4, 8, 16, 32)


def fused_over_cublas(calls: list, reps: int) -> tuple[float, float]:
    """calls: (x, w, w's fixed-rate form) each; the fused kernel's time over cuBLAS's for all of them
    in one graph a side, and cuBLAS's time (ms)."""
    cublas = graph_ms(lambda: [F.linear(x, w) for x, w, _ in calls], reps)
    fused = graph_ms(lambda: [fr_ops.linear(x, f, 0) for x, _, f in calls], reps)
    return fused / cublas, cublas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("label", nargs="?", default="build")
    ap.add_argument("--7b", dest="seven", action="store_true", help="Llama-2-7B's layer, not Llama-3-8B's")
    ap.add_argument("--rows", type=lambda v: tuple(int(n) for n in v.split(",")), default=ROWS,
                    help="rows of x, comma-separated (default 1,4,8,16,32)")
    args = ap.parse_args()
    shapes, rows = (LAYER_7B if args.seven else LAYER_8B), args.rows
    label = args.label + (" 7b" if args.seven else "")
    layer = {k: w.cuda() for k, w in weights(shapes, seed=1).items()}
    forms = {k: fr_ops.encode(w) for k, w in layer.items()}
    out = []
    for n in rows:
        g = torch.Generator(device="cuda").manual_seed(n)
        xs = {k: torch.randn(n, w.shape[1], device="cuda", generator=g).bfloat16() for k, w in layer.items()}
        ratio, _ = fused_over_cublas([(xs[k], layer[k], forms[k]) for k in layer], 20)
        out.append(f"n={n} {ratio:.3f}")
    print(label, " ".join(out), flush=True)


if __name__ == "__main__":
    main()
