"""One decode step of the paged engine (issue 23), without a server or an archive: a 7B-shaped
Llama (llama.py) with trained-like random bf16 weights made on the device, its paged cache, and
the runner's step at batch 1, 32 and 64: eager, replayed as a CUDA graph, the whole
`Runner.run` with its host work and a greedy pick, and pipelined launches (tokens/s from these);
a short prompt's step (--prompt-tokens, eager and replayed as decode rows); the step of Triton
kernels (paged.Fused) and the modules' (paged.Modules) each, beside the limit (weight bytes / the
device's measured read bandwidth) in the same run. Then the kernels of one eager batch-1 step, by GPU time, and each
step kind against llama.py's own forward (the padded engine's) on one 8-token prompt: the
first decode step's largest logit difference and the greedy tokens that agree (`--peaked`: on
the model whose logits are shaped like a trained model's, `peak`; the timings are the same).

    python bench/paged_step.py                         # a lent GPU (scripts/gpu/run.sh stage paged-step)
    python bench/paged_step.py --smoke --device cpu    # the same path, 2 small layers, no figures
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from generation_gpu import CONFIG, SMOKE, read_bandwidth  # noqa: E402
from cuda_ext import step_kernels  # noqa: E402
from service.engine.runner import Chunk, Decode, Runner  # noqa: E402
from service.model import llama, paged  # noqa: E402


def model(config: dict, device: torch.device, seed: int = 7, peaked: bool = False) -> llama.LlamaForCausalLM:
    """llama.py's model, weights N(0, 0.02) with per-row scales (norms N(1, 0.02)), bf16: its
    logits are flat (no token stands out), so bf16 rounding flips its greedy picks. `peaked`:
    the same weights, then embeddings and lm_head rebuilt (`peak`) so that each token has a
    definite next token, as a trained model's logits do."""
    torch.manual_seed(seed)
    with torch.device(device):
        m = llama.LlamaForCausalLM(llama.LlamaConfig.parse(config), device).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.02 * torch.randn_like(p, dtype=torch.float32))
            else:
                rows = 0.02 * torch.exp(0.3 * torch.randn(p.shape[0], 1, device=device))
                p.copy_(torch.randn_like(p, dtype=torch.float32) * rows)
    if peaked:
        peak(m.eval(), seed)
    return m.eval()


PEAK_LEAD = 4.0      # the median lead of a token's planted successor over the flat logits' largest
PEAK_SPREAD = 0.35   # sd of log(lead) across tokens: p5 of the leads 2.2, p95 7.1


@torch.no_grad()
def peak(m: llama.LlamaForCausalLM, seed: int, lead: float = PEAK_LEAD, spread: float = PEAK_SPREAD) -> None:
    """Trained-like logits on the flat model, its layers untouched (docs/BENCHMARKS.md):
    1. embeddings N(0, r^2), r the last residual's rms (the final norm's input; 8 random
       40-token sequences): the input token is then about half of the last residual's energy;
    2. lm_head's random rows scaled by how much that grew the last residual, which the final norm
       divides out: each layer's rounding reaches the logits as strongly as in the flat model
       (their spread grows as much: the embedding passes through these rows too);
    3. a readout: lm_head row nxt[t] += gain[t] * embed[t] / |embed[t]|, nxt a fixed permutation,
       gain[t] such that the planted logit leads the (median) largest flat logit by
       lead * exp(spread * N(0, 1)): confident tokens and a tail of unsure ones."""
    device, v = m.lm_head.weight.device, m.config.vocab_size
    g = torch.Generator(device=device).manual_seed(seed + 1)
    ids = torch.randint(v, (8, 40), generator=g, device=device)
    flat_rms = readout(m, ids)[0].pow(2).mean().sqrt()
    emb = m.model.embed_tokens.weight
    emb.copy_(torch.randn(emb.shape, generator=g, device=device) * flat_rms)
    h, x, logits = readout(m, ids)
    grown = h.pow(2).mean().sqrt() / flat_rms
    unit = torch.nn.functional.normalize(emb.float(), dim=-1)                               # [V, E]
    per_gain = (x * unit[ids.flatten()]).sum(-1).median()            # the planted logit per unit of gain
    leads = lead * torch.exp(spread * torch.randn(v, 1, generator=g, device=device))      # [V, 1]
    gains = ((logits.max(-1).values * grown).median() + leads) / per_gain
    nxt = torch.randperm(v, generator=g, device=device)
    w = m.lm_head.weight
    w.copy_((w.float() * grown).index_add_(0, nxt, gains * unit))
    m.next_token = nxt                                          # token t's planted successor: nxt[t]


