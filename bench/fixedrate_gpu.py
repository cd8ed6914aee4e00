"""The fixed-rate form on the GPU, one trained-like Llama-3-8B layer (bench/gpu_bench.py's weights),
in one run: the GPU transcoder (bf16 -> form; bit-exact checked through the debug decode), the
form's size, and the seven matmuls (q, k, v, o, gate, up, down) through the fused op (the CUDA-core
kernel at 1 row, the tensor-core one above; both beside it) against cuBLAS bf16 (F.linear) on the decoded weights, at 1,
4, 16, 32 and 64 rows (fused; decode + cuBLAS beside it from 32). Beside them, the same products as
the server computes them ("as served"): q, k and v as one matrix, gate and up as one (their rows
joined: cuda_ext.fixedrate.cat_rows, torch.cat for cuBLAS), o and down alone: four calls a side.
Each side is captured in one CUDA graph of its calls and replayed (launch gaps out of both).

    python bench/fixedrate_gpu.py [--reps 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import subprocess
import json
import statistics
import time

import torch
import torch.nn.functional as F
from fine_decode import LAYER_8B
from gpu_bench import weights

import cuda_ext
from cuda_ext import fixedrate as fr_ops

LIMITS = {1: (0.85, 0.65), 4: (0.90, 0.70), 16: (1.00, 0.80), 32: (None, None), 64: (1.5, 1.2)}   # issue 24


def graph_ms(fn, reps: int, trials: int = 7) -> float:
    """Median time of one fn() (ms): fn captured `reps` times in a graph, replayed `trials` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


SERVED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def served_shapes(layer: dict) -> dict:
    """[out, in] of the layer's matrices joined as the server joins them (SERVED)."""
    return {k: (sum(layer[p][0] for p in parts), layer[parts[0]][1]) for k, parts in SERVED.items()}


def served_form(decoded: dict, frs: dict) -> tuple[dict, dict]:
    """The layer's matrices joined as the server joins them (SERVED), decoded and fixed-rate."""
    return ({k: torch.cat([decoded[p] for p in parts]) for k, parts in SERVED.items()},
            {k: fr_ops.cat_rows([frs[p] for p in parts]) for k, parts in SERVED.items()})


def one_batch(n: int, layer: dict, decoded: dict, frs: dict, served: tuple[dict, dict], reps: int) -> dict:
    """The layer's seven matmuls at n rows: cuBLAS on the decoded weights, the fused op (its
    tensor-core kernel, the CUDA-core one at <= 16 rows, decode + cuBLAS at >= 32); per matrix at
    1 and 16 rows."""
    xs = {k: torch.randn(n, w.shape[1], device="cuda").bfloat16() for k, w in layer.items()}

    def seven(fn):
        return graph_ms(lambda: [fn(k) for k in layer], reps)

    row = {"cublas_ms": seven(lambda k: F.linear(xs[k], decoded[k])),
           "fused_ms": seven(lambda k: fr_ops.linear(xs[k], frs[k])),
           "tensor_cores_ms": seven(lambda k: fr_ops.linear(xs[k], frs[k], 0)) if n <= fr_ops.FUSED_MAX_ROWS else None,
           "cuda_cores_ms": seven(lambda k: fr_ops.linear(xs[k], frs[k], 1)) if n <= 16 else None,
           "decode_cublas_ms": seven(lambda k: fr_ops._decode_matmul(xs[k], frs[k])) if n >= 32 else None}
    row["ratio"] = row["fused_ms"] / row["cublas_ms"]
    s_dec, s_fr = served
    s_x = {k: xs[SERVED[k][0]] for k in SERVED}
    row["served_ms"] = [graph_ms(lambda: [F.linear(s_x[k], s_dec[k]) for k in SERVED], reps),
                        graph_ms(lambda: [fr_ops.linear(s_x[k], s_fr[k]) for k in SERVED], reps)]
    if n in (1, 16):
        row["per_matrix_ms"] = {k: [round(graph_ms(lambda k=k: F.linear(xs[k], decoded[k]), reps), 4),
                                    round(graph_ms(lambda k=k: fr_ops.linear(xs[k], frs[k]), reps), 4)] for k in layer}
    print(n, json.dumps(row), flush=True)
    return row


