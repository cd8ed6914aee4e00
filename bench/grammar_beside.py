"""What a pathological grammar's compile does to the requests served beside it: `wcodec serve` on
the demo (this CPU), the latency of --requests greedy /generate requests one after another (16
new tokens), first alone, then while a request whose regex compiles for the server's whole limit
(`a{1000000}`, WCODEC_GRAMMAR_COMPILE_S) waits for its index; each --checkout's server in turn
(a checkout of an earlier commit is the before), in one run.

    git worktree add /tmp/base <commit>; python bench/grammar_beside.py --checkout . /tmp/base
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation_gpu as gen  # noqa: E402

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def latencies(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 16}},
                   timeout=600).raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def served(args, root: Path) -> dict:
    out = args.out / root.resolve().name
    out.mkdir(parents=True, exist_ok=True)
    proc, url = gen.serve(args.store, out, "cpu", {"WCODEC_GRAMMAR_COMPILE_S": str(args.limit)}, root)
    try:
        latencies(url, 2)                                                   # warm
        alone = latencies(url, args.requests)
        refused: list = []
        slow = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4,
                                                 "grammar": {"type": "regex", "value": "a{1000000}"}}}
        t = threading.Thread(target=lambda: refused.append(httpx.post(f"{url}/generate", json=slow,
                                                                       timeout=args.limit + 120).status_code))
        t.start()
        time.sleep(1.0)                                                     # its child is compiling
        beside = latencies(url, args.requests)
        compiling = t.is_alive()
        t.join()
    finally:
        proc.terminate()
        proc.wait(60)
    return {"alone_p50": statistics.median(alone), "beside_p50": statistics.median(beside),
            "beside_max": max(beside), "beside_over_alone": statistics.median(beside) / statistics.median(alone),
            "still_compiling_after": compiling, "grammar_status": refused, "alone": alone, "beside": beside}


def main() -> None:
    ap = gen.model_args(__doc__)
    ap.add_argument("--checkout", type=Path, nargs="+", default=[Path(".")])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--limit", type=float, default=60.0, help="WCODEC_GRAMMAR_COMPILE_S")
    args = ap.parse_args()
    args.demo, args.smoke, args.fp8 = True, False, False
    args.out.mkdir(parents=True, exist_ok=True)
    gen.prepare(args)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M"), **{str(c): served(args, c) for c in args.checkout}}
    (args.out / "grammar_beside.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: {f: v for f, v in r.items() if f not in ("alone", "beside")} if isinstance(r, dict) else r
                      for k, r in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
