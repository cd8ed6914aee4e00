"""Probe (issue 9, a load into a running server): ways to move a file that is in the page cache
into GPU memory, and what verifying it costs beside. Not a benchmark of the product: it chooses
the loader's design. Needs CUDA.

    python3 bench/experiments/probe_h2d.py /tmp/probe.bin --gb 9

    pread    16 threads preadv into a ring of pinned buffers, then cudaMemcpyAsync (today's loader)
    mapped   the file mmap'd read-only, each chunk page-locked in place (cudaHostRegister
             ReadOnly) by a thread ahead of the copy, copied by DMA, unregistered: no CPU copy
    pageable the mmap'd chunk copied from pageable memory (the driver stages it)
    hash     XXH3-64 of the mmap'd chunks by N threads (no copy: the page cache read in place)
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

CHUNK = 256 << 20
READ_ONLY = 8                   # cudaHostRegisterReadOnly
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def make(path: str, nbytes: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == nbytes:
        return
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for i in range(0, nbytes, len(block)):
            f.write(block[:min(len(block), nbytes - i)])


def timed(fn, *a):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*a)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def pread(path: str, dst: torch.Tensor, threads: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    size = os.path.getsize(path)
    ring = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
    events = [torch.cuda.Event() for _ in range(3)]
    stream = torch.cuda.Stream()
    pool = ThreadPoolExecutor(threads)
    piece = 8 << 20
    for k, off in enumerate(range(0, size, CHUNK)):
        n = min(CHUNK, size - off)
        slot = k % 3
        events[slot].synchronize()
        view = memoryview(ring[slot].numpy())
        list(pool.map(lambda p: os.preadv(fd, [view[p:min(p + piece, n)]], off + p), range(0, n, piece)))
        with torch.cuda.stream(stream):
            dst[off:off + n].copy_(ring[slot][:n], non_blocking=True)
            events[slot].record(stream)
    stream.synchronize()
    pool.shutdown()
    os.close(fd)


def mapped(path: str, dst: torch.Tensor, ahead: int, flags: int) -> dict:
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    rt = torch.cuda.cudart()
    stream = torch.cuda.Stream()
    chunks = [(off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
    reg_s = [0.0]

    def register(c):
        t0 = time.perf_counter()
        err = rt.cudaHostRegister(base + c[0], c[1], flags)
        reg_s[0] += time.perf_counter() - t0
        return int(err) if not isinstance(err, int) else err

    pool = ThreadPoolExecutor(ahead)
    futs = [pool.submit(register, c) for c in chunks]
    errs = set()
    done = []
    for (off, n), f in zip(chunks, futs):
        err = f.result()
        errs.add(err)
        src = torch.from_numpy(np.ctypeslib.as_array(ctypes.cast(base + off, ctypes.POINTER(ctypes.c_uint8)), (n,)))
        with torch.cuda.stream(stream):
            dst[off:off + n].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        done.append((off, ev))
    stream.synchronize()
    t0 = time.perf_counter()
    for off, n in chunks:
        rt.cudaHostUnregister(base + off)
    unreg = time.perf_counter() - t0
    pool.shutdown()
    libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(size))
    return {"register_errors": sorted(str(e) for e in errs), "register_s_sum": round(reg_s[0], 3),
            "unregister_s": round(unreg, 3)}


def pageable(path: str, dst: torch.Tensor) -> None:
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    arr = np.frombuffer(m, np.uint8)
    for off in range(0, len(arr), CHUNK):
        src = torch.from_numpy(arr[off:off + CHUNK].copy())
        dst[off:off + len(src)].copy_(src)
    del arr
    m.close()


def hashed(path: str, threads: int, piece: int = 16 << 20) -> int:
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(m)
    with ThreadPoolExecutor(threads) as pool:
        out = list(pool.map(lambda p: xxhash.xxh3_64_intdigest(view[p:p + piece]), range(0, len(view), piece)))
    view.release()
    m.close()
    return len(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--gb", type=float, default=9.0)
    a = ap.parse_args()
    nbytes = int(a.gb * 1e9) // 4096 * 4096
    t0 = time.perf_counter()
    make(a.path, nbytes)
    print(f"file {nbytes / 1e9:.2f} GB ready in {time.perf_counter() - t0:.1f} s", flush=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    hashed(a.path, 16)                                     # the page cache warm for everyone
    ref = None
    for rnd in range(2):
        for name, fn, args in [("pread16", pread, (a.path, dst, 16)),
                               ("mapped a2 ro", mapped, (a.path, dst, 2, READ_ONLY)),
                               ("mapped a4 ro", mapped, (a.path, dst, 4, READ_ONLY)),
                               ("mapped a4 ro+portable", mapped, (a.path, dst, 4, READ_ONLY | 1)),
                               ("pageable", pageable, (a.path, dst)),
                               ("hash16", hashed, (a.path, 16)), ("hash8", hashed, (a.path, 8))]:
            if rnd and name == "pageable":
                continue
            dst.zero_()
            try:
                s, out = timed(fn, *args)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            if not name.startswith("hash"):
                check = int(dst[::1 << 20].sum())
                ref = check if ref is None else ref
                out = {**(out or {}), "sampled_sum_ok": check == ref}
            print(f"round {rnd} {name:22s} {s:6.3f} s  {nbytes / s / 1e9:6.1f} GB/s  {out if out else ''}", flush=True)
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    s, _ = timed(lambda: __import__("safetensors.torch").torch.save_file({"x": x.cpu()}, a.path + ".st"))
    s, _ = timed(lambda: __import__("safetensors.torch").torch.load_file(a.path + ".st", device="cuda"))
    print(f"safetensors.load_file(device=cuda) {s:.3f} s  {nbytes / s / 1e9:.1f} GB/s", flush=True)
    s, _ = timed(lambda: __import__("safetensors.torch").torch.load_file(a.path + ".st", device="cuda"))
    print(f"safetensors.load_file(device=cuda) again {s:.3f} s", flush=True)


if __name__ == "__main__":
    main()
