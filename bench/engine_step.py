"""One engine step at ~32 rows without HTTP (issue 13): the load test's closed loop simulated on a
`Batcher` -- 32 clients, each request 48 greedy tokens of one of the load test's prompts, arrivals
staggered as closed-loop clients settle -- then timed (or profiled) step by step.

    python bench/engine_step.py --archive STORE/smollm2-135m-instruct.wcodec --steps 40
    python bench/engine_step.py --archive ... --steps 20 --profile      # torch.profiler table

Prints the mean step, rows and tokens a step, and generated tokens/s. Run it with the server's
`OMP_WAIT_POLICY=PASSIVE` to time what `wcodec serve` runs."""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.load import pipeline
from service.model import build  # noqa: E402
from service.engine import Batcher
from service.model import cpu_dtype  # noqa: E402
from service.engine.kv import PaddedKV  # noqa: E402
from service.engine.sampling import Row, SamplingParams  # noqa: E402

TOPICS = ["the sea", "volcanoes", "a lighthouse keeper", "bread baking", "the moon", "honeybees"]
TASKS = ["Write a short story about {}.", "Describe {} in detail.", "Explain to a child how {} works."]


def prompts():
    """The load test's kind of prompt (loadtests/locustfile.py), a different one every call."""
    for n in itertools.count():
        q = TASKS[n % len(TASKS)].format(TOPICS[(n // len(TASKS)) % len(TOPICS)]) + f" (request {n})"
        yield f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def load(archive: Path) -> build.ServedModel:
    """The demo model as the server computes it on this CPU (`auto`)."""
    decoded = pipeline.decode_archive(archive, torch.device("cpu"))
    served = build.finish("demo", build.prepare("demo", decoded.files), decoded.tensors, decoded.layers, torch.device("cpu"))
    return cpu_dtype.for_cpu(served, "auto")


def closed_loop(served: build.ServedModel, users: int, cache: type | None = None) -> Batcher:
    """A batcher of `served` in the steady state of `users` closed-loop clients (`cache`: another
    KV cache class than the model's own)."""
    texts, params = prompts(), SamplingParams(max_new_tokens=48)

    def new_row() -> Row:
        return Row(served.tokenizer.encode(next(texts)), params, served)

    b = Batcher(served, max_rows=64, max_tokens=512, on_token=lambda row, event: None,
                on_finish=lambda row: b.add(new_row()))
    if cache is not None:
        b.cache, b.kv = cache, PaddedKV(served.device, cache)
    for _ in range(users):                  # staggered arrivals, then a full generation's worth of steps
        b.add(new_row())
        b.step()
        b.step()
    for _ in range(60):
        b.step()
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archive", type=Path, required=True)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    b = closed_loop(load(args.archive), args.users)
    seconds, rows, tokens = 0.0, 0, 0
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    if profiler:
        profiler.start()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step = b.step()
        seconds, rows, tokens = seconds + time.perf_counter() - t0, rows + step.rows, tokens + step.tokens
    if profiler:
        profiler.stop()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    n = args.steps
    print(f"{n} steps: {seconds / n * 1e3:.1f} ms a step, {rows / n:.1f} rows, {tokens / n:.1f} tokens, "
          f"{rows / seconds:.1f} generated tokens/s")


if __name__ == "__main__":
    main()
