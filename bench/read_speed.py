"""How fast compress reads a checkpoint's tensors (page cache warm): each batch's tensors loaded
whole, one per thread, into fresh memory (`source.load`, as compress read them before
codec/reads.py) against codec.reads.BatchReader (chunks on its threads, pooled buffers).

    python bench/read_speed.py FOLDER [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from codec.encode import BATCH_ELEMENTS, _jobs  # noqa: E402
from codec.reads import BatchReader  # noqa: E402
from codec.sources import layer_order, open_source  # noqa: E402


def timed(fn, rounds: int) -> float:
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    with open_source(a.folder) as src, BatchReader(src, src.load) as reader:
        infos = layer_order(src.tensors())
        batches = [[i.name for i in infos] for _, infos, _ in _jobs(infos, "", BATCH_ELEMENTS, None)]
        size = sum(src.extent(i.name)[2] for i in infos) / 1e9
        with ThreadPoolExecutor(torch.get_num_threads()) as pool:
            whole = timed(lambda: [list(pool.map(src.load, names)) for names in batches], a.rounds)
        chunked = timed(lambda: [reader.read(names) for names in batches], a.rounds)
    for what, s in (("whole tensors, fresh memory", whole), ("BatchReader", chunked)):
        print(f"{what}: {s:.2f} s, {size / s:.2f} GB/s (median of {a.rounds})")


if __name__ == "__main__":
    main()
