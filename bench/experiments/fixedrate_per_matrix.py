"""Which of an 8B layer's matrices hold the fused fixed-rate matmul back, and does a launch-shape
change help them (issue 24)? For each of the layer's seven matrices (trained-like weights, seed 1)
and 1, 16, 32 and 64 rows of x, prints cuBLAS's time on the decoded weights (µs) and, as ratios to
it, the fused tensor-core kernel's and the decode + cuBLAS path's, each side one CUDA graph
(bench/fixedrate_gpu.py's timing). Run it beside builds of the extension swapped in its cache
directory to compare them matrix by matrix.

    python bench/experiments/fixedrate_per_matrix.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fine_decode import LAYER_8B  # noqa: E402
from fixedrate_gpu import graph_ms  # noqa: E402
from gpu_bench import weights  # noqa: E402

from cuda_ext import fixedrate as fr_ops  # noqa: E402

ROWS = (1, 16, 32, 64)
REPEAT = 20


def main() -> None:
    layer = {k: w.cuda() for k, w in weights(LAYER_8B, seed=1).items()}
    frs = {k: fr_ops.encode(w) for k, w in layer.items()}
    dec = {k: fr_ops.decode(fr) for k, fr in frs.items()}
    for n in ROWS:
        out = {}
        for k in layer:
            x = torch.randn(n, layer[k].shape[1], device="cuda").bfloat16()
            cublas = graph_ms(lambda: F.linear(x, dec[k]), REPEAT)
            fused = graph_ms(lambda: fr_ops.linear(x, frs[k], 0), REPEAT)
            decode = graph_ms(lambda: fr_ops._decode_matmul(x, frs[k]), REPEAT)
            out[k] = {"cublas_us": round(cublas * 1e3, 1), "fused": round(fused / cublas, 3),
                      "decode_cublas": round(decode / cublas, 3)}
        print(n, "rows:", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