def readout(m: llama.LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For each position of `ids` [B, S], float32: the last residual (the final norm's input)
    [B*S, E], lm_head's input [B*S, E] and the logits [B*S, V]."""
    seen = {}
    hooks = [m.model.norm.register_forward_pre_hook(lambda _, a: seen.__setitem__("h", a[0])),
             m.lm_head.register_forward_pre_hook(lambda _, a: seen.__setitem__("x", a[0]))]
    try:
        logits = m(input_ids=ids, use_cache=False).logits.flatten(0, 1).float()
    finally:
        for hook in hooks:
            hook.remove()
    return seen["h"].float(), seen["x"].float(), logits


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of `fn` (CUDA-synchronized)."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def step_times(runner: Runner, rows: int, position: int, repeat: int) -> dict:
    blocks_per_row = -(-(position + 1) // runner.block_size)
    decodes = [Decode(11 + i, position, list(range(i * blocks_per_row, (i + 1) * blocks_per_row)))
               for i in range(rows)]
    ids, ctx = runner._eager_inputs(decodes, [])
    eager = timed(lambda: paged.forward(runner.model, ids, ctx, runner.cache, runner.fused), runner.device, repeat)
    out = {"eager_ms": eager * 1e3}
    if runner.use_graphs:
        runner.run(decodes, [])                                  # captures this shape
        g = next(iter(v for k, v in runner.graphs.items() if k[0] >= rows))
        out["replay_ms"] = timed(g.graph.replay, runner.device, repeat) * 1e3
        out["run_ms"] = timed(lambda: runner.run(decodes, []).argmax(-1).tolist(), runner.device, repeat) * 1e3
        out["pipelined_ms"] = pipelined(runner, decodes, repeat) * 1e3
    best = min(v for v in out.values())
    out["tokens_per_s"] = rows / (out.get("pipelined_ms", best) / 1e3)
    return out


@torch.inference_mode()
def prompt_times(runner: Runner, tokens: int, repeat: int) -> dict:
    """A short prompt's step and its greedy pick, the host's work included (a first token's model
    part): eager, and replaying the graph its tokens take as decode rows (runner.run)."""
    chunk = Chunk(list(range(100, 100 + tokens)), 0, list(range(-(-tokens // runner.block_size))))
    step = lambda: runner.run([], [chunk]).argmax(-1).tolist()
    graphs, runner.use_graphs = runner.use_graphs, False
    out = {"tokens": tokens, "eager_ms": timed(step, runner.device, repeat) * 1e3}
    runner.use_graphs = graphs
    if graphs and runner._prompts_as_rows([chunk]):
        shape = runner._shape(runner._prompt_rows([chunk]))
        if shape not in runner.graphs:
            runner._capture(*shape)
        out["replay_ms"] = timed(step, runner.device, repeat) * 1e3
    return out


def pipelined(runner: Runner, decodes: list[Decode], steps: int) -> float:
    """Seconds a step when each launch is queued before the last one's picks are read (scheduler.py)."""
    prev = runner.launch(decodes, None)
    t0 = time.perf_counter()
    for _ in range(steps):
        launched = runner.launch(decodes, list(range(len(decodes))))
        runner.picks(prev)
        prev = launched
    runner.picks(prev)
    return (time.perf_counter() - t0) / steps


@torch.inference_mode()
def against_llama(runner: Runner, prompt: list[int], tokens: int) -> dict:
    """The runner's step (its kernels, graphs, pipelining off) against llama.py's own forward with
    its KV cache (what the padded engine runs) on one prompt: the largest difference of the first
    decode step's logits (and the prefill's), how many greedy tokens agree before they part, and a
    control: how far llama.py's own logits move when the same step is computed another way."""
    from service.model.kvcache import KVCache
    m, bs = runner.model, runner.block_size
    table = list(range(-(-(len(prompt) + tokens) // bs)))
    ids, cache, theirs, logits = torch.tensor([prompt], device=runner.device), KVCache(), [], []
    for _ in range(tokens):
        out = m(input_ids=ids, past_key_values=cache).logits[0, -1].float()
        logits.append(out)
        theirs.append(int(out.argmax()))
        ids = torch.tensor([[theirs[-1]]], device=runner.device)
    first = runner.run([], [Chunk(prompt, 0, table)])[0]
    ours, step_logits = [int(first.argmax())], None
    for i in range(1, tokens):
        out = runner.run([Decode(ours[-1], len(prompt) + i - 1, table)], [])[0]
        step_logits = out.clone() if step_logits is None else step_logits   # a graph's output is overwritten by its next replay
        ours.append(int(out.argmax()))
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), tokens)
    # the control: llama.py against itself, the first decode step's logits recomputed without the
    # cache (the whole sequence at once: other matmul shapes, other summation orders)
    whole = m(input_ids=torch.tensor([prompt + theirs[:1]], device=runner.device)).logits[0, -1].float()
    return {"prefill_max_abs_diff": float((first - logits[0]).abs().max()),
            "first_decode_max_abs_diff": float((step_logits - logits[1]).abs().max()),
            "llama_cache_vs_whole_max_abs_diff": float((whole - logits[1]).abs().max()),
            "largest_logit": float(logits[1].abs().max()), "greedy_tokens_agree": agree, "of": tokens}


def kernels(runner: Runner, position: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    decodes = [Decode(11, position, list(range(-(-(position + 1) // runner.block_size))))]
    with torch.inference_mode():
        ids, ctx = runner._eager_inputs(decodes, [])
        paged.forward(runner.model, ids, ctx, runner.cache, runner.fused)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            paged.forward(runner.model, ids, ctx, runner.cache, runner.fused)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 32, 64])
    ap.add_argument("--position", type=int, default=72, help="keys each row has (8 prompt + 64 new)")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=8, help="the prompt whose step is timed (the load's prompts)")
    ap.add_argument("--agree-tokens", type=int, default=16, help="greedy tokens compared with llama.py's forward")
    ap.add_argument("--peaked", action="store_true", help="logits shaped like a trained model's (`peak`)")
    ap.add_argument("--smoke", action="store_true", help="2 small layers: checks the path, no figures")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.agree_tokens < 2:
        ap.error("--agree-tokens: at least 2 (the first decode step's logits are compared)")
    device = torch.device(args.device)
    config = {**CONFIG, **SMOKE} if args.smoke else CONFIG
    m = model(config, device, peaked=args.peaked)
    weight_bytes = sum(p.nbytes for p in m.parameters())
    block_size, rows = 16, max(args.rows)
    width = -(-(args.position + 1) // block_size)
    cache = paged.PagedCache(m.config, rows * width, block_size, torch.bfloat16, device)
    limit = read_bandwidth(args.device) / weight_bytes
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d %H:%M"), "weight_bytes": weight_bytes,
              "limit_tokens_per_s": limit, "model": "peaked" if args.peaked else "flat"}
    fused = step_kernels.triton_kernels(device)
    for kind in (["triton"] if fused else []) + ["modules"]:
        if kind == "triton":                     # as the engine does (paging.py); the modules' weights become views
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            paged.fuse_projections(m)
            result["joined_extra_bytes"] = (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0) - before
        runner = Runner(m, cache, max_rows=rows, max_blocks=width, graphs=True, fused=fused if kind == "triton" else None)
        for r in args.rows:
            out = result[f"{kind}-{r}"] = step_times(runner, r, args.position, args.repeat)
            out["of_limit"] = out["tokens_per_s"] / (limit * r)
            print(kind, r, json.dumps(out), flush=True)
        out = result[f"{kind}-prompt"] = prompt_times(runner, args.prompt_tokens, args.repeat)
        print(kind, "prompt", json.dumps(out), flush=True)
        result[f"{kind}-capture_s"] = runner.capture_seconds
        result[f"{kind}-against_llama"] = against_llama(runner, list(range(100, 108)), args.agree_tokens)
        print(kind, "against llama.py's forward:", json.dumps(result[f"{kind}-against_llama"]), flush=True)
        runner.use_graphs = False                # the same, each step eager
        result[f"{kind}-eager-against_llama"] = against_llama(runner, list(range(100, 108)), args.agree_tokens)
        print(kind, "eager, against llama.py's forward:", json.dumps(result[f"{kind}-eager-against_llama"]), flush=True)
        runner.use_graphs = True
        if device.type == "cuda":
            print(kernels(runner, args.position, 24))
    print(json.dumps({k: v for k, v in result.items() if "-" not in k or k.endswith(("capture_s", "llama"))}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
