"""What a rANS segment restart costs: one trained-like 4096x4096 bf16 tensor's exponents coded with
one table set (ctx_bits 2) in segments of 4096 ... 128 steps per lane (docs/FORMAT.md §3.5).

    python bench/experiments/segment_cost.py
"""
import numpy as np
import torch

from codec import planes, rans, tables
from codec.constants import LANES


def exponent_plane_counts(rows: int = 4096, cols: int = 4096, seed: int = 0):
    """Symbol count, counts per context table [4, 256], today's coded size in bits (tables.normalize
    then the exact cost), and each symbol's key ctx << 8 | sym, in order."""
    torch.manual_seed(seed)
    w = torch.randn(rows, cols) * (0.02 * torch.exp(0.35 * torch.randn(rows, 1)))
    w[torch.rand(rows, cols) < 1e-4] *= 8
    u = w.bfloat16().view(torch.int16).numpy().view(np.uint16).ravel()
    layout = planes.FLOAT_LAYOUTS["bfloat16"]
    sym, hi, _ = planes.split(layout, u)
    key = (planes.context(layout, hi, 2).astype(np.int64) << 8) | sym
    counts = np.bincount(key, minlength=1024).reshape(4, 256)
    return len(u), counts, tables.cost_bits(counts, tables.normalize(counts)), key


def exponent_plane(rows: int = 4096, cols: int = 4096, seed: int = 0):
    """Coded symbols and their packed encoder entries, under one table per context."""
    n, counts, bits, key = exponent_plane_counts(rows, cols, seed)
    freqs = tables.normalize(counts)
    return n, bits / n, tables.pack_encode(freqs).reshape(-1)[key].astype(np.uint32)


def main() -> None:
    n, model_bits, packed = exponent_plane()
    print(f"order-0 model cost {model_bits:.4f} bits/weight (ratio bound {(8 + model_bits) / 16:.4f})")
    for seg in (131072, 32768, 16384, 8192, 4096):
        n_seg = -(-n // seg)
        _, words, _ = rans.encode(rans.plan(np.full(n_seg, seg)), packed)
        bits = (16 * len(words) + 32 * LANES * n_seg) / n
        print(f"steps/lane {seg // LANES:5d}: {bits:.4f} bits/weight, overhead {bits - model_bits:.4f}, "
              f"ratio (streams only) {(8 + bits) / 16:.4f}, per lane restart "
              f"{(bits - model_bits) * n / (LANES * n_seg):.1f} bits")


if __name__ == "__main__":
    main()
