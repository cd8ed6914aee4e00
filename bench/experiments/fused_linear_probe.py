"""How fast a 7B-shaped decode step's matmuls can be at batch B (issue 23): the seven Linears of
32 layers as separate calls, against q/k/v and gate/up concatenated (four calls), each
set captured in one CUDA graph (no launch gaps), beside the device's read bandwidth.

    python bench/experiments/fused_linear_probe.py --rows 1 32 64
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fixedrate_gpu import graph_ms  # noqa: E402  (the bench's graph timing: fn captured, replayed)

E, F_, L = 4096, 11008, 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 32, 64])
    args = ap.parse_args()
    w = lambda o, i: torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02
    sep = [[w(E, E), w(E, E), w(E, E), w(E, E), w(F_, E), w(F_, E), w(E, F_)] for _ in range(L)]
    fused = [[torch.cat(ws[:3]), ws[3], torch.cat(ws[4:6]), ws[6]] for ws in sep]
    nbytes = sum(t.nbytes for ws in sep for t in ws)
    big = torch.ones(1 << 28, device="cuda")
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); big.sum(); e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e))
    read = big.nbytes / min(times) / 1e6
    print(f"{torch.cuda.get_device_name()}: read {read:.0f} GB/s; weights {nbytes / 1e9:.2f} GB -> floor "
          f"{nbytes / read / 1e6:.3f} ms")
    for b in args.rows:
        xe, xf = torch.randn(b, E, device="cuda", dtype=torch.bfloat16), torch.randn(b, F_, device="cuda", dtype=torch.bfloat16)

        def seven():
            for ws in sep:
                for t in ws[:6]:
                    F.linear(xe, t)
                F.linear(xf, ws[6])

        def four():
            for ws in fused:
                F.linear(xe, ws[0]); F.linear(xe, ws[1]); F.linear(xe, ws[2]); F.linear(xf, ws[3])
        a, c = graph_ms(seven, 1), graph_ms(four, 1)
        print(f"B={b}: seven linears {a:.3f} ms ({nbytes / a / 1e6:.0f} GB/s), fused four {c:.3f} ms "
              f"({nbytes / c / 1e6:.0f} GB/s)")


if __name__ == "__main__":
    main()
