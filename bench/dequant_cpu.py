"""dequantize_blocks on the CPU, as compressed-resident mode calls it before every matmul: GB/s of
output per block type and dtype, one demo-sized weight (1536 x 576) a call, for each checkout
given (its own built extension, in a child process) and this one with WCODEC_CPU_SIMD=0. Every
checkout's output is compared with the first's, bit for bit (docs/BENCHMARKS.md).

    python bench/dequant_cpu.py --trees /path/to/main/checkout . --threads 1 2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

SHAPE = (1536, 576)                    # the demo's MLP up/gate projection
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def blocks(bt, n_blocks: int, seed: int) -> np.ndarray:
    """Random quants, small positive f16 scales (a trained weight's; NaN scales are the tests')."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 256, (n_blocks, bt.type_size), dtype=np.uint8)
    for plane, (at, *_) in bt.planes:
        if plane.endswith("_lo"):                                   # an f16 field: _lo, then _hi
            out[:, at:at + 2] = (rng.random(n_blocks) * 1e-3 + 1e-4).astype("<f2").view(np.uint8).reshape(-1, 2)
    return out


def child(threads: list[int], repeat: int) -> dict:
    import cuda_ext
    from codec import gguf_blocks
    from cuda_ext import ops
    assert cuda_ext.available().cpp, cuda_ext.available().reason
    result = {"path": cuda_ext.available().path}
    numel = SHAPE[0] * SHAPE[1]
    for name, bt in gguf_blocks.BLOCK_TYPES.items():
        planes = [torch.from_numpy(np.ascontiguousarray(p))
                  for p in gguf_blocks.split(bt, blocks(bt, numel // bt.block_size, seed=bt.code)).values()]
        for dname, dtype in DTYPES.items():
            out = torch.empty(numel, dtype=dtype)
            for n in threads:
                torch.set_num_threads(n)
                ops.dequantize_blocks(planes, bt.code, [out])
                seconds = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    ops.dequantize_blocks(planes, bt.code, [out])
                    seconds.append(time.perf_counter() - t0)
                result[f"{name} {dname} {n}t"] = out.nbytes / statistics.median(seconds) / 1e9
            result[f"{name} {dname} sha"] = hashlib.sha256(out.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return result


def run_child(tree: str, simd: bool, args) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "WCODEC_CPU_SIMD": "1" if simd else "0"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--repeat", str(args.repeat), "--threads",
           *map(str, args.threads)]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", nargs="+", default=["."], help="checkouts with a built extension, baseline first")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.threads, args.repeat)))
        return
    runs = {f"{t} simd": run_child(t, True, args) for t in args.trees}
    runs[f"{args.trees[-1]} WCODEC_CPU_SIMD=0"] = run_child(args.trees[-1], False, args)
    first = next(iter(runs.values()))
    keys = [k for k in first if k[-1] == "t"]
    print("extension:", [r["path"] for r in runs.values()])
    print("GB/s of output, " + SHAPE.__repr__() + " a call:")
    print(f"{'':>14}" + "".join(f"{label[-40:]:>42}" for label in runs))
    for k in keys:
        print(f"{k:>14}" + "".join(f"{r[k]:>42.2f}" for r in runs.values()))
    same = all(r[k] == first[k] for r in runs.values() for k in first if k.endswith("sha"))
    print("outputs bit-identical across runs:", same)


if __name__ == "__main__":
    main()
