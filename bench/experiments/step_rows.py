"""The served decode step at each row count, compressed over decoded (issue 24): `pdl_step.py`'s step
(8 layers as the engine joins them -- qkv, o, gate_up, down -- with the step's Triton kernels between
the linears, PDL as served on sm_90+), one CUDA graph a step, the fused fixed-rate kernels against
cuBLAS on the same trained-like bf16 weights. One line: `LABEL LAYER n=R fixed/permuted ...`, each over
decoded mode's step: `fixed` with the Triton kernels writing x row-major (each fused op permuting it),
`permuted` with them writing it in the fused kernel's layout, as the engine's step does. Swap the
extension's library (or set a lab build's switches) between runs to compare kernels in one call.

    python bench/experiments/step_rows.py LABEL [--layer 7b|8b] [--rows 4,5,6,7,8,9]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parent)]
from fine_decode import LAYER_8B  # noqa: E402
from fixedrate_gpu import graph_ms, served_shapes  # noqa: E402
from gpu_bench import LAYER, weights  # noqa: E402
from pdl_step import step  # noqa: E402

from cuda_ext import fixedrate as fr  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label")
    ap.add_argument("--layer", choices=("7b", "8b"), default="7b")
    ap.add_argument("--rows", default="4,5,6,7,8,9")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    shapes = served_shapes(LAYER_8B if args.layer == "8b" else LAYER)
    mlp = shapes["gate_up"][0] // 2
    decoded = [{k: w.cuda() for k, w in weights(shapes, seed=10 + i).items()} for i in range(args.layers)]
    fixed = [{k: fr.encode(w) for k, w in ws.items()} for ws in decoded]
    norm_w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    out = []
    kinds = (("decoded", decoded, F.linear, False), ("fixed", fixed, fr.linear, False),
             ("permuted", fixed, fr.linear, True))
    for n in map(int, args.rows.split(",")):
        x0 = torch.randn(n, 4096, device="cuda").bfloat16()
        ms = {name: min(graph_ms(lambda: step(x0, layers, linear, norm_w, mlp, permuted), 5) for _ in range(2))
              for name, layers, linear, permuted in kinds}
        out.append(f"n={n} {ms['fixed'] / ms['decoded']:.3f}/{ms['permuted'] / ms['decoded']:.3f}")
    print(args.label, args.layer, " ".join(out), flush=True)


if __name__ == "__main__":
    main()
