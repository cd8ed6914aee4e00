"""Where the paged engine's 7B logits part from llama.py's (issue 23's exactness item), and how
far bf16 rounding alone moves them, on bench/paged_step.py's 7B-shaped model with trained-like
random weights, each way it is built (`paged_step.model`):

    peaked      logits shaped like a trained model's: each token has a definite successor that
                leads the other logits by a few units (`paged_step.peak`; the layers untouched)
    flat        the weights alone: no token stands out, top-2 margins of a bf16 place or two

One 8-token prompt, 32 greedy tokens (agreeing "of 16" is min(agree, 16)). Against:

    reference   llama.py's forward with its KV cache (the padded engine), bf16
    control     llama.py computed another way, nothing else changed: `flag`, cuBLAS's
                reduced-precision bf16 reductions switched over; `no cache`, each step the
                whole sequence at once (other matmul shapes, other summation orders)
    modules     the paged step, the modules called, projections not joined, eager
    joined      the same with q/k/v and gate/up joined (paging.py does this on CUDA)
    triton      the joined step of Triton kernels, replayed as CUDA graphs (what is served)
    float32     llama.py on the weights widened to float32 (the exact maths, nearly): each
                variant's prefill logits' distance from it

For each: the prefill's and the first decode step's largest |difference| from the reference, the
greedy tokens that agree, and the reference's top-2 margin at the step where they part; for
each model, its top-1/top-2 margins (random sequences at the greedy steps' positions, and the
reference's greedy steps).

    python bench/experiments/seven_b_numerics.py                    # a lent GPU (~13.5 GB, then 27 GB)
    python bench/experiments/seven_b_numerics.py --smoke --device cpu
"""
from __future__ import annotations

import argparse
import gc
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
QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9)


def reference(m, tokens: int, device, cached: bool = True) -> tuple[list[int], list[torch.Tensor]]:
    """llama.py's greedy tokens and each step's logits (float32): with its KV cache, or
    (`cached` False) each step's whole sequence at once."""
    seq, cache, out, logits = list(PROMPT), KVCache(), [], []
    ids = torch.tensor([seq], device=device)
    for _ in range(tokens):
        step = m(input_ids=ids, past_key_values=cache if cached else None, use_cache=cached)
        logits.append(step.logits[0, -1].float().clone())
        out.append(int(logits[-1].argmax()))
        seq.append(out[-1])
        ids = torch.tensor([seq[-1:] if cached else seq], device=device)
    return out, logits


