"""What a `single` decode time holds besides the kernel: the host cost of one prepared launch
(Prepared.run, through the torch op) beside an empty torch op's, and the spread of single and
queued times over repeats, on the 1024x4096 tensor at each piece size asked for.

    python bench/experiments/launch_cost.py [REPEATS [ENTRY_STEPS ...]]      (default 7 64)
"""
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))          # bench/: fine_decode, gpu_bench
from fine_decode import LAYER_8B, Resident, times  # noqa: E402
from gpu_bench import weights  # noqa: E402


def host_us(fn, n: int = 2000) -> float:
    """Median host microseconds of fn() over n calls in batches of 100 (launches queue, never waited on)."""
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(n // 100):
        t = time.perf_counter()
        for _ in range(100):
            fn()
        per.append((time.perf_counter() - t) / 100 * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def main(repeats: int, steps: list[int]) -> None:
    ours = Resident(weights({"k": LAYER_8B["k"]}, seed=1), Path(tempfile.mkdtemp(prefix="wcodec-launch-")), "k",
                    steps[0])
    x = torch.zeros(1, device="cuda")
    print(json.dumps({"device": torch.cuda.get_device_name(), "host_us_empty_add": host_us(lambda: x.add_(1))}))
    for k, entry_steps in enumerate(steps):
        if k:
            ours.reindex(entry_steps)
        job = ours.job(["k"])
        row = {"entry_steps": entry_steps, "resident_ratio": ours.ratios["resident"], "bit_exact": ours.bit_exact(job),
               "host_us_decode_run": host_us(job.run)}
        runs = [times(job.run) for _ in range(repeats)]
        for key in ("single_ms", "queued_ms"):
            v = sorted(r[key] for r in runs)
            row[key] = {"min": v[0], "median": statistics.median(v), "max": v[-1]}
        print(json.dumps(row))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7, [int(a) for a in sys.argv[2:]] or [64])
