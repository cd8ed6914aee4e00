"""The C++ CPU twin alone: decode GB/s of an archive's float tensors into preallocated outputs
(the op, no planning or allocation), per thread count.

    python bench/cpu_twin.py ARCHIVE.wcodec [--threads 1 2] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import cuda_ext
from codec.decode import Archive
from cuda_ext import ops, plans


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    avail = cuda_ext.available()
    assert avail.cpp, avail.reason
    with Archive.open(args.archive) as a:
        p = plans.build(a.entries, a.path)
        data = torch.from_numpy(a.reader.buf[p.start:p.end].copy())
    outs = [torch.empty(e.shape, dtype=e.torch_dtype) for e in p.float_entries]
    raw = sum(o.nbytes for o in outs)
    status, states, words = plans.buffers(p, "cpu", plans.MODE_BULK, 0)
    plan = plans.device_plan(p, outs, plans.MODE_BULK, 0)

    def decode():
        ops.decode_pieces(data, p.desc, plan, outs, states, words, status, plans.MODE_BULK, 0)

    print(f"{args.archive}: {len(outs)} float tensors, {raw / 1e6:.1f} MB decoded, extension {avail.path}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        decode()                                                              # warm-up: touch the outputs
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            decode()
            times.append(time.perf_counter() - t)
        assert int(status.abs().sum()) == 0
        print(f"threads {threads}: {raw / statistics.median(times) / 1e9:.2f} GB/s (median of {args.repeat})")


if __name__ == "__main__":
    main()