def paged_run(runner: Runner, tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    table = list(range(-(-(len(PROMPT) + tokens) // runner.block_size)))
    first = runner.run([], [Chunk(PROMPT, 0, table)])[0]
    out, logits = [int(first.argmax())], [first.clone()]
    for i in range(1, tokens):
        step = runner.run([Decode(out[-1], len(PROMPT) + i - 1, table)], [])[0]
        logits.append(step.clone())                      # a graph's output is overwritten by its next replay
        out.append(int(step.argmax()))
    return out, logits


def margin(logits: torch.Tensor) -> float:
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1])


def compare(kind: str, name: str, run: tuple, ref: tuple) -> dict:
    (toks, logits), (ref_toks, ref_logits) = run, ref
    agree = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
    row = {"model": kind, "variant": name,
           "prefill_max_abs_diff": float((logits[0] - ref_logits[0]).abs().max()),
           "first_decode_max_abs_diff": float((logits[1] - ref_logits[1]).abs().max()),
           "greedy_tokens_agree": agree, "of": len(toks),
           "reference_top2_margin_where_they_part": margin(ref_logits[agree]) if agree < len(toks) else None}
    print(json.dumps(row), flush=True)
    return row


def margins(kind: str, m, ref_logits: list[torch.Tensor], device) -> dict:
    """Top-1 minus top-2 logit: quantiles over 32 random sequences at positions 8..39 (where the
    greedy tokens are; one pass, no cache), the share within two bf16 places at 8..16 (0.125),
    and each of the reference's greedy steps."""
    g = torch.Generator(device=device).manual_seed(5)
    ids = torch.randint(m.config.vocab_size, (32, 40), generator=g, device=device)
    logits = m(input_ids=ids, use_cache=False).logits[:, len(PROMPT):].flatten(0, 1).float()   # [32*32, V]
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).cpu()
    row = {"model": kind, "margin_quantiles": dict(zip(QUANTILES, gaps.quantile(torch.tensor(QUANTILES)).tolist())),
           "share_within_0.125": float((gaps < 0.125).float().mean()),
           "logit_std": float(logits.std(-1).mean()), "largest_logit_median": float(top2[:, 0].median()),
           "greedy_step_margins": [round(margin(x), 3) for x in ref_logits]}
    if hasattr(m, "next_token"):
        planted = m.next_token[ids[:, len(PROMPT):].flatten()]
        row["share_top1_is_planted"] = float((logits.argmax(-1) == planted).float().mean())
    print(json.dumps(row), flush=True)
    return row


def controls(kind: str, m, ref: tuple, tokens: int, device) -> tuple[dict, dict]:
    """llama.py against itself (the flag switched over; no cache): its rows and prefill logits."""
    flag = torch.backends.cuda.matmul
    flag.allow_bf16_reduced_precision_reduction = not flag.allow_bf16_reduced_precision_reduction
    try:
        runs = {"control: flag": reference(m, tokens, device)}
    finally:
        flag.allow_bf16_reduced_precision_reduction = not flag.allow_bf16_reduced_precision_reduction
    runs["control: no cache"] = reference(m, tokens, device, cached=False)
    return ({name: compare(kind, name, run, ref) for name, run in runs.items()},
            {name: run[1][0] for name, run in runs.items()})


def engine(kind: str, m, ref: tuple, tokens: int, device) -> tuple[dict, dict]:
    """The paged step each way (modules, joined, triton): its rows and prefill logits."""
    cache = paged.PagedCache(m.config, 8, 16, torch.bfloat16, device)
    fused = step_kernels.triton_kernels(device)
    rows, prefills = {}, {}
    for name, join, kernels, graphs in [("modules", False, None, False), ("joined", True, None, False),
                                        ("triton", True, fused, True)]:
        if name == "triton" and fused is None:
            continue
        if join:
            paged.fuse_projections(m)
        runner = Runner(m, cache, max_rows=1, max_blocks=8, graphs=graphs, fused=kernels)
        run = paged_run(runner, tokens)
        rows[name], prefills[name] = compare(kind, name, run, ref), run[1][0]
    return rows, prefills


def measure(kind: str, config: dict, tokens: int, device) -> list[dict]:
    """One model: its margins, the controls and the engine against the reference, then each
    prefill's distance from float32 (the model is widened: ~27 GB for the 7B shape)."""
    m = model(config, device, peaked=kind == "peaked")
    with torch.inference_mode():
        ref = reference(m, tokens, device)
        stats = margins(kind, m, ref[1], device)
        rows, prefills = controls(kind, m, ref, tokens, device)
        engine_rows, engine_prefills = engine(kind, m, ref, tokens, device)
        rows, prefills = rows | engine_rows, prefills | engine_prefills | {"reference": ref[1][0]}
        rows["reference"] = {"model": kind, "variant": "reference"}
        m.float()
        exact = m(input_ids=torch.tensor([PROMPT], device=device)).logits[0, -1].float()
    for name, row in rows.items():
        row["prefill_distance_from_float32"] = float((prefills[name] - exact).abs().max())
    return [stats, *rows.values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--models", nargs="+", choices=("peaked", "flat"), default=["peaked", "flat"])
    ap.add_argument("--smoke", action="store_true", help="2 small layers: checks the path, no figures")
    ap.add_argument("--json")
    args = ap.parse_args()
    device, config = torch.device(args.device), ({**CONFIG, **SMOKE} if args.smoke else CONFIG)
    rows = []
    for kind in args.models:
        rows += measure(kind, config, args.tokens, device)
        gc.collect()                                     # the model, its runners and graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
