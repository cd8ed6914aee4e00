"""The decode step's paged attention (cuda_ext/step_triton.py) beside its limit: one query a row
against a 7B-shaped layer's paged KV cache (32 heads of 128, blocks of 16 keys scattered through
the cache), timed as a CUDA graph of one launch set per layer, at each batch × context length.
The limit is the K and V bytes the rows read ÷ the device's measured read bandwidth, so `of_limit`
is the fraction of the hardware the kernel reaches; short contexts are bound by latency, not
bytes (a handful of microseconds a launch).

    python bench/decode_attention.py                      # a lent GPU
    python bench/decode_attention.py --rows 1 --keys 72 2048 --json out.json
    python bench/decode_attention.py --kv-heads 8 [--per-head]   # GQA (Llama-3-8B's 4 query heads a KV
                                                                 # head): grouped kernel, or per head
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from fixedrate_gpu import graph_ms  # noqa: E402  (the benches' graph timing: fn captured, replayed)
from generation_gpu import read_bandwidth  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("decode_attention.py: needs a CUDA GPU (the kernels are Triton's)")
from cuda_ext import step_triton  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 128, 16


def case(rows: int, keys: int, seed: int = 0, kv_heads: int = KV_HEADS) -> tuple[torch.Tensor, ...]:
    """q, the caches (every row's blocks, shuffled) and the tables of `rows` rows of `keys` keys."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-keys // BLOCK)
    blocks = rows * width
    cache = lambda: torch.randn(blocks * BLOCK, kv_heads, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", generator=g).view(rows, width)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
    return q, cache(), cache(), tables, torch.full((rows,), keys, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 32, 64])
    ap.add_argument("--keys", type=int, nargs="*", default=[72, 512, 2048, 8192])
    ap.add_argument("--layers", type=int, default=32, help="launches a graph (each its own cache)")
    ap.add_argument("--chunk", type=int, help="keys a program (step_triton.ATTENTION_CHUNK), to compare cuts")
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS, help="KV heads of the 32 query heads (8: Llama-3-8B's GQA)")
    ap.add_argument("--per-head", action="store_true", help="GQA through the per-head kernel, as MHA (to compare)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.chunk:
        step_triton.ATTENTION_CHUNK = args.chunk
    step_triton.ATTENTION_GROUPED = not args.per_head
    bandwidth = read_bandwidth("cuda")
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "read_GBps": bandwidth / 1e9, "chunk": step_triton.ATTENTION_CHUNK,
              "kv_heads": args.kv_heads, "grouped": step_triton.ATTENTION_GROUPED, "runs": []}
    print(f"{result['device']}, read {bandwidth / 1e9:.0f} GB/s, chunk {result['chunk']}")
    print(f"{'rows':>5} {'keys':>6} {'us/launch':>10} {'limit us':>9} {'of limit':>9}")
    for rows in args.rows:
        for keys in args.keys:
            layers = max(1, min(args.layers, (8 << 30) // (rows * keys * args.kv_heads * HEAD_DIM * 4)))   # <= 8 GB
            cases = [case(rows, keys, seed, args.kv_heads) for seed in range(layers)]
            scale = HEAD_DIM ** -0.5
            ms = graph_ms(lambda: [step_triton.decode_attention(q, k, v, t, n, BLOCK, scale) for q, k, v, t, n in cases],
                          20) / layers
            limit = rows * keys * args.kv_heads * HEAD_DIM * 2 * 2 / bandwidth * 1e3
            run = {"rows": rows, "keys": keys, "us": ms * 1e3, "limit_us": limit * 1e3, "of_limit": limit / ms}
            result["runs"].append(run)
            print(f"{rows:>5} {keys:>6} {ms * 1e3:>10.2f} {limit * 1e3:>9.2f} {limit / ms:>9.3f}", flush=True)
            del cases
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
