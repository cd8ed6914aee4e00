"""The paged engine (service/engine/scheduler.py) against the padded one (batcher.py) at the engine,
without HTTP, interleaved so that machine load touches both alike (issue 23): batch-1 decode
tokens/s (one request of --tokens, after its prefill) and the 32-row closed loop of
bench/engine_step.py (generated tokens/s over --steps steps).

    python bench/engine_paged_ab.py --archive STORE/smollm2-135m-instruct.wcodec --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # as `wcodec serve` runs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_step import load, prompts

from service.engine import Batcher, paging
from service.engine.sampling import Row, SamplingParams

KINDS = ("padded", "paged")


def make(served, kind: str, on_finish):
    if kind == "padded":
        return Batcher(served, max_rows=64, max_tokens=512, on_token=lambda r, e: None, on_finish=on_finish)
    return paging.scheduler(served, 64, 512, paging.CacheSettings(), lambda r, e: None, on_finish)


def batch1(served, kind: str, texts, tokens: int, steps: list[float] | None = None) -> float:
    """Decode tokens/s of one request after its prefill; each step's seconds appended to `steps`."""
    b = make(served, kind, lambda r: None)
    b.add(Row(served.tokenizer.encode(next(texts)), SamplingParams(tokens), served))
    b.step()                                                   # prefill and first token
    t0, n = time.perf_counter(), 0
    while not b.idle:
        t = time.perf_counter()
        b.step()
        n += 1
        if steps is not None:
            steps.append(time.perf_counter() - t)
    return n / (time.perf_counter() - t0)


def loop32(served, kind: str, texts, steps: int) -> float:
    holder = {}

    def new() -> Row:
        return Row(served.tokenizer.encode(next(texts)), SamplingParams(48), served)

    b = holder["b"] = make(served, kind, lambda r: holder["b"].add(new()))
    for _ in range(32):
        b.add(new())
        b.step()
    for _ in range(30):
        b.step()
    t0, rows = time.perf_counter(), 0
    for _ in range(steps):
        rows += b.step().rows
    return rows / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archive", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    served, texts = load(args.archive), prompts()
    res: dict[str, list[float]] = {f"{k}/{w}": [] for k in KINDS for w in ("batch1", "rows32")}
    for r in range(args.rounds):
        for k in KINDS:
            res[f"{k}/batch1"].append(batch1(served, k, texts, args.tokens))
            res[f"{k}/rows32"].append(loop32(served, k, texts, args.steps))
        print(r, {name: round(v[-1], 1) for name, v in res.items()}, "load", os.getloadavg()[0], flush=True)
    for name, v in res.items():
        print(f"{name:16s} median tokens/s {statistics.median(v):6.1f}   {[round(x, 1) for x in v]}")


if __name__ == "__main__":
    main()
