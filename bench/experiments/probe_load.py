"""Probe (issue 9): the loader alone on one archive, in this process, phase by phase — with the
archive read early into memory (as `wcodec serve` does at start-up) and without (a load into a
running server). Chooses where the loader's time goes; not a benchmark of the product.

    python3 bench/experiments/probe_load.py /tmp/wcodec-coldstart/store/model.wcodec [--runs 3]
"""
from __future__ import annotations

import argparse
import time

import torch

import cuda_ext
from service.load import pipeline
from service.load.early_read import EarlyRead
from service.timeline import Timeline


def once(path: str, early: EarlyRead | None, ring: int) -> str:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    d = pipeline.decode_archive(path, torch.device("cuda"), early=early, ring=ring)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    phases = " ".join(f"{k} {v:.3f}" for k, v in d.stats.phases().items())
    out = f"{wall:.3f} s ({d.stats.compressed_bytes / wall / 1e9:.1f} GB/s of archive)  {phases}"
    del d
    return out


def start() -> argparse.Namespace:
    """The probes' command line (an archive, --runs), with the extension and a CUDA context ready."""
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    cuda_ext.available()
    torch.empty(1, device="cuda")
    return a


def main() -> None:
    a = start()
    import sys

    from service.load import reading
    for ring in (3, 4, 6):
        for r in range(a.runs):
            print(f"ring {ring} from the page cache, run {r}: {once(a.path, None, ring)}", flush=True)
    default_switch, default_piece = sys.getswitchinterval(), reading.read_range.__defaults__
    for switch in (default_switch, 1e-4):
        for piece in (8 << 20, 32 << 20):
            sys.setswitchinterval(switch)
            reading.read_range.__defaults__ = (*default_piece[:-1], piece)
            for r in range(a.runs):
                print(f"ring 4, GIL switch interval {switch * 1e3:g} ms, pieces of {piece >> 20} MiB, run {r}: "
                      f"{once(a.path, None, 4)}", flush=True)
    sys.setswitchinterval(default_switch)
    reading.read_range.__defaults__ = default_piece
    for r in range(a.runs):
        tl = Timeline()
        t0 = time.perf_counter()
        early = EarlyRead(a.path, verify=True, threads=pipeline.read_threads(), direct=None, timeline=tl)
        early.wait_until(1 << 62)
        read = time.perf_counter() - t0
        print(f"early read {read:.3f} s; then the load: {once(a.path, early, 4)}", flush=True)
    print(f"pinned ring kept: {pipeline.PINNED.nbytes >> 20} MiB", flush=True)


if __name__ == "__main__":
    main()
