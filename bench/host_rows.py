"""The embedding gather from page-locked host memory (cuda_ext gather_host_rows; fixed.HostEmbedding)
beside the same gather from a table on the device (torch's embedding) and beside the bus's limit:
the rows' bytes ÷ the measured pinned H2D bandwidth. A 7B-shaped table (32000 x 4096 bf16), ids
random, each gather timed as a CUDA graph of 20 (the decode step captures it so).

    python bench/host_rows.py [--rows 1 32 64 512 2048] [--json out.json]     # a lent GPU
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from fixedrate_gpu import graph_ms  # noqa: E402  (the benches' graph timing: fn captured, replayed)

if not torch.cuda.is_available():
    sys.exit("host_rows.py: needs a CUDA GPU")
import cuda_ext  # noqa: E402
from cuda_ext import ops  # noqa: E402

VOCAB, WIDTH = 32000, 4096


def h2d_bandwidth() -> float:
    """Bytes/s of a pinned 256 MiB copy to the device (the best of 5)."""
    src = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 512, 2048])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not cuda_ext.available().cuda:
        sys.exit(f"host_rows.py: the extension's CUDA ops are not built: {cuda_ext.available().reason}")
    g = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randn(VOCAB, WIDTH, device="cuda", generator=g).to(torch.bfloat16)
    host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True).copy_(table)
    bus = h2d_bandwidth()
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "h2d_GBps": bus / 1e9,
           "rows": {}}
    for n in args.rows:
        ids = torch.randint(0, VOCAB, (n,), device="cuda", generator=g)
        got = torch.empty(n, WIDTH, dtype=table.dtype, device="cuda")
        ops.gather_host_rows(host, ids, got)
        assert torch.equal(got, F.embedding(ids, table))
        host_us = 1e3 * graph_ms(lambda: ops.gather_host_rows(host, ids, got), 20)
        device_us = 1e3 * graph_ms(lambda: F.embedding(ids, table), 20)
        limit_us = 1e6 * n * WIDTH * table.element_size() / bus
        out["rows"][n] = {"host_us": host_us, "device_us": device_us, "bus_limit_us": limit_us,
                          "host_over_device": host_us / device_us, "of_bus_limit": limit_us / host_us}
        print(f"{n:5d} rows: from the host {host_us:8.2f} us, from the device {device_us:7.2f} us "
              f"({host_us / device_us:5.1f}x), the bus's limit {limit_us:8.2f} us ({limit_us / host_us:.2f} of it)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
