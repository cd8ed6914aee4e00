"""Worker processes for encoding and decoding across tensors (NumPy work does not scale with
threads at these array sizes: the GIL hand-offs cost more than they win)."""
from __future__ import annotations

import ctypes
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable, Iterable, Iterator

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
WORKER_STATE: dict = {}            # per worker process: what its initializer handed it


def default_workers() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def keep_heap() -> None:
    """Keep freed large arrays in this process's heap: fresh pages cost ~2 us each to fault in
    on these VMs, which is more than the rANS loop spends on them. Linux/glibc only."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, 4 << 30)
    except (OSError, AttributeError):
        pass


def _init_worker(state: dict) -> None:
    # A forked child inherits the parent's OpenMP thread-pool state but not its threads: its first
    # parallel torch op would wait forever on a barrier (libgomp). Workers are the parallelism here.
    import torch
    torch.set_num_threads(1)
    keep_heap()
    WORKER_STATE.update(state)


def ordered_map(fn: Callable, jobs: Iterable, workers: int, state: dict | None = None,
                window: int | None = None) -> Iterator:
    """Yield fn(job) in job order, with at most `window` jobs in flight (bounded memory).

    workers == 1 runs inline. Worker processes are forked, so `state` (e.g. an anonymous shared
    mmap) is inherited, never pickled."""
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        WORKER_STATE.update(state or {})          # inline: the caller's heap policy stays as it is
        yield from map(fn, jobs)
        return
    window = window or workers + 1
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(state or {},)) as pool:
        pending: list[Future] = []
        for job in jobs:
            pending.append(pool.submit(fn, job))
            if len(pending) >= window:
                yield pending.pop(0).result()
        for fut in pending:
            yield fut.result()


def balanced_limit(total: int, workers: int, batch: int) -> int:
    """Elements per job so that jobs are <= batch and their count is a multiple of `workers`."""
    n_jobs = workers * max(1, -(-total // (workers * batch)))
    return max(1, -(-total // n_jobs))
