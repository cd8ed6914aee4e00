"""What a burst of short prompts costs the paged runner on a lent GPU (the 7B-shaped model of
`bench/paged_step.py`, q/k/v and gate/up joined, the Triton step, no graph captured, so every step
is eager): N prompts of T tokens in one step (the scheduler cuts a burst into steps of
WCODEC_MAX_BATCH_TOKENS = 512), decode rows beside prompts, and the torch profiler's top kernels and
host ops of one such step (--profile: the first burst of --prompts, 18 prompts if none). It asks
where the first token goes when a closed loop's 32 clients all send their next request at once
(docs/BENCHMARKS.md, 2026-11-30 16:46). --weights compressed holds
the decoder layers' matrices in compressed mode's fixed-rate form (service/model/fixed.py), so that
a step of over 64 rows decodes each matrix and calls cuBLAS, as served; each mode's steps are timed
in turn on the same weights and printed beside decoded mode's.

--graphs then captures every graph shape (a step of short prompts as decode rows up to 512 rows, as
the server's runner does under WCODEC_MAX_BATCH_TOKENS = 512) and times the bursts again as replays.
--long N also prefills one prompt of N tokens in steps of each of --long-steps tokens (the
scheduler's WCODEC_MAX_BATCH_TOKENS): what a long prompt's first token costs at each step size.

    python bench/experiments/prompt_burst.py [--tokens 27] [--prompts 1,4,8,18,32] [--profile]
        [--weights decoded,compressed] [--long 2048 --long-steps 512,1024,2048] [--graphs]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from generation_gpu import CONFIG  # noqa: E402
from paged_step import model, timed  # noqa: E402

from cuda_ext import fixedrate, step_kernels  # noqa: E402
from service.engine.runner import Chunk, Decode, Runner  # noqa: E402
from service.model import fixed, llama, paged  # noqa: E402

BLOCK, WIDTH, ROWS = 16, 12, 64        # the cache: 64 rows of 12 blocks of 16 keys


def chunks(n: int, tokens: int, first: int = 0) -> list[Chunk]:
    """n whole prompts of `tokens` tokens, row first + i's blocks each."""
    blocks = -(-tokens // BLOCK)
    return [Chunk(list(range(100 + i, 100 + i + tokens)), 0, list(range((first + i) * WIDTH, (first + i) * WIDTH + blocks)))
            for i in range(n)]


def compress(m: llama.LlamaForCausalLM) -> None:
    """The decoder layers' matrices in the fixed-rate form, as a compressed load attaches them."""
    fixed.attach(m, {name: fixedrate.encode(p.detach().contiguous()) for name, p in m.named_parameters()
                     if ".layers." in name and p.dim() == 2})
    torch.cuda.empty_cache()


def burst(runner: Runner, prompts: list[int], t: int, dev: torch.device) -> dict[str, float]:
    """Seconds of each step: n prompts of t tokens, then 14 decode rows beside 18 prompts."""
    steps = {}
    for n in prompts:
        c = chunks(n, t)
        steps[f"prompts {n:2d} x {t} tokens ({n * t} rows)"] = timed(lambda: runner.run([], c).argmax(-1).tolist(), dev, 10)
    dec, c = [Decode(11 + i, 72, list(range(i * WIDTH, i * WIDTH + 5))) for i in range(14)], chunks(18, t, 14)
    steps["14 decode rows + 18 prompts"] = timed(lambda: runner.run(dec, c).argmax(-1).tolist(), dev, 10)
    return steps


def long_prompt(runner: Runner, tokens: int, sizes: list[int], dev: torch.device) -> dict[str, float]:
    """Seconds to prefill one prompt of `tokens` tokens in consecutive steps of each size."""
    table = list(range(-(-tokens // BLOCK)))
    ids = [100 + i % 1000 for i in range(tokens)]

    def prefill(size: int) -> None:
        for start in range(0, tokens, size):
            runner.run([], [Chunk(ids[start:start + size], start, table, whole=size >= tokens)]).argmax(-1).tolist()
    return {f"one prompt of {tokens} tokens in steps of {size}": timed(lambda: prefill(size), dev, 5) for size in sizes}


def captured(runner: Runner) -> tuple[int, int]:
    """Capture every graph shape as the idle engine does (decode steps first, then the prompt
    buckets over max_rows); the device memory each part adds to the caching allocator's reserve
    (the graphs' pool, with the first capture's cuBLAS workspace), the allocator's free cache emptied
    at each mark so that the eager steps' freed activations do not count."""
    def reserved() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    start, mark = reserved(), None
    while True:
        if mark is None and next((k for k in runner.shapes() if k not in runner.graphs), (0,))[0] > runner.max_rows:
            mark = reserved()                            # every decode step's graph is in
        if not runner.capture_next():
            break
    end = reserved()
    mark = end if mark is None else mark
    return mark - start, end - mark


def weight_bytes(m: torch.nn.Module) -> int:
    """Device bytes of the model's parameters and buffers, each storage once (joined matrices'
    parts are views of them)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*m.parameters(), *m.buffers()]
                if t.device.type == "cuda"}
    return sum(storages.values())


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=27, help="a prompt's tokens (the load script's are 25-30)")
    ap.add_argument("--prompts", default="1,4,8,18,32")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--weights", default="decoded", help="decoded, compressed or both (decoded first), comma-separated")
    ap.add_argument("--long", type=int, default=0, help="a long prompt's tokens (0: none)")
    ap.add_argument("--long-steps", default="512,1024,2048", help="its step sizes, tokens")
    ap.add_argument("--graphs", action="store_true",
                    help="then every graph shape captured (prompt steps up to 512 rows, as served) and the bursts again")
    args = ap.parse_args()
    modes = args.weights.split(",")
    if not set(modes) <= {"decoded", "compressed"} or modes != sorted(modes, key=["decoded", "compressed"].index):
        raise SystemExit(f"--weights: decoded and/or compressed, decoded first; got {args.weights!r}")
    dev = torch.device("cuda")
    prompts, t, seen = [int(n) for n in args.prompts.split(",") if n], args.tokens, {}
    for mode in modes:
        m = model(CONFIG, dev)                                       # the same seeded weights each time
        if mode == "compressed":
            compress(m)
        paged.fuse_projections(m)
        cache = paged.PagedCache(m.config, ROWS * WIDTH, BLOCK, torch.bfloat16, dev)
        runner = Runner(m, cache, max_rows=ROWS, max_blocks=WIDTH, graphs=True, fused=step_kernels.triton_kernels(dev),
                        prompt_rows=512)                             # the server's: WCODEC_MAX_BATCH_TOKENS
        steps = burst(runner, prompts, t, dev) if prompts else {}
        if args.long:
            steps |= long_prompt(runner, args.long, [int(n) for n in args.long_steps.split(",")], dev)
        if args.graphs and prompts:
            t0, pools = time.perf_counter(), captured(runner)
            print(f"{mode:10s} {len(runner.graphs)} graphs captured in {time.perf_counter() - t0:.1f} s; the graphs' "
                  f"memory (reserved, GiB): decode steps {pools[0] / 2**30:.3f}, then the prompt buckets "
                  f"{pools[1] / 2**30:.3f} more (the weights {weight_bytes(m) / 2**30:.3f}, the cache "
                  f"{cache.nbytes / 2**30:.3f})", flush=True)
            steps |= {f"{step}, graphs": s for step, s in burst(runner, prompts, t, dev).items()}
        for step, s in steps.items():
            over = f"  {s / seen[step]:.3f} of decoded's" if step in seen else ""
            eager = step.removesuffix(", graphs")
            over += f"  {s / steps[eager]:.3f} of eager's" if eager != step else ""
            print(f"{mode:10s} {step}: {s * 1e3:7.2f} ms{over}", flush=True)
            seen.setdefault(step, s)
        if mode != modes[-1]:
            del m, runner, cache
            torch.cuda.empty_cache()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        c = chunks(prompts[0] if prompts else 18, t)                 # the last mode's model, the first burst
        runner.run([], c)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            runner.run([], c).argmax(-1).tolist()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))


if __name__ == "__main__":
    main()
