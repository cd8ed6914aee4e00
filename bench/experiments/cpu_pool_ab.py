"""The CPU engine's batch-1 decode step without HTTP (issue 23, CPU half): the 10th, 25th and 50th
percentile of every step's time over REQUESTS requests of 48 greedy tokens on the demo (the paged
engine, bench/engine_paged_ab.py's batch1), in this process's settings: OMP_WAIT_POLICY=PASSIVE
as `wcodec serve` runs unless set; WCODEC_CPU_READ_AHEAD / WCODEC_CPU_SPIN_US for linear16's pool
(cuda_ext/csrc/cpu_pool.h). On a shared machine the low percentiles are the steady figures; run
two builds (or settings) in turn, several times, to compare them.

    python bench/experiments/cpu_pool_ab.py ARCHIVE [REQUESTS]
    WCODEC_CPU_READ_AHEAD=0 python bench/experiments/cpu_pool_ab.py ARCHIVE      # no read-ahead
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from engine_paged_ab import batch1  # noqa: E402
from engine_step import load, prompts  # noqa: E402


def main() -> None:
    path, requests = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4
    served, texts, steps = load(path), prompts(), []
    for _ in range(requests):
        batch1(served, "paged", texts, 48, steps)
    steps.sort()
    ms = {f"p{q}": round(steps[int(q / 100 * (len(steps) - 1))] * 1e3, 1) for q in (10, 25, 50)}
    print({"ms_a_step": ms, "tokens_per_s_at_p50": round(1e3 / ms["p50"], 1)}, flush=True)


if __name__ == "__main__":
    main()
