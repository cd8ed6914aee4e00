"""linear16 (cuda_ext/csrc/linear16.cpp) against PyTorch's bf16 matmul on the CPU, interleaved in one
process: the 211 matmuls of one SmolLM2-135M decode step (30 layers x q, k, v, o, gate, up, down,
then the tied 49152 x 576 head on one row), random bf16 weights of the demo's shapes (269 MB, more
than the caches), at M rows of x a call. Prints ms a step for each, their ratio, and the bytes read
per second; OMP_WAIT_POLICY=PASSIVE as `wcodec serve` runs unless set.

    python bench/cpu_linear16.py --rows 1 4 32 --rounds 5
    python bench/cpu_linear16.py --packed     # linear16's weights packed once (linear16_pack), as served
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

import cuda_ext
from cuda_ext import ops

LAYERS, HIDDEN, MLP, KV, VOCAB = 30, 576, 1536, 192, 49152
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]


def step(linear, weights, head, xs) -> None:
    for layer in weights:
        for w in layer:
            linear(xs[w.shape[1]], w)
    linear(xs[HIDDEN][-1:], head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--packed", action="store_true", help="linear16_packed on weights packed once")
    args = ap.parse_args()
    if not (cuda_ext.available().cpp and ops.has_ops(ops.LINEAR16_OPS, "cpu")):
        sys.exit("the extension lacks linear16: python setup.py build_ext --inplace")
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(s, generator=g).bfloat16() for s in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16()
    nbytes = sum(w.nbytes for layer in weights for w in layer) + head.nbytes
    ours, our_weights, our_head = ops.linear16, weights, head
    if args.packed:
        ours, our_weights, our_head = ops.linear16_packed, [[ops.linear16_pack(w) for w in layer] for layer in weights], \
            ops.linear16_pack(head)
    print(f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
          f"{nbytes / 1e6:.0f} MB of weights a step, linear16's loop: {ops.linear16_loop(torch.bfloat16)}, "
          f"{'packed' if args.packed else 'unpacked'}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (HIDDEN, MLP)}
        times: dict[str, list[float]] = {"torch": [], "linear16": []}
        for _ in range(args.rounds):
            for name, linear, ws, hd in (("torch", F.linear, weights, head), ("linear16", ours, our_weights, our_head)):
                step(linear, ws, hd, xs)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(linear, ws, hd, xs)
                times[name].append((time.perf_counter() - t0) / args.steps)
        t, o = statistics.median(times["torch"]), statistics.median(times["linear16"])
        print(f"rows {rows:3d}: torch {t * 1e3:6.1f} ms ({nbytes / t / 1e9:4.1f} GB/s)   linear16 {o * 1e3:6.1f} ms "
              f"({nbytes / o / 1e9:4.1f} GB/s)   torch / linear16 {t / o:.2f}x   (medians of {args.rounds})")


if __name__ == "__main__":
    main()
