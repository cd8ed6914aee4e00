"""Compressed-resident mode on a GPU, a 7B-shaped model, decoded vs compressed in one run:
weight memory, exactness, decode tokens/s at batch 1 and 32, each mode's load time beside
`safetensors.load_file(device="cuda")` of the same weights, and the memory-budget case through
the server (decoded load 507, compressed load 200 and generates).

    python bench/resident_gpu.py --tokenizer DIR [--steps 64] [--json OUT]

DIR: the demo model's tokenizer files (scripts/gpu/demo_tokenizer.py). The model is Llama-2-7B-shaped
with trained-like random bf16 weights (bench/service_gpu.py's).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
from service_gpu import LLAMA7B, Server, safetensors_cuda_s, seven_b_state

from codec.encode import compress_state_dict
from service.load import pipeline
from service.model import build
from service.model.kvcache import KVCache

FORM = os.environ.get("WCODEC_COMPRESSED_FORM", "fixed")     # compressed mode's form, as the server's default


def make_store(tokenizer_dir: Path, store: Path) -> Path:
    tokenizer = {p.name: p.read_bytes() for p in tokenizer_dir.iterdir() if p.is_file()}
    store.mkdir(parents=True, exist_ok=True)
    path = store / "llama7b.wcodec"
    compress_state_dict(seven_b_state(), path, workers=16,
                        files={"config.json": json.dumps(LLAMA7B).encode(), **tokenizer})
    return path


def load(path: Path, compressed: bool) -> tuple[build.ServedModel, int, float]:
    """The server's load of the archive (pipeline + build, no HTTP): the model, its device bytes and
    the seconds it took (page cache warm)."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    decoded = pipeline.decode_archive(path, torch.device("cuda"), compressed=compressed, form=FORM)
    served = build.finish("llama7b", build.prepare("llama7b", decoded.files), decoded.tensors, decoded.layers,
                          torch.device("cuda"), blocks=decoded.blocks, fixed_form=decoded.fixed)
    del decoded
    gc.collect()
    torch.cuda.synchronize()
    return served, torch.cuda.memory_allocated() - base, time.perf_counter() - t


def safetensors_load_s(folder: Path) -> float:
    """`safetensors.torch.load_file(device="cuda")` of the same weights, just written (page cache warm)."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    save_file(seven_b_state(), str(folder / "model.safetensors"))
    gc.collect()
    seconds = safetensors_cuda_s(folder / "model.safetensors")[0]
    (folder / "model.safetensors").unlink()
    return seconds


def greedy(served: build.ServedModel, batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Greedy decoding of `steps` tokens from a fixed 32-token prompt per row: tokens, the first
    steps' logits, and decode tokens/s (prefill excluded)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, 32000, (batch, 32), generator=g, device="cuda")
    cache, tokens, logits = KVCache(), [], []
    with torch.inference_mode():
        out = served.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for step in range(steps):
            out = served.model(input_ids=nxt, past_key_values=cache, use_cache=True)
            if step < 4:
                logits.append(out.logits[:, -1].float())
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    return torch.cat(tokens, 1), torch.stack(logits, 1), batch * steps / seconds


def budget_case(store: Path, raw: int) -> dict:
    """The server with a budget under the bf16 weights: decoded refused (507), compressed serves."""
    server = Server(store, budget=int(0.8 * raw))
    try:
        decoded = server.client.post("/models/llama7b/load", params={"weights": "decoded"})
        compressed = server.client.post("/models/llama7b/load", params={"weights": "compressed"})
        gen = server.client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}})
        return {"budget": int(0.8 * raw), "decoded_status": decoded.status_code,
                "compressed_status": compressed.status_code, "compressed_info": compressed.json(),
                "generate_status": gen.status_code}
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = make_store(args.tokenizer, Path("/tmp/store_resident"))
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M")}
    runs = {}
    for mode in ("decoded", "compressed"):
        served, allocated, load_s = load(path, mode == "compressed")
        for b in (1, 32):                     # untimed: cuBLAS handles, lazily loaded kernels, the allocator
            greedy(served, b, 4)
        runs[mode] = {"allocated_bytes": allocated, "weight_bytes": served.weight_bytes, "load_s": load_s,
                      "batch": {b: greedy(served, b, args.steps) for b in (1, 32)}}
        if served.schedule is not None:
            runs[mode]["parts"] = {"streams_and_index": served.schedule.compressed_bytes,
                                   "scratch": served.schedule.scratch_bytes,
                                   "piece_steps": sorted({p.index.entry_steps for c in served.schedule.layers
                                                          for p in c.parts})}
        del served
    raw = runs["decoded"]["allocated_bytes"]
    res["memory_ratio"] = runs["compressed"]["allocated_bytes"] / raw
    for b in (1, 32):
        (t_d, l_d, s_d), (t_c, l_c, s_c) = runs["decoded"]["batch"][b], runs["compressed"]["batch"][b]
        res[f"batch{b}"] = {"tokens_equal": bool(torch.equal(t_d, t_c)), "logits_equal": bool(torch.equal(l_d, l_c)),
                            "decoded_tok_s": s_d, "compressed_tok_s": s_c, "speed_ratio": s_c / s_d}
    res["allocated_bytes"] = {m: r["allocated_bytes"] for m, r in runs.items()}
    res["compressed_parts"] = runs["compressed"].get("parts")
    res["load_s"] = {m: r["load_s"] for m, r in runs.items()}
    res["load_s"]["safetensors_load_file_cuda"] = safetensors_load_s(Path("/tmp/st_resident"))
    res["load_over_safetensors"] = {m: res["load_s"][m] / res["load_s"]["safetensors_load_file_cuda"] for m in runs}
    print(json.dumps(res, indent=1), flush=True)
    res["budget"] = budget_case(path.parent, raw)
    print(json.dumps(res["budget"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
