"""Paired A/B timing of one engine step (issue 13): two closed-loop batchers of one model
(bench/engine_step.py's simulation), A with the old KV cache, B with the current one,
stepped in alternating blocks in one process, so that the machine's drift touches both alike.

    OMP_WAIT_POLICY=PASSIVE python bench/experiments/engine_ab.py --archive STORE/smollm2-135m-instruct.wcodec \\
        --rounds 4 --steps 10

A keeps its KV cache the old way: grown by torch.cat every step (service/model/llama.py's KVCache
before 2026-11-23's in-place one, kept as kvcache.ConcatKVCache), B the current way."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))          # bench/: engine_step
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))          # the repository

from engine_step import closed_loop, load  # noqa: E402

from service.model import kvcache  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archive", type=Path, required=True)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    served = load(args.archive)
    a, b = closed_loop(served, args.users, kvcache.ConcatKVCache), closed_loop(served, args.users)
    times = {"A": [], "B": []}
    for r in range(args.rounds):
        for name, batcher in (("A", a), ("B", b)) if r % 2 == 0 else (("B", b), ("A", a)):
            t0, tokens = time.perf_counter(), 0
            for _ in range(args.steps):
                tokens += batcher.step().tokens
            ms = (time.perf_counter() - t0) / args.steps * 1e3
            times[name].append(ms)
            print(f"round {r} {name}: {ms:.1f} ms a step, {tokens / args.steps:.1f} tokens a step", flush=True)
    ma, mb = (sum(times[k]) / len(times[k]) for k in "AB")
    print(f"A (torch.cat cache) {ma:.1f} ms, B (current) {mb:.1f} ms a step: B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
