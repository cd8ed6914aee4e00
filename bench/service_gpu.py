"""The server on a GPU: time to ready through the CUDA decoder, against safetensors.

    python bench/service_gpu.py 7b   --part PART1.gguf --keep DIR   # 7B-shaped vs safetensors (both weight modes)
    python bench/service_gpu.py demo --parts P1,P2,P3                 # the demo model, then Paris

`7b`: a Llama-2-7B-shaped model of random bf16 (>= 13 GB) is written both as .safetensors and as
.wcodec (config.json for Llama-2-7B; tokenizer files from the demo GGUF so the server can build
it); with the page cache warm, safetensors.torch.load_file(device="cuda") is timed against the
server's POST /models/{name}/load (time to ready, phases from GET /models/{name}), CRCs on and
off, and with weights=compressed (CUDA's fixed-rate form: each matrix transcoded at load). `demo`: the demo model is rebuilt from its GGUF parts (the whole file is over one transfer)
and served: time to ready, its phases, and a greedy chat answer.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from gpu_bench import weights

from codec.encode import compress_state_dict
from codec.sources import open_source

LLAMA7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`wcodec serve` in a subprocess over a store, no demo build, no preloads."""

    def __init__(self, store: Path, verify: bool = True, budget: int | None = None):
        self.port = free_port()
        env = {**os.environ, "WCODEC_MODEL_STORE": str(store), "WCODEC_DEMO": "false", "WCODEC_PRELOAD": "[]",
               "WCODEC_VERIFY_CRC": str(verify).lower(), "WCODEC_DEVICE": "cuda", "WCODEC_LOG_LEVEL": "debug",
               **({"WCODEC_GPU_MEMORY_BUDGET": str(budget)} if budget else {})}
        log = open(Path(os.environ.get("OUT", "/tmp")) / f"server-verify-{verify}.log", "w")   # the load timelines
        self.proc = subprocess.Popen([sys.executable, "-m", "wcodec", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        for _ in range(600):
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def load(self, name: str, weights: str = "decoded") -> dict:
        t = time.perf_counter()
        r = self.client.post(f"/models/{name}/load", params={"wait": "true", "weights": weights})
        wall = time.perf_counter() - t
        r.raise_for_status()
        info = self.client.get(f"/models/{name}").json()
        return {"time_to_ready_s": wall, "last_load": info.get("last_load"), "state": info.get("state"),
                "device": info.get("device")}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def seven_b_state(seed: int = 7) -> dict:
    shapes = {"model.embed_tokens.weight": (32000, 4096), "model.norm.weight": (4096,), "lm_head.weight": (32000, 4096)}
    for i in range(32):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (4096, 4096), p + "self_attn.k_proj.weight": (4096, 4096),
                       p + "self_attn.v_proj.weight": (4096, 4096), p + "self_attn.o_proj.weight": (4096, 4096),
                       p + "mlp.gate_proj.weight": (11008, 4096), p + "mlp.up_proj.weight": (11008, 4096),
                       p + "mlp.down_proj.weight": (4096, 11008), p + "input_layernorm.weight": (4096,),
                       p + "post_attention_layernorm.weight": (4096,)})
    return weights(shapes, seed)


def safetensors_cuda_s(path: Path, runs: int = 1) -> list[float]:
    """Seconds of each `safetensors.torch.load_file(path, device="cuda")`, the tensors freed between."""
    from safetensors.torch import load_file
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        sd = load_file(str(path), device="cuda")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        del sd
        torch.cuda.empty_cache()
    return times


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 26):
            pass


def run_7b(part: str, keep: str) -> dict:
    from safetensors.torch import save_file
    Path(keep).mkdir(parents=True, exist_ok=True)
    shutil.copy(part, Path(keep) / "part1.gguf")                       # for the demo call that follows
    with open_source(part) as src:
        tokenizer = {k: v for k, v in src.files.items() if k.startswith(("tokenizer", "special"))}
    state = seven_b_state()
    raw = sum(t.nbytes for t in state.values())
    store, st_path = Path("/tmp/store7b"), Path("/tmp/llama7b.safetensors")
    store.mkdir(exist_ok=True)
    stats = compress_state_dict(state, store / "llama7b.wcodec", workers=16,
                                files={"config.json": json.dumps(LLAMA7B).encode(), **tokenizer})
    save_file(state, st_path)
    del state
    warm(st_path), warm(store / "llama7b.wcodec")
    st_times = safetensors_cuda_s(st_path, runs=3)
    out = {"raw_GB": raw / 1e9, "file_GB": stats.file_bytes / 1e9, "ratio": stats.ratio,
           "safetensors_load_file_cuda_s": statistics.median(st_times), "safetensors_runs_s": st_times}
    for verify in (True, False):
        server = Server(store, verify)
        try:
            runs = [server.load("llama7b")]
            server.client.post("/models/llama7b/unload").raise_for_status()
            runs.append(server.load("llama7b"))
            out[f"wcodec_verify_crc_{verify}"] = runs
        finally:
            server.close()
    best = min(r["time_to_ready_s"] for r in out["wcodec_verify_crc_False"] + out["wcodec_verify_crc_True"])
    out["speedup_vs_safetensors"] = out["safetensors_load_file_cuda_s"] / best
    server = Server(store)                      # weights=compressed: CUDA's fixed-rate form, transcoded at load
    try:
        runs = [server.load("llama7b", "compressed")]
        server.client.post("/models/llama7b/unload").raise_for_status()
        runs.append(server.load("llama7b", "compressed"))
        out["wcodec_compressed"] = runs
    finally:
        server.close()
    out["compressed_over_safetensors"] = min(r["time_to_ready_s"] for r in runs) / out["safetensors_load_file_cuda_s"]
    return out


def run_demo(parts: list[str]) -> dict:
    state, files = {}, {}
    for part in parts:
        with open_source(part) as src:
            state.update({i.name: src.load(i.name) for i in src.tensors()})
            files = files or src.files
    store = Path("/tmp/store_demo")
    store.mkdir(exist_ok=True)
    stats = compress_state_dict(state, store / "smollm2-135m-instruct.wcodec", workers=16, files=files)
    server = Server(store)
    try:
        load = server.load("smollm2-135m-instruct")
        chat = server.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}).json()
    finally:
        server.close()
    return {"tensors": len(state), "ratio": stats.ratio, "load": load,
            "answer": chat["choices"][0]["message"]["content"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["7b", "demo"])
    ap.add_argument("--part")
    ap.add_argument("--keep", default="/tmp/keep")
    ap.add_argument("--parts")
    args = ap.parse_args()
    result = run_7b(args.part, args.keep) if args.mode == "7b" else run_demo(args.parts.split(","))
    print(json.dumps({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), **result}, indent=1))


if __name__ == "__main__":
    main()
