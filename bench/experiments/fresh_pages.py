"""Does writing a new file pay for fresh pages, and does a prefill (codec/container.Prefill) hide it?

A VM whose balloon reports free pages to the host (virtio-balloon feature bit 5, REPORTING) has the
host discard freed guest pages a few seconds after they are freed; the next use of each faults on
the host. Each round here rests first (so the pages of the round before are reported), then writes
GB of random bytes into a new file, 4 MB a call (as `wcodec compress`'s writer); then rests again,
writes zeros over the same length (the prefill) and the bytes over those pages.

    python bench/experiments/fresh_pages.py DIR [--gb 4] [--rest 8] [--rounds 2]

2026-11-26, the 2-core CPU machine (balloon REPORTING on), 0.88 GB: new file 0.26-0.55 GB/s; zeros
0.31-0.79 GB/s, then the bytes over them 4.50-4.88 GB/s."""
from __future__ import annotations

import argparse
import glob
import os
import time

CHUNK = 4 << 20


def reporting_balloon() -> bool | None:
    """Whether a virtio balloon here reports free pages (None: no balloon to be seen)."""
    for dev in glob.glob("/sys/bus/virtio/devices/*"):
        with open(f"{dev}/device") as f:
            if int(f.read(), 16) == 5:
                with open(f"{dev}/features") as f:
                    return f.read()[5] == "1"
    return None


def timed_write(fd: int, data: memoryview, size: int) -> float:
    t0 = time.perf_counter()
    for off in range(0, size, CHUNK):
        os.pwrite(fd, data[:min(CHUNK, size - off)], off)
    return size / 1e9 / (time.perf_counter() - t0)


def one_round(path: str, size: int, rest: float, data: memoryview, zeros: memoryview) -> str:
    time.sleep(rest)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    fresh = timed_write(fd, data, size)
    os.close(fd)
    os.unlink(path)
    time.sleep(rest)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    prefill = timed_write(fd, zeros, size)
    over = timed_write(fd, data, size)
    os.close(fd)
    os.unlink(path)
    return f"new file {fresh:.2f} GB/s; zeros {prefill:.2f} GB/s, then the bytes over them {over:.2f} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--rest", type=float, default=8.0, help="seconds before each write (pages reported)")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    size = int(a.gb * 1e9) // CHUNK * CHUNK
    data, zeros = memoryview(os.urandom(CHUNK)), memoryview(bytes(CHUNK))
    print(f"balloon reports free pages: {reporting_balloon()}; {size / 1e9:.2f} GB, rest {a.rest} s", flush=True)
    for _ in range(a.rounds):
        print(one_round(os.path.join(a.dir, "fresh_pages.bin"), size, a.rest, data, zeros), flush=True)


if __name__ == "__main__":
    main()
