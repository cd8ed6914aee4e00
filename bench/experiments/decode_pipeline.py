"""Decode + cuBLAS at 33-64 rows with the scratch kept in L2 (issue 24's 64-row item): each matrix
cut into row chunks, a chunk decoded into one of `slots` scratch buffers on a decode stream while
cuBLAS multiplies the chunk before it from L2 on `mm` streams (events between them, all in one CUDA
graph). Against the whole-matrix decode + cuBLAS (`cuda_ext.fixedrate._decode_matmul`, which writes
and reads the layer's 2 bytes a weight through DRAM: >= 2.35x cuBLAS by bytes alone) and cuBLAS on
the decoded weights, the trained-like Llama-3-8B layer, same run. Also the parts alone: the layer's
decode, cuBLAS on one chunk that stays in L2, the layer decoded chunk by chunk into one scratch
that stays in L2, and cuBLAS over chunks of K (every row of W, `kc` columns) from one L2-resident
scratch a matrix, summed in float32 (`torch.addmm(..., out_dtype=torch.float32)`).

    python bench/experiments/decode_pipeline.py [--rows 64] [--chunks-mb 2,4,8] [--slots 2,4,8] [--mm-streams 1,2,4]
                                                [--k-chunks 256,512,1024,2048]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fine_decode import LAYER_8B  # noqa: E402
from fixedrate_gpu import graph_ms  # noqa: E402
from gpu_bench import weights  # noqa: E402

from cuda_ext import fixedrate as fr_ops  # noqa: E402


def cut(rows: int, cols: int, chunk_bytes: int) -> list[int]:
    step = max(64, chunk_bytes // (2 * cols) // 64 * 64)
    return [min(step, rows - r) for r in range(0, rows, step)]


class Pipeline:
    """The layer's matmuls as chunked decode + cuBLAS on side streams, outputs y^T [rows_w, n]."""

    def __init__(self, forms: dict, xs: dict, chunk_bytes: int, slots: int, mm_streams: int):
        self.jobs = []
        for k, f in forms.items():
            sizes = cut(f.rows, f.cols, chunk_bytes)
            yt = torch.empty(f.rows, xs[k].shape[0], dtype=torch.bfloat16, device="cuda")
            for view, r0 in zip(fr_ops.row_views(f, sizes), itertools.accumulate(sizes, initial=0)):
                self.jobs.append((view, xs[k], yt[r0:r0 + view.rows]))
        slot_elems = max(v.rows * v.cols for v, _, _ in self.jobs)
        self.scratch = [torch.empty(slot_elems, dtype=torch.bfloat16, device="cuda") for _ in range(slots)]
        self.dec = torch.cuda.Stream()
        self.mms = [torch.cuda.Stream() for _ in range(mm_streams)]

    def __call__(self) -> None:
        main = torch.cuda.current_stream()
        for s in (self.dec, *self.mms):
            s.wait_stream(main)
        freed: list[torch.cuda.Event | None] = [None] * len(self.scratch)
        for i, (view, x, out) in enumerate(self.jobs):
            slot = i % len(self.scratch)
            buf = self.scratch[slot][:view.rows * view.cols].view(view.rows, view.cols)
            with torch.cuda.stream(self.dec):
                if freed[slot] is not None:
                    self.dec.wait_event(freed[slot])
                fr_ops.decode(view, out=buf)
                ready = torch.cuda.Event()
                ready.record(self.dec)
            mm = self.mms[i % len(self.mms)]
            with torch.cuda.stream(mm):
                mm.wait_event(ready)
                torch.mm(buf, x.t(), out=out)
                freed[slot] = torch.cuda.Event()
                freed[slot].record(mm)
        for s in (self.dec, *self.mms):
            main.wait_stream(s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda v: tuple(int(n) for n in v.split(","))  # noqa: E731
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--chunks-mb", type=ints, default=(2, 4, 8, 16))
    ap.add_argument("--slots", type=ints, default=(2, 4, 8))
    ap.add_argument("--mm-streams", type=ints, default=(1, 2, 4))
    ap.add_argument("--k-chunks", type=ints, default=(256, 512, 1024, 2048))
    args = ap.parse_args()
    layer = {k: w.cuda() for k, w in weights(LAYER_8B, seed=1).items()}
    forms = {k: fr_ops.encode(w) for k, w in layer.items()}
    g = torch.Generator(device="cuda").manual_seed(args.rows)
    xs = {k: torch.randn(args.rows, w.shape[1], device="cuda", generator=g).bfloat16() for k, w in layer.items()}
    reps = 10
    cublas = graph_ms(lambda: [F.linear(xs[k], layer[k]) for k in layer], reps)
    whole = graph_ms(lambda: [F.linear(xs[k], fr_ops.decode(forms[k])) for k in layer], reps)
    ref = torch.cat([F.linear(xs[k], layer[k]).t() for k in layer]).float()
    scratch = {k: torch.empty_like(w) for k, w in layer.items()}
    decode = graph_ms(lambda: [fr_ops.decode(forms[k], out=scratch[k]) for k in layer], reps)
    print(f"rows {args.rows}: cuBLAS {cublas:.4f} ms; whole decode + cuBLAS {whole / cublas:.3f}; "
          f"the layer's decode alone {decode / cublas:.3f}", flush=True)
    for kc in args.k_chunks:
        part = {k: torch.randn(w.shape[0], kc, device="cuda").bfloat16() for k, w in layer.items()}
        sums = {k: torch.zeros(args.rows, w.shape[0], device="cuda") for k, w in layer.items()}
        t = graph_ms(lambda: [torch.addmm(sums[k], xs[k][:, c:c + kc], part[k].t(), out_dtype=torch.float32,
                                          out=sums[k]) for k, w in layer.items() for c in range(0, w.shape[1], kc)], reps)
        print(f"  cuBLAS over K chunks of {kc} columns from L2, float32 sums: {t / cublas:.3f}", flush=True)
    for mb in args.chunks_mb:
        rows = cut(14336, 4096, mb << 20)[0]
        w = layer["gate"][:rows]
        l2 = graph_ms(lambda: [torch.mm(w, xs["gate"].t()) for _ in range(8)], reps) / 8
        n_chunks = sum(len(cut(f.rows, f.cols, mb << 20)) for f in forms.values())
        slab = Pipeline(forms, xs, mb << 20, 1, 1)
        dec_l2 = graph_ms(lambda: [fr_ops.decode(v, out=slab.scratch[0][:v.rows * v.cols].view(v.rows, v.cols))
                                   for v, _, _ in slab.jobs], reps)
        print(f"  {mb} MB chunks ({n_chunks} a layer): cuBLAS on one chunk in L2 x {n_chunks} = "
              f"{l2 * n_chunks / cublas:.3f}; the layer decoded chunk by chunk into one scratch {dec_l2 / cublas:.3f}",
              flush=True)
        for slots in args.slots:
            for streams in args.mm_streams:
                pipe = Pipeline(forms, xs, mb << 20, slots, streams)
                t = graph_ms(pipe, reps)
                got = torch.cat([out for _, _, out in pipe.jobs])
                err = (got.float() - ref).abs().max().item()
                print(f"    slots {slots} mm streams {streams}: {t / cublas:.3f} (max |diff| vs cuBLAS {err:.3g})",
                      flush=True)


if __name__ == "__main__":
    main()
