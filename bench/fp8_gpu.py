"""fp8 weights multiplied as they are stored (W8A16, cuda_ext.fp8) against the same checkpoint
served dequantized to bf16 (cuBLAS F.linear: decoded mode's), one Llama-3-8B layer's seven matmuls
(q, k, v, o, gate, up, down) quantized as llm-compressor does (trained-like bf16 weights,
bench/gpu_bench.py's, to e4m3 with a scale a row, or a scale a 128 x 128 block), in one run.
Beside them: cuBLAS's W8A8 `torch._scaled_mm` alone, x quantized beforehand (the bound of an fp8
GEMM; it takes row-wise scales only), and each side's bytes read over its time (the HBM limit is
the device's). Also the layer as the server joins it (qkv, o, gate_up, down). Each side is one CUDA
graph of `reps` calls of its seven, replayed.

    python bench/fp8_gpu.py [--reps 20] [--json out.json]
"""
from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from fixedrate_gpu import SERVED, clocks, graph_ms, layer_bench

from cuda_ext import fp8

ROWS = (1, 2, 4, 8, 16, 32, 64)


def quantized(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """w (bf16 [N, K], CUDA) -> its e4m3 bytes, float32 scale grid and block: amax / 448 a row, or a block."""
    n, k = w.shape
    bo, bi = block or (1, k)
    pad = w.float().new_zeros(-(-n // bo) * bo, -(-k // bi) * bi)
    pad[:n, :k] = w.float()
    amax = pad.abs().view(pad.shape[0] // bo, bo, pad.shape[1] // bi, bi).amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / 448
    cols = scale.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
    return (w.float() / cols).to(torch.float8_e4m3fn).view(torch.uint8), scale.contiguous(), (bo, bi)


def dequantized(q: tuple) -> torch.Tensor:
    w8, scale, (bo, bi) = q
    cols = scale.repeat_interleave(bo, 0)[:w8.shape[0]].repeat_interleave(bi, 1)[:, :w8.shape[1]]
    return (w8.view(torch.float8_e4m3fn).float() * cols).to(torch.bfloat16)


def one_batch(n: int, qs: dict, dec: dict, served: tuple[dict, dict], reps: int) -> dict:
    xs = {k: torch.randn(n, q[0].shape[1], device="cuda").bfloat16() for k, q in qs.items()}
    x8 = {k: (x.float() / 4).to(torch.float8_e4m3fn) for k, x in xs.items()}
    ones = {k: torch.ones(n, 1, device="cuda") for k in qs}
    row_scales = {k: q[1].view(1, -1) for k, q in qs.items()} if qs["q"][2][0] == 1 else None

    def seven(fn):
        return graph_ms(lambda: [fn(k) for k in qs], reps)

    row = {"cublas_ms": seven(lambda k: F.linear(xs[k], dec[k])),
           "fp8_ms": seven(lambda k: fp8.linear(xs[k], *qs[k]))}
    if row_scales is not None:
        try:
            row["scaled_mm_ms"] = seven(lambda k: torch._scaled_mm(x8[k], qs[k][0].view(torch.float8_e4m3fn).T,
                                                                   ones[k], row_scales[k], out_dtype=torch.bfloat16))
        except RuntimeError as e:                                   # a build of cuBLAS without it
            print(f"_scaled_mm: {e}", flush=True)
    row["ratio"] = row["fp8_ms"] / row["cublas_ms"]
    s_dec, s_q = served
    s_x = {k: xs[SERVED[k][0]] for k in SERVED}
    row["served_ms"] = [graph_ms(lambda: [F.linear(s_x[k], s_dec[k]) for k in SERVED], reps),
                        graph_ms(lambda: [fp8.linear(s_x[k], *s_q[k]) for k in SERVED], reps)]
    print(n, json.dumps(row), flush=True)
    return row


def joined(qs: dict) -> dict:
    """The served joins of row-scaled (or 128-row-block) matrices: bytes and grids stacked."""
    return {k: (torch.cat([qs[p][0] for p in parts]), torch.cat([qs[p][1] for p in parts]), qs[parts[0]][2])
            for k, parts in SERVED.items()}


def main() -> None:
    args, layer = layer_bench()
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "clocks": clocks(), "scales": {}}
    for label, block in (("row", None), ("block128", (128, 128))):
        qs = {k: quantized(w, block) for k, w in layer.items()}
        dec = {k: dequantized(q) for k, q in qs.items()}
        served = ({k: torch.cat([dec[p] for p in parts]) for k, parts in SERVED.items()}, joined(qs))
        fp8_bytes = sum(q[0].nbytes + q[1].nbytes for q in qs.values())
        bf16_bytes = sum(d.nbytes for d in dec.values())
        rows = {n: one_batch(n, qs, dec, served, args.reps) for n in ROWS}
        report["scales"][label] = {"fp8_bytes": fp8_bytes, "bf16_bytes": bf16_bytes, "rows": rows}
        print(f"\n{report['device']}, {report['date']}: Llama-3-8B layer, fp8 with a scale a {label}; {report['clocks']}")
        print(f"  held: fp8 {fp8_bytes / 1e6:.1f} MB = {fp8_bytes / bf16_bytes:.4f} of bf16's {bf16_bytes / 1e6:.1f} MB")
        print("  rows  cuBLAS bf16 ms  fp8 W8A16 ms  ratio  GB/s bf16 / fp8   _scaled_mm ms   as served bf16 / fp8 ms (ratio)")
        for n, r in rows.items():
            mm = f"{r['scaled_mm_ms']:.4f}" if "scaled_mm_ms" in r else "  --  "
            print(f"  {n:4d}  {r['cublas_ms']:14.4f}  {r['fp8_ms']:12.4f}  {r['ratio']:.3f}  "
                  f"{bf16_bytes / r['cublas_ms'] / 1e6:6.0f} / {fp8_bytes / r['fp8_ms'] / 1e6:6.0f}   {mm}        "
                  f"{r['served_ms'][0]:.4f} / {r['served_ms'][1]:.4f} ({r['served_ms'][1] / r['served_ms'][0]:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
