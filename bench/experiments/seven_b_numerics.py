"""Where the paged engine's 7B logits part from llama.py's (issue 23's exactness item), and how
far bf16 rounding alone moves them: on bench/paged_step.py's 7B-shaped model with trained-like
random weights, one 8-token prompt, 16 greedy tokens.

    reference   llama.py's forward with its KV cache (the padded engine), bf16
    control     the same forward with cuBLAS's reduced-precision bf16 reductions switched over
                (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction): another
                legitimate rounding of the same maths, nothing else changed
    modules     the paged step, the modules called, projections not joined, eager
    joined      the same with q/k/v and gate/up joined (paging.py does this on CUDA)
    triton      the joined step of Triton kernels, replayed as CUDA graphs (what is served)
    float32     llama.py on the weights widened to float32 (the exact maths, nearly): each
                variant's prefill logits' distance from it

For each: the prefill's and the first decode step's largest |difference| from the reference, the
greedy tokens that agree, and the reference's top-2 margin at the step where they part.

    python bench/experiments/seven_b_numerics.py                    # a lent GPU
    python bench/experiments/seven_b_numerics.py --smoke --device cpu
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from paged_step import CONFIG, SMOKE, model  # noqa: E402
from cuda_ext import step_kernels  # noqa: E402
from service.engine.runner import Chunk, Decode, Runner  # noqa: E402
from service.model import paged  # noqa: E402
from service.model.kvcache import KVCache  # noqa: E402

PROMPT = list(range(100, 108))


def reference(m, tokens: int, device) -> tuple[list[int], list[torch.Tensor]]:
    """llama.py's greedy tokens and each step's logits (float32), with its KV cache."""
    ids, cache, out, logits = torch.tensor([PROMPT], device=device), KVCache(), [], []
    for _ in range(tokens):
        step = m(input_ids=ids, past_key_values=cache).logits[0, -1].float()
        logits.append(step.clone())
        out.append(int(step.argmax()))
        ids = torch.tensor([[out[-1]]], device=device)
    return out, logits


def paged_run(runner: Runner, tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    table = list(range(-(-(len(PROMPT) + tokens) // runner.block_size)))
    first = runner.run([], [Chunk(PROMPT, 0, table)])[0]
    out, logits = [int(first.argmax())], [first.clone()]
    for i in range(1, tokens):
        step = runner.run([Decode(out[-1], len(PROMPT) + i - 1, table)], [])[0]
        logits.append(step.clone())
        out.append(int(step.argmax()))
    return out, logits


def compare(name: str, run: tuple, ref: tuple) -> dict:
    (toks, logits), (ref_toks, ref_logits) = run, ref
    agree = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
    top2 = ref_logits[min(agree, len(toks) - 1)].topk(2).values
    row = {"variant": name, "prefill_max_abs_diff": float((logits[0] - ref_logits[0]).abs().max()),
           "first_decode_max_abs_diff": float((logits[1] - ref_logits[1]).abs().max()),
           "greedy_tokens_agree": agree, "of": len(toks),
           "reference_top2_margin_where_they_part": float(top2[0] - top2[1])}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    m = model({**CONFIG, **SMOKE} if args.smoke else CONFIG, device)
    cache = paged.PagedCache(m.config, 8, 16, torch.bfloat16, device)
    rows, prefills = [], {}
    with torch.inference_mode():
        ref = reference(m, args.tokens, device)
        flag = torch.backends.cuda.matmul
        flag.allow_bf16_reduced_precision_reduction = not flag.allow_bf16_reduced_precision_reduction
        control = reference(m, args.tokens, device)
        rows.append(compare("control", control, ref))
        prefills["control"] = control[1][0]
        flag.allow_bf16_reduced_precision_reduction = not flag.allow_bf16_reduced_precision_reduction
        fused = step_kernels.triton_kernels(device)
        for name, join, kernels, graphs in [("modules", False, None, False), ("joined", True, None, False),
                                            ("triton", True, fused, True)]:
            if kernels is None and name == "triton":
                continue
            if join:
                paged.fuse_projections(m)
            runner = Runner(m, cache, max_rows=1, max_blocks=8, graphs=graphs, fused=kernels)
            run = paged_run(runner, args.tokens)
            rows.append(compare(name, run, ref))
            prefills[name] = run[1][0]
        prefills["reference"] = ref[1][0]
        del runner
        m.float()                                   # the weights widened: ~27 GB for the 7B shape
        exact = m(input_ids=torch.tensor([PROMPT], device=device)).logits[0, -1].float()
    rows.append({"variant": "reference"})
    for row in rows:
        row["prefill_distance_from_float32"] = float((prefills[row["variant"]] - exact).abs().max())
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
