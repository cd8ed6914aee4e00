"""Interleaved A/B of the CPU engine (no HTTP): the paged engine's batch-1 decode on two copies of
the demo, one with its linear16 weights packed at load (service/model/cpu_dtype.py: pack), one
without (bench/engine_paged_ab.py's batch1, bench/engine_step.py's load). OMP_WAIT_POLICY as set
(default here: PASSIVE, as `wcodec serve` runs; UNSET: OpenMP's own). The outputs are equal bit
for bit (tests/cuda_ext/test_linear16.py).

    python bench/experiments/linear16_packed_ab.py ARCHIVE [ROUNDS]
"""
import os
import sys
from pathlib import Path

if os.environ.get("OMP_WAIT_POLICY") == "UNSET":
    del os.environ["OMP_WAIT_POLICY"]
else:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from engine_paged_ab import batch1  # noqa: E402
from engine_step import load, prompts  # noqa: E402

from service.model import cpu_dtype  # noqa: E402


def served(path: Path, packed: bool):
    real = cpu_dtype.pack
    cpu_dtype.pack = real if packed else (lambda model: 0)
    try:
        return load(path)
    finally:
        cpu_dtype.pack = real


def main() -> None:
    path, rounds = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 5
    pair, texts = {name: served(path, name == "packed") for name in ("unpacked", "packed")}, prompts()
    for _ in range(rounds):
        print({name: round(batch1(s, "paged", texts, 48), 1) for name, s in pair.items()}, flush=True)


if __name__ == "__main__":
    main()
