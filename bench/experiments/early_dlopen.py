"""What dlopening torch's libraries on a thread ahead of `import torch` gains (WCODEC_EARLY_DLOPEN=torch):
`wcodec serve`'s pre-torch phase (the settings, the early-read module) and then `import torch`, in a
fresh process each, alternating without and with the thread. On the 2-core CPU (2026-11-26): nothing
(docs/BENCHMARKS.md).

    python bench/experiments/early_dlopen.py --runs 12"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(preload: bool) -> None:
    t0 = time.perf_counter()
    if preload:
        from codec import preload as pre
        from wcodec import early
        pre.start(early.torch_libraries({"WCODEC_EARLY_DLOPEN": "torch"}))
    import service.settings  # noqa: F401
    from service.load import early_read  # noqa: F401
    t1 = time.perf_counter()
    import torch  # noqa: F401
    t2 = time.perf_counter()
    print(f"{t1 - t0} {t2 - t1} {t2 - t0}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--child", choices=["0", "1"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child == "1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows: dict[str, list[list[float]]] = {"0": [], "1": []}
    for _ in range(args.runs):
        for side, runs in rows.items():
            out = subprocess.run([sys.executable, __file__, "--child", side], env=env, capture_output=True, text=True,
                                 check=True)
            runs.append([float(x) for x in out.stdout.split()])
    for side, runs in rows.items():
        pre, imp, total = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{'with' if side == '1' else 'without'} the thread: before torch {pre:.3f} s, "
              f"import torch {imp:.3f} s, total {total:.3f} s")


if __name__ == "__main__":
    main()
