"""GGUF blocks kept quantized, on the CPU: archive size against the GGUF file, and load speed of the
NumPy reference and of the C++ twin (decode_bytes + dequantize_blocks), every load checked bit-exact
against the GGUF source's dequantization (docs/BENCHMARKS.md).

    python bench/quant_cpu.py SmolLM2-135M-Instruct.Q4_1.gguf --threads 1 2 --repeat 3
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import torch

import cuda_ext
import wcodec
from codec.decode import Archive, load
from codec.encode import compress
from codec.sources import open_source


def timed(fn, repeat: int):
    out, seconds = None, []
    for _ in range(repeat):
        out = None
        t0 = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - t0)
    return out, statistics.median(seconds)


def check(state: dict[str, torch.Tensor], src: str) -> None:
    with open_source(src) as source:
        for info in source.tensors():
            if not torch.equal(state[info.name].view(torch.uint8), source.load(info.name).view(torch.uint8)):
                raise SystemExit(f"{info.name}: not bit-identical to gguf's dequantization")


def planes_summary(path: str) -> dict:
    """Stored bytes per (block type, plane), and how many of those planes are coded."""
    out = collections.defaultdict(lambda: {"stored": 0, "coded": 0, "planes": 0})
    with Archive.open(path) as archive:
        for e in archive.entries:
            if e.codec != "gguf":
                out[e.codec]["stored"] += sum(s["length"] for s in e.streams.values())
                continue
            for role, p in e.params.planes.items():
                row = out[f"{e.params.block.name}.{role}"]
                row["stored"] += e.streams[role]["length"]
                row["planes"] += 1
                row["coded"] += p is not None
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dst = os.path.join(tmp, "blocks.wcodec")
        stats = compress(args.gguf, dst, workers=2)
        result = {"gguf_bytes": os.path.getsize(args.gguf), "file_bytes": stats.file_bytes,
                  "file_over_gguf": stats.file_bytes / os.path.getsize(args.gguf), "decoded_bytes": stats.raw_bytes,
                  "encode_s": stats.seconds, "planes": planes_summary(dst)}
        model, sec = timed(lambda: load(dst, workers=2), args.repeat)
        check(model.state_dict, args.gguf)
        result["numpy_2proc_MBps"] = stats.raw_bytes / 1e6 / sec
        cuda_ext.available()
        for n in args.threads:
            torch.set_num_threads(n)
            model, sec = timed(lambda: wcodec.load(dst, "cpu", verify=False), args.repeat)
            check(model.state_dict, args.gguf)
            result[f"cpp_{n}thread_MBps"] = stats.raw_bytes / 1e6 / sec
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
