"""What the prefix cache (WCODEC_PREFIX_CACHING) is worth, in one run: one server with it on and
one with it off, the same model and load, loadtests' `shared` scenario (greedy streams back to
back, every prompt a 671-token system prompt that all requests share, then its own question), at
1 client and at each of --users. Each server first takes one such request (so both start with the
same warm-up, and the cache-on server with the system prompt cached) and, on CUDA, captures its
graphs. Reported: time to first token p50 / p99, request latency p50, tokens/s, the server's hit
rate (cached prompt tokens over prompt tokens), and on ÷ off of each.

    python bench/prefix_cache_gpu.py --tokenizer .gentok --out $OUT            (GPU: the 7B-shaped model)
    python bench/prefix_cache_gpu.py --demo --device cpu --users 4 --duration 20 --tokens 16   (this CPU)

The model and store are bench/generation_gpu.py's (Llama-2-7B's shape, trained-like random bf16).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation_gpu as gen  # noqa: E402

from loadtests.prompts import shared_prompt  # noqa: E402


def parse() -> argparse.Namespace:
    ap = gen.model_args(__doc__)
    ap.add_argument("--users", type=int, nargs="*", default=[16])
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--weights", default="decoded", choices=list(gen.MODES))
    args = ap.parse_args()
    args.smoke = args.fp8 = False
    return args


def served(args: argparse.Namespace, device: str, caching: str) -> dict:
    out = args.out / f"prefix-caching-{caching}"
    out.mkdir(parents=True, exist_ok=True)
    proc, url = gen.serve(args.store, out, device, {"WCODEC_PREFIX_CACHING": caching, **gen.MODES[args.weights]})
    try:
        httpx.post(f"{url}/generate", json={"inputs": shared_prompt(), "parameters": {"max_new_tokens": 8}},
                   timeout=600).raise_for_status()
        graphs = gen.wait_for_graphs(url) if device == "cuda" else {}
        before = [gen.metric(url, f"wcodec_generate_prompt{k}_tokens_total") for k in ("", "_cached")]
        runs = {str(u): gen.bench(url, u, args.duration, args.tokens, out, "shared") for u in [1, *args.users]}
        after = [gen.metric(url, f"wcodec_generate_prompt{k}_tokens_total") for k in ("", "_cached")]
    finally:
        proc.terminate()
        proc.wait(60)
    return {"hit_rate": (after[1] - before[1]) / max(after[0] - before[0], 1), **graphs,
            **{u: {"ttft_p50": r["ttft_s"]["p50"], "ttft_p99": r["ttft_s"]["p99"],
                   "ttft_mean": r["server"]["mean_ttft_s"], "latency_p50": r["latency_s"]["p50"],
                   "tokens_per_s": r["tokens_per_s"], "errors": r["errors"]}
               for u, r in runs.items()}}


def main() -> None:
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    device, _ = gen.prepare(args)
    on, off = served(args, device, "1"), served(args, device, "0")
    users = [str(u) for u in [1, *args.users]]
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "date": time.strftime("%Y-%m-%d %H:%M"), "weights": args.weights, "tokens": args.tokens,
               "on": on, "off": off,
               "on_over_off": {u: {k: on[u][k] / off[u][k] for k in ("ttft_p50", "ttft_p99", "ttft_mean",
                                                                      "latency_p50", "tokens_per_s")} for u in users}}
    (args.out / "prefix_cache.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
