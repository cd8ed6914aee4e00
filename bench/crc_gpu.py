"""Stream checksums on the GPU (service/load/devicecheck.py): crc32_spans over archive-like spans of a
device buffer, beside a device-to-device copy of the same bytes and the host's checksums (zlib
CRC32 and XXH3-64 on one core), in one run.

    python bench/crc_gpu.py [--gib 4] [--spans 700]
"""
from __future__ import annotations

import argparse
import json
import time
import zlib

import numpy as np
import torch
import xxhash

import cuda_ext
from gpu_bench import timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--spans", type=int, default=700)       # a 7B archive's streams
    a = ap.parse_args()
    assert cuda_ext.checksums_on(torch.device("cuda")), cuda_ext.available()
    n = int(a.gib * (1 << 30))
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cuts = np.sort(np.random.default_rng(1).choice(n, a.spans - 1, replace=False))
    bounds = np.concatenate([[0], cuts, [n]])
    spans = torch.tensor(np.stack([bounds[:-1], np.diff(bounds)], 1), dtype=torch.int64)
    got = cuda_ext.crc32_spans(data, spans)
    host = data[:256 << 20].cpu().numpy()
    first = spans[spans[:, 0] + spans[:, 1] <= host.size][:20]
    assert got[:len(first)].tolist() == [zlib.crc32(host[o:o + m]) for o, m in first.tolist()]
    crc_s = timed(lambda: cuda_ext.crc32_spans(data, spans))
    out = torch.empty_like(data)
    copy_s = timed(lambda: out.copy_(data))
    t = time.perf_counter(); zlib.crc32(host); zlib_s = (time.perf_counter() - t) * n / host.size
    t = time.perf_counter(); xxhash.xxh3_64_hexdigest(host); xxh_s = (time.perf_counter() - t) * n / host.size
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "GB": n / 1e9, "spans": a.spans,
                      "crc32_gpu_GBps": n / crc_s / 1e9, "device_copy_GBps_read": n / copy_s / 1e9,
                      "crc32_gpu_vs_copy": crc_s / copy_s, "zlib_crc32_one_core_GBps": n / zlib_s / 1e9,
                      "xxh3_one_core_GBps": n / xxh_s / 1e9, "checked_against_zlib": len(first)}))


if __name__ == "__main__":
    main()
