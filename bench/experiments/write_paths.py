"""How fast can one archive file be written out of the page cache? `wcodec compress`'s writer
thread (codec/container.Writer: one `write` a blob) bounds a 7B compress (9 GB out, ~4 s on an
H100 box). This times the ways to write N GB into one new file on this machine.

Usage: python bench/experiments/write_paths.py DIR [--gb 9] [--threads 4]"""
from __future__ import annotations

import argparse
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor


def timed(name: str, fn, path: str, gb: float) -> None:
    if os.path.exists(path):
        os.unlink(path)
    t0 = time.perf_counter()
    fn(path)
    dt = time.perf_counter() - t0
    print(f"{name:38s} {dt:6.2f} s  {gb / dt:5.2f} GB/s", flush=True)
    os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--gb", type=float, default=9.0)
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args()
    chunk = 64 << 20
    buf = bytearray(os.urandom(1 << 20)) * 64                     # 64 MB, incompressible
    n = int(a.gb * (1 << 30)) // chunk
    path = os.path.join(a.dir, "write_paths.bin")

    def serial(p, size=chunk):
        with open(p, "wb") as f:
            view = memoryview(buf)
            for _ in range(n * (chunk // size)):
                f.write(view[:size])

    def pwrite_threads(p):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.posix_fallocate(fd, 0, n * chunk)
        with ThreadPoolExecutor(a.threads) as ex:
            list(ex.map(lambda i: os.pwrite(fd, buf, i * chunk), range(n)))
        os.close(fd)

    def mmap_threads(p):
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        os.ftruncate(fd, n * chunk)
        mm = mmap.mmap(fd, n * chunk)
        def put(i):
            mm[i * chunk:(i + 1) * chunk] = buf
        with ThreadPoolExecutor(a.threads) as ex:
            list(ex.map(put, range(n)))
        mm.close()
        os.close(fd)

    timed("one thread, write() of 64 MB", serial, path, n * chunk / 2**30)
    timed("one thread, write() of 4 MB", lambda p: serial(p, 4 << 20), path, n * chunk / 2**30)
    timed(f"{a.threads} threads, pwrite() after fallocate", pwrite_threads, path, n * chunk / 2**30)
    timed(f"{a.threads} threads, memcpy into a shared mmap", mmap_threads, path, n * chunk / 2**30)
    timed("one thread, write() of 64 MB (again)", serial, path, n * chunk / 2**30)


if __name__ == "__main__":
    main()
