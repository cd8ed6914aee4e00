"""Interleaved A/B of the CPU engine (no HTTP): two paged schedulers on their own copies of the demo,
one with its linear16 weights packed at load (service/model/cpu_dtype.py: pack), one without;
48 greedy tokens each round, tokens/s and whether the tokens are equal. OMP_WAIT_POLICY as set
(default here: PASSIVE, as `wcodec serve` runs; UNSET: OpenMP's own).

    python bench/experiments/linear16_packed_ab.py ARCHIVE [ROUNDS]
"""
import os
import sys
import time

if os.environ.get("OMP_WAIT_POLICY") == "UNSET":
    del os.environ["OMP_WAIT_POLICY"]
else:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests/service/engine"), str(ROOT / "tests/service"), str(ROOT)]

from test_batching import load  # noqa: E402

from service.engine import paging  # noqa: E402
from service.engine.sampling import Row, SamplingParams  # noqa: E402
from service.model import cpu_dtype  # noqa: E402

PROMPT = "<|im_start|>user\nWrite a long story about the sea.<|im_end|>\n<|im_start|>assistant\n"


def scheduler(path: Path, packed: bool):
    real = cpu_dtype.pack
    cpu_dtype.pack = real if packed else (lambda model: 0)
    try:
        served = load(path, "demo")
    finally:
        cpu_dtype.pack = real
    return served, paging.scheduler(served, 64, 512, paging.CacheSettings(), lambda r, e: None, lambda r: None)


def one(served, s, prompt: list[int], n: int = 48) -> tuple[float, list[int]]:
    row = Row(prompt, SamplingParams(n), served)
    s.add(row)
    s.step()                                   # the prompt and the first token
    t0 = time.perf_counter()
    while not s.idle:
        s.step()
    return (len(row.ids) - 1) / (time.perf_counter() - t0), row.ids


def main() -> None:
    path, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
    pair = {packed: scheduler(path, packed) for packed in (False, True)}
    prompt = pair[True][0].tokenizer.encode(PROMPT)
    for _ in range(rounds):
        out = {packed: one(*pair[packed], prompt) for packed in (False, True)}
        print({("packed" if k else "unpacked"): round(v[0], 1) for k, v in out.items()},
              "same tokens:", out[False][1] == out[True][1], flush=True)


if __name__ == "__main__":
    main()
