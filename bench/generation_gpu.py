"""Generation under load on a GPU: a Llama-2-7B-shaped model, tokens/s at 64 concurrent clients
against 1 client, through the server and the project's load script (loadtests/run.py).

    python bench/generation_gpu.py --tokenizer .gentok --out $OUT       (scripts/gpu/run.sh (stage generation))

The model: Llama-2-7B's shape (32 layers, 4096 hidden, 11008 MLP, 32 heads) with the demo's
49152-token vocabulary, so the demo's tokenizer (carried in --tokenizer) serves it. Weights are
random bf16 drawn like trained ones: N(0, 0.02) matrices, norms N(1, 0.02). Built on the GPU,
compressed once into /tmp/store-gen (kept between runs on a warm machine). Then one server
(`wcodec serve`, CUDA, the model preloaded) takes a warm-up request and two bench runs: the
acceptance workload (greedy, --tokens new tokens, every prompt different) with 1 user, then with
--users users. The summary (and every run's JSON) goes to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from codec.encode import compress_state_dict

ROOT = Path(__file__).resolve().parent.parent
NAME = "llama7b"
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
          "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 32, "vocab_size": 49152, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


SMOKE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4}                            # --smoke: the same path, small, on the CPU


def state(config: dict, device: str, seed: int = 7) -> dict[str, torch.Tensor]:
    """Trained-like random weights [out, in], made on `device` (bf16, then to the host)."""
    c, g = config, torch.Generator(device=device).manual_seed(seed)
    e, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,), "lm_head.weight": (v, e)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{n}_proj.weight": (e, e) for n in "qkvo"}
        shapes |= {p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e),
                   p + "mlp.down_proj.weight": (e, f), p + "input_layernorm.weight": (e,),
                   p + "post_attention_layernorm.weight": (e,)}
    return {n: ((1.0 if len(s) == 1 else 0.0) + 0.02 * torch.randn(s, generator=g, device=device))
            .bfloat16().cpu() for n, s in shapes.items()}


def build(store: Path, tokenizer: Path, config: dict, device: str) -> float:
    path = store / f"{NAME}.wcodec"
    if path.exists():
        return 0.0
    t0 = time.perf_counter()
    store.mkdir(parents=True, exist_ok=True)
    files = {p.name: p.read_bytes() for p in tokenizer.iterdir() if p.is_file()}
    compress_state_dict(state(config, device), path.with_suffix(".tmp"), workers=os.cpu_count(),
                        files={**files, "config.json": json.dumps(config).encode()})
    path.with_suffix(".tmp").rename(path)
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(store: Path, out: Path, device: str) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "WCODEC_MODEL_STORE": str(store), "WCODEC_DEMO": "false", "WCODEC_DEVICE": device,
           "WCODEC_PRELOAD": json.dumps([NAME]), "WCODEC_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "wcodec", "serve", "--host", "127.0.0.1", "--port",
                             url.rsplit(":", 1)[1]], env=env, cwd=ROOT, stdout=(out / "server.log").open("wb"),
                            stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    raise SystemExit(f"the server did not get ready; see {out / 'server.log'}")


def bench(url: str, users: int, duration: float, tokens: int, out: Path) -> dict:
    result = out / f"gen-{users}.json"
    cmd = [sys.executable, "-m", "loadtests.run", "--host", url, "--users", str(users), "--duration",
           str(duration), "--tokens", str(tokens), "--json", str(result)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--store", type=Path, default=Path("/tmp/store-gen"))
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model on the CPU: checks the path, no figures")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config, device = ({**CONFIG, **SMOKE}, "cpu") if args.smoke else (CONFIG, "cuda")
    build_s = build(args.store, args.tokenizer, config, device)
    proc, url = serve(args.store, args.out, device)
    try:
        warm = httpx.post(f"{url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}},
                          timeout=300)
        warm.raise_for_status()
        one = bench(url, 1, args.duration, args.tokens, args.out)
        many = bench(url, args.users, args.duration, args.tokens, args.out)
    finally:
        proc.terminate()
        proc.wait(60)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    summary = {"device": name, "date": time.strftime("%Y-%m-%d"), "build_s": build_s,
               "tokens_per_s_1": one["tokens_per_s"], f"tokens_per_s_{args.users}": many["tokens_per_s"],
               "ratio": many["tokens_per_s"] / max(one["tokens_per_s"], 1e-9),
               "errors": one["errors"] + many["errors"], "runs": {"1": one, str(args.users): many}}
    (args.out / "generation_gpu.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
