"""Probe (issue 9): model switches from the host cache, the loader alone in this process — a first
load (kept), then hits verified on the GPU (the server's default on CUDA), on the host, and not at
all. Chooses where a switch's time goes; not a benchmark of the product (bench/cold_start.py
--only server is).

    python3 bench/experiments/probe_switch.py /tmp/wcodec-coldstart/store/model.wcodec [--runs 3]
"""
from __future__ import annotations

import time

import torch
from probe_load import start

from service.load import pipeline
from service.load.hostcache import HostCache


def once(cache: HostCache, path: str, where: str, threads: int) -> str:
    """where: "gpu" (the cache hashes nothing, the loader checks CRC32s on the GPU), "host" (the
    cache rechecks XXH3 on the host; the loader's GPU check too), "off"."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with cache.use(path, verify=where == "host", threads=threads, direct=None) as use:
        t1 = time.perf_counter()
        d = pipeline.decode_archive(path, torch.device("cuda"), early=use.read, verify=where != "off", threads=threads)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    phases = " ".join(f"{k} {v:.3f}" for k, v in d.stats.phases().items())
    del d
    return f"{use.source:10s} verify {where:4s} threads {threads:2d}: {wall:.3f} s (checkout {t1 - t0:.3f})  {phases}"


def main() -> None:
    a = start()
    cache = HostCache(1 << 40, pin=True)
    print(once(cache, a.path, "gpu", 16), flush=True)
    deadline = time.monotonic() + 30
    while not cache.peek(a.path).pinned and time.monotonic() < deadline:
        time.sleep(0.05)
    print("page-locked:", cache.peek(a.path).pinned, flush=True)
    for where in ("gpu", "off", "host"):
        for _ in range(a.runs):
            print(once(cache, a.path, where, 16), flush=True)
    cache.clear()


if __name__ == "__main__":
    main()