def transcode(layer: dict) -> tuple[dict, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    frs = {k: fr_ops.encode(w) for k, w in layer.items()}
    torch.cuda.synchronize()
    return frs, time.perf_counter() - t


def clocks() -> str:
    """The SM clock now and its maximum, and the power draw and limit (nvidia-smi): the fused kernels
    are bound by instruction issue, cuBLAS by memory, so their ratio moves with the SM clock; boxes
    differ (the same code measured 1.49 and 1.66 at 16 rows on two H100s, 2026-11-26)."""
    q = "clocks.sm,clocks.max.sm,power.draw,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", f"--id={torch.cuda.current_device()}"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "clocks unknown"
    return f"SM clock, max, power, limit: {out}"


def layer_bench() -> tuple[argparse.Namespace, dict[str, torch.Tensor]]:
    """A layer bench's flags (--reps, --json) and one Llama-3-8B layer's trained-like weights on CUDA
    (this bench's and fp8_gpu.py's)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    assert cuda_ext.available().cuda, cuda_ext.available().reason
    return args, {k: w.cuda() for k, w in weights(LAYER_8B, seed=1).items()}


def main() -> None:
    args, layer = layer_bench()
    fr_ops.encode(layer["k"])                                            # warm-up (module load)
    frs, seconds = transcode(layer)
    decoded = {k: fr_ops.decode(fr) for k, fr in frs.items()}
    exact = all(torch.equal(decoded[k].view(torch.int16), layer[k].view(torch.int16)) for k in layer)
    raw = sum(w.nbytes for w in layer.values())
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "bit_exact": exact, "ratio": sum(fr.nbytes for fr in frs.values()) / raw,
              "transcode_s": seconds, "transcode_gbps": raw / seconds / 1e9,
              "decode_ms": graph_ms(lambda: [fr_ops.decode(fr, decoded[k]) for k, fr in frs.items()], args.reps)}
    served = served_form(decoded, frs)
    report["rows"] = {n: one_batch(n, layer, decoded, frs, served, args.reps) for n in LIMITS}
    report["clocks"] = clocks()
    rows = report["rows"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\n{report['device']}, {report['date']}: Llama-3-8B layer, trained-like bf16; {report['clocks']}")
    print(f"  resident/bf16 {report['ratio']:.4f}; transcoder bf16->form {report['transcode_gbps']:.1f} GB/s "
          f"({report['transcode_s'] * 1e3:.1f} ms), bit-exact {exact}; decode to scratch {report['decode_ms']:.3f} ms")
    print("  rows  cuBLAS ms  fused ms  fused/cuBLAS  limit  goal         tensor-core / CUDA-core / decode+cuBLAS ms"
          "   as served: cuBLAS / fused ms (ratio)")
    for n, r in rows.items():
        lim, goal = LIMITS[n]
        verdict = "  --" if lim is None else f"{lim:5.2f}  {goal:4.2f}  {'met' if r['ratio'] <= lim else 'MISSED'}"
        print(f"  {n:4d}  {r['cublas_ms']:9.4f}  {r['fused_ms']:8.4f}  {r['ratio']:12.3f}  {verdict}"
              f"  {r['tensor_cores_ms'] or 0:.4f} / {r['cuda_cores_ms'] or 0:.4f} / {r['decode_cublas_ms'] or 0:.4f}"
              f"   {r['served_ms'][0]:.4f} / {r['served_ms'][1]:.4f} ({r['served_ms'][1] / r['served_ms'][0]:.3f})")


if __name__ == "__main__":
    main()
