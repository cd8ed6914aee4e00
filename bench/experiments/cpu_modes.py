"""The CPU's compute modes (service/model/cpu_dtype.py) in the paged engine, without HTTP, on the
demo: a decode step of R rows (median of --steps steps, every row decoding) and the prefill of one
prompt of the load test's kind (~22 tokens, the head on its last row), for `model` (PyTorch's bf16
matmuls), `mixed` (float32 matmuls from 6 rows) and `linear16`, interleaved round by round so that
machine load touches all alike. OMP_WAIT_POLICY=PASSIVE as `wcodec serve` runs unless set.

    python bench/experiments/cpu_modes.py ARCHIVE [--rows 1 4 29] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import torch  # noqa: E402
from engine_paged_ab import make  # noqa: E402
from engine_step import prompts  # noqa: E402

from service.engine.sampling import Row, SamplingParams  # noqa: E402
from service.load import pipeline  # noqa: E402
from service.model import build, cpu_dtype  # noqa: E402

MODES = ("model", "mixed", "linear16")


def served_as(archive: Path, mode: str) -> build.ServedModel:
    """The demo as `auto` would compute it if the CPU chose `mode`."""
    d = pipeline.decode_archive(archive, torch.device("cpu"))
    served = build.finish("demo", build.prepare("demo", d.files), d.tensors, d.layers, torch.device("cpu"))
    if mode == "model":
        return cpu_dtype.for_cpu(served, "model")
    if mode == "linear16":
        assert cpu_dtype.linear16_kernel(served.dtype), "linear16 has no SIMD loop on this CPU"
        return cpu_dtype.for_cpu(served, "auto")
    native, kernel = cpu_dtype._native, cpu_dtype.linear16_kernel
    cpu_dtype._native, cpu_dtype.linear16_kernel = (lambda dtype: False), (lambda dtype: False)
    try:
        return cpu_dtype.for_cpu(served, "auto")
    finally:
        cpu_dtype._native, cpu_dtype.linear16_kernel = native, kernel


def decode_step(served, texts, rows: int, steps: int) -> float:
    """Median seconds of a step of `rows` decoding rows (their prefills done first)."""
    b = make(served, "paged", lambda r: None)
    for _ in range(rows):
        b.add(Row(served.tokenizer.encode(next(texts)), SamplingParams(rows + steps + 8), served))
    for _ in range(rows + 2):                      # every prompt prefilled (a chunk a step at most)
        b.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        b.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill(served, texts) -> float:
    """Seconds of the step that prefills one prompt (and gives its first token)."""
    b = make(served, "paged", lambda r: None)
    b.add(Row(served.tokenizer.encode(next(texts)), SamplingParams(2), served))
    t = time.perf_counter()
    b.step()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archive", type=Path)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 29])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    models, texts = {m: served_as(args.archive, m) for m in MODES}, prompts()
    for m in MODES:
        decode_step(models[m], texts, 1, 3)                                  # warm-up
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for m in MODES:
            results.setdefault(("prefill", m), []).extend(prefill(models[m], texts) for _ in range(3))
            for rows in args.rows:
                results.setdefault((f"{rows} rows", m), []).append(decode_step(models[m], texts, rows, args.steps))
    print(f"{'':10s}" + "".join(f"{m:>12s}" for m in MODES), f"  ({torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, ms, medians)")
    for what in ["prefill"] + [f"{r} rows" for r in args.rows]:
        print(f"{what:10s}" + "".join(f"{statistics.median(results[(what, m)]) * 1e3:12.1f}" for m in MODES))


if __name__ == "__main__":
    main()
