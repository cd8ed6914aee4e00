"""Programmatic dependent launch (PDL) across a decode step's kernels: per layer add+RMSNorm (Triton)
-> qkv -> SiLU*up (Triton, standing in for rope + attention) -> o -> add+RMSNorm -> gate/up -> SiLU*up
-> down, 8 layers of the 7B shapes in one CUDA graph, as the engine's step runs them. The linears are
the fused fixed-rate kernels (compressed) or cuBLAS on the bf16 weights (decoded); the Triton kernels
are `cuda_ext.step_triton`'s, launched with PDL (as served on sm_90+) or without it, alternating in
one process. The fused kernels request their first tile of W before they wait for the kernel ahead,
which pays only when that kernel lets them launch early (BENCHMARKS.md, 2026-11-29).

    python bench/experiments/pdl_step.py [--rows 1,32] [--layers 8] [--rounds 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from fixedrate_gpu import graph_ms, served_shapes  # noqa: E402
from gpu_bench import LAYER, weights  # noqa: E402

from cuda_ext import fixedrate as fr  # noqa: E402
from cuda_ext import step_triton  # noqa: E402

SHAPES = served_shapes(LAYER)        # the 7B layer joined: qkv [12288, 4096], o, gate_up [22016, 4096], down
_PDL = step_triton._pdl


def set_pdl(on: bool) -> None:
    """The step kernels' launches with PDL (the served default on sm_90+) or without it."""
    step_triton._pdl = _PDL if on else (lambda t: {"GDC": False})


def step(x0: torch.Tensor, layers: list[dict], linear, norm_w: torch.Tensor, mlp: int = 11008,
         permuted: bool = False) -> torch.Tensor:
    """`permuted`: the Triton kernels write each fused linear's x in the layout its kernel reads at
    this row count (fixedrate.PermutedX), as the engine's step does for FixedLinears."""
    x, h, n = x0, None, x0.shape[0]
    rows = fr.permuted_rows(n) if permuted else 0
    hidden, inner = ((rows, fr.permuted_cols(4096)), (rows, fr.permuted_cols(mlp))) if rows else ((), ())

    def made(out: torch.Tensor, cols: int):
        return fr.PermutedX(out, n, cols) if rows else out

    for w in layers:                                                     # residual stream [n, 4096]
        x, a = step_triton.add_rms_norm(x, h, norm_w, 1e-5, *hidden)
        q = linear(made(a, 4096), w["qkv"])                              # [n, 12288] (the 8B's 6144)
        o = linear(made(step_triton.silu_mul(q[:, :4096], q[:, -4096:], *hidden), 4096), w["o"])
        x, a = step_triton.add_rms_norm(x, o, norm_w, 1e-5, *hidden)
        g = linear(made(a, 4096), w["gate_up"])                          # [n, 2 mlp]
        h = linear(made(step_triton.silu_mul(g[:, :mlp], g[:, mlp:], *inner), mlp), w["down"])
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    decoded = [{k: w.cuda() for k, w in weights(SHAPES, seed=10 + i).items()} for i in range(args.layers)]
    modes = {"decoded": (decoded, F.linear),
             "compressed": ([{k: fr.encode(w) for k, w in ws.items()} for ws in decoded], fr.linear)}
    norm_w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, {args.layers} layers of the 7B shapes, one graph a step (us)")
    for n in map(int, args.rows.split(",")):
        x0 = torch.randn(n, 4096, device="cuda").bfloat16()
        for mode, (layers, linear) in modes.items():
            times = {True: [], False: []}
            for _ in range(args.rounds):
                for on in (True, False):
                    set_pdl(on)
                    times[on].append(graph_ms(lambda: step(x0, layers, linear, norm_w), 5) * 1e3)
            set_pdl(True)
            on, off = min(times[True]), min(times[False])
            print(f"rows {n:3d} {mode:10s} PDL {on:8.1f}  without {off:8.1f}  ratio {on / off:.3f}", flush=True)


if __name__ == "__main__":
    main()
