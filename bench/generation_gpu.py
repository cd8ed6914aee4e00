"""Generation speed in one run (issue 23): our batch-1 tokens/s and many concurrent clients through
HTTP (`wcodec serve` and the project's load script, loadtests/run.py), transformers' `generate`
(default cache and `cache_implementation="static"`) at batch 1 on the same weights, and the limit:
weight bytes / the device's measured read bandwidth (a step reads every weight once).

    python bench/generation_gpu.py --tokenizer .gentok --out $OUT        (scripts/gpu/run.sh (stage generation))
    python bench/generation_gpu.py --demo --device cpu --tokens 32 --users 32 --duration 30   # this CPU

The GPU model: Llama-2-7B's shape (32 layers, 4096 hidden, 11008 MLP, 32 heads) with the demo's
49152-token vocabulary, so the demo's tokenizer (carried in --tokenizer) serves it. Weights are
random bf16 drawn like trained ones: N(0, 0.02) matrices, norms N(1, 0.02). Built on the GPU,
compressed once into /tmp/store-gen (kept between runs on a warm machine). --demo: the demo model.
The server (`wcodec serve`, the model preloaded) takes a warm-up request, then the bench waits
while the engine captures its CUDA graphs (the count stops growing), and runs the acceptance
workload (greedy, --tokens new tokens, every prompt different) at 1 user, then each of --users.
The summary (and every run's JSON) goes to --out. Batch 1's tokens/s against the limit is a
request's: --tokens / its latency p50 (prefill and HTTP included, as transformers' `generate` is
timed); the closed loop's aggregate (tokens received / the duration, the client's gaps between
requests included) is reported beside it. --weights decoded compressed compressed-indexed: one
server per resident mode (compressed: CUDA's fixed-rate form; -indexed: the rANS streams), each
compressed mode's rates and weight bytes also as ratios of decoded mode's.
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

# No OMP_WAIT_POLICY here: transformers runs in this process as a user runs it, with OpenMP's
# defaults (`wcodec serve` sets its own, wcodec/serve.py). Until 2026-11-26 this bench set PASSIVE
# here too, which halved transformers' CPU rate (10-12 against 19-20 tokens/s on the demo).

import httpx
import torch

from codec.encode import compress_state_dict

ROOT = Path(__file__).resolve().parent.parent
NAME = "llama7b"
MODES = {"decoded": {"WCODEC_WEIGHTS": "decoded"}, "compressed": {"WCODEC_WEIGHTS": "compressed"},
         "compressed-indexed": {"WCODEC_WEIGHTS": "compressed", "WCODEC_COMPRESSED_FORM": "indexed"}}
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


FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
       "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
           "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}


def fp8_state(weights: dict, device: str) -> dict[str, torch.Tensor]:
    """`weights` as llm-compressor's FP8 (per-channel) checkpoint: each decoder Linear's weight in
    e4m3, times a bf16 scale a row (its largest magnitude / 448)."""
    out = {}
    for name, w in weights.items():
        if not name.endswith("proj.weight"):
            out[name] = w
            continue
        w = w.to(device).float()
        scale = (w.abs().amax(1, keepdim=True) / 448).bfloat16()
        out[name] = (w / scale.float()).to(torch.float8_e4m3fn).cpu()
        out[name.replace("weight", "weight_scale")] = scale.cpu()
    return out


def build(store: Path, tokenizer: Path, config: dict, device: str, fp8: bool = False) -> Path | None:
    """STORE/llama7b.wcodec and the same weights as a transformers folder STORE/../hf-gen (kept;
    none for `fp8`: the archive holds them as an fp8 checkpoint)."""
    path, folder = store / f"{NAME}.wcodec", store.parent / (store.name + "-hf")
    if path.exists() and (fp8 or (folder / "model.safetensors").exists()):
        return None if fp8 else folder
    from safetensors.torch import save_file
    store.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    files = {p.name: p.read_bytes() for p in tokenizer.iterdir() if p.is_file()}
    files["config.json"] = json.dumps({**config, "quantization_config": FP8} if fp8 else config).encode()
    weights = state(config, device)
    if fp8:
        weights = fp8_state(weights, device)
        compress_state_dict(weights, path, workers=os.cpu_count(), files=files)
        return None
    if not path.exists():
        compress_state_dict(weights, path.with_suffix(".tmp"), workers=os.cpu_count(), files=files)
        path.with_suffix(".tmp").rename(path)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    for name, blob in files.items():
        (folder / name).write_bytes(blob)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(store: Path, out: Path, device: str, env: dict[str, str], root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """`wcodec serve` of `root` (a checkout) over `store`, NAME preloaded; returns it and its URL once ready."""
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "WCODEC_MODEL_STORE": str(store), "WCODEC_DEMO": "false", "WCODEC_DEVICE": device,
           "WCODEC_PRELOAD": json.dumps([NAME]), "WCODEC_LOG_LEVEL": "warning",
           "WCODEC_ENGINE": "paged", **env}          # the engine this bench measures (auto's)
    proc = subprocess.Popen([sys.executable, "-m", "wcodec", "serve", "--host", "127.0.0.1", "--port",
                             url.rsplit(":", 1)[1]], env=env, cwd=root, stdout=(out / "server.log").open("wb"),
                            stderr=subprocess.STDOUT)
    for _ in range(2400):
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return proc, url
            model = httpx.get(f"{url}/models/{NAME}", timeout=2).json()
            if model.get("state") == "failed" or model.get("last_error"):   # it lives on, never ready
                proc.terminate()
                raise SystemExit(f"the server could not load {NAME}: {model.get('last_error')}; "
                                 f"see {out / 'server.log'}")
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.25)
    raise SystemExit(f"the server did not get ready; see {out / 'server.log'}")


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples on the server's /metrics."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith((name + "{", name + " ")))


def wait_for_graphs(url: str, limit_s: float = 120.0) -> dict:
    """Until the engine has a graph of every step shape (wcodec_engine_cuda_graph_shapes) and their
    count has not moved for 3 s: idle captures once the Triton kernels are warm (runner.py). A
    count that merely stops growing is not enough: while those kernels compile (seconds) it stays
    at the warm-up request's graphs, which their adoption then drops, and the captures fell inside
    the timed requests (H200, 2026-11-28 09:18: 1 graph when the wait ended, batch 1's TTFT p50
    0.051 s against 0.028 s with all 98 in place)."""
    t0, last, since = time.perf_counter(), -1.0, time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        n, shapes = metric(url, "wcodec_engine_cuda_graphs"), metric(url, "wcodec_engine_cuda_graph_shapes")
        if n != last or n == 0 or n < shapes:
            last, since = n, time.perf_counter()
        elif time.perf_counter() - since > 3:
            break
        time.sleep(0.5)
    return {"graphs": last, "capture_s": metric(url, "wcodec_engine_graph_capture_seconds"),
            "waited_s": time.perf_counter() - t0}


def bench(url: str, users: int, duration: float, tokens: int, out: Path, scenario: str = "bench") -> dict:
    result = out / f"gen-{users}.json"
    cmd = [sys.executable, "-m", "loadtests.run", "--host", url, "--users", str(users), "--duration",
           str(duration), "--tokens", str(tokens), "--scenario", scenario, "--json", str(result)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads(result.read_text())


def read_bandwidth(device: str) -> float:
    """Bytes/s the device reads: the best of 10 sums over a buffer far larger than its caches."""
    x = torch.ones((1 << 30) // 4 if device == "cuda" else (1 << 28) // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(10):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def transformers_generate(folder: Path, device: str, tokens: int) -> dict:
    """transformers' batch-1 greedy tokens/s, default cache and static cache (a warm-up first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    ids = AutoTokenizer.from_pretrained(folder)("Write a short story about the sea.", return_tensors="pt").to(device)
    out = {}
    for name, extra in (("default", {}), ("static", {"cache_implementation": "static"})):
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            gen = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **extra)
            if device == "cuda":
                torch.cuda.synchronize()
            runs.append((gen.shape[1] - ids["input_ids"].shape[1]) / (time.perf_counter() - t0))
        out[name] = max(runs[1:])
    del model
    return out


def model_args(doc: str) -> argparse.ArgumentParser:
    """A parser with the model's and the run's arguments (`prepare` reads them)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, help="the tokenizer files of the 7B-shaped model (GPU)")
    ap.add_argument("--demo", action="store_true", help="the demo model instead of the 7B-shaped one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--store", type=Path, default=Path("/tmp/store-gen"))
    return ap


def parse() -> argparse.Namespace:
    ap = model_args(__doc__)
    ap.add_argument("--users", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--scenario", choices=["bench", "mix"], default="bench",
                    help="the many-client runs' load (loadtests/locustfile.py): bench, greedy streams back to back "
                         "(the acceptance workload); mix, the service's mix of endpoints, sampling, stops and "
                         "clients leaving mid-stream, so that requests end and arrive at different steps")
    ap.add_argument("--env", action="append", default=[], metavar="WCODEC_X=V", help="a setting for the server")
    ap.add_argument("--weights", nargs="+", default=["decoded"], choices=list(MODES),
                    help="resident modes, one server each, in this order (the first is against the limit); "
                         "compressed: CUDA's default form (fixed-rate), compressed-indexed: the rANS streams")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="the 7B-shaped model as an fp8 checkpoint (per-channel "
                    "scales, compressed-tensors' format): decoded mode dequantizes it, compressed mode keeps its "
                    "e4m3 bytes (W8A16); no transformers run")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model on the CPU: checks the path, no figures")
    return ap.parse_args()


def prepare(args: argparse.Namespace) -> tuple[str, Path | None]:
    """The store (and a transformers folder of the same weights); returns the device and the folder."""
    if args.demo:
        from cold_start import _hf_folder

        from service.load.demo import build_demo
        store = args.store.with_name(args.store.name + "-demo")
        if not (store / f"{NAME}.wcodec").exists():
            built = build_demo(store / "src", workers=os.cpu_count())
            built.rename(store / f"{NAME}.wcodec")
            _hf_folder(store / f"{NAME}.wcodec", store / "hf")
        args.store = store
        return args.device, store / "hf"
    config, device = ({**CONFIG, **SMOKE}, "cpu") if args.smoke else (CONFIG, args.device)
    if args.fp8:
        args.store = args.store.with_name(args.store.name + "-fp8")
    return device, build(args.store, args.tokenizer, config, device, args.fp8)


def served_runs(args: argparse.Namespace, device: str, env: dict[str, str], out: Path) -> dict:
    """One server (`env`'s settings): the warm-up request, its graphs, then 1 user and each of --users."""
    out.mkdir(parents=True, exist_ok=True)
    proc, url = serve(args.store, out, device, env)
    try:
        httpx.post(f"{url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}},
                   timeout=600).raise_for_status()
        graphs = wait_for_graphs(url) if device == "cuda" else {}
        weight_bytes = metric(url, "wcodec_model_weight_bytes")
        host_bytes = metric(url, "wcodec_model_host_weight_bytes")          # fixed.HostEmbedding
        reserved = metric(url, "wcodec_gpu_memory_reserved_bytes")         # weights, cache and every graph
        runs = {str(u): bench(url, u, args.duration, args.tokens, out, "bench" if u == 1 else args.scenario)
                for u in [1, *args.users]}                                   # batch 1: greedy streams always
        graphs_after = metric(url, "wcodec_engine_cuda_graphs")
    finally:
        proc.terminate()
        proc.wait(60)
    return {"weight_bytes": weight_bytes, "host_weight_bytes": host_bytes, "gpu_reserved_bytes": reserved, "request_tokens_per_s_1": args.tokens / runs["1"]["latency_s"]["p50"],
            **{f"tokens_per_s_{u}": r["tokens_per_s"] for u, r in runs.items()},
            "ttft_p50": {u: r["ttft_s"]["p50"] for u, r in runs.items()},
            "errors": sum(r["errors"] for r in runs.values()), **graphs, "graphs_after": graphs_after, "runs": runs}


def main() -> None:
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "bench"))
    device, folder = prepare(args)
    env = dict(e.split("=", 1) for e in args.env)
    modes = {w: served_runs(args, device, {**env, **MODES[w]}, args.out / w if len(args.weights) > 1 else args.out)
             for w in args.weights}
    first = modes[args.weights[0]]
    theirs = transformers_generate(folder, device, args.tokens) if folder and not args.no_transformers else {}
    bandwidth = read_bandwidth(device)
    limit = bandwidth / first["weight_bytes"]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    summary = {"device": name, "date": time.strftime("%Y-%m-%d %H:%M"), "weights": args.weights[0],
               "tokens": args.tokens, "read_GBps": bandwidth / 1e9, "limit_tokens_per_s": limit,
               **{k: v for k, v in first.items() if k != "runs"},
               "of_limit_1": first["request_tokens_per_s_1"] / limit,
               "aggregate_of_limit_1": first["tokens_per_s_1"] / limit,
               **{f"transformers_{k}_1": v for k, v in theirs.items()},
               **{f"ours_over_transformers_{k}": first["tokens_per_s_1"] / v for k, v in theirs.items()}}
    for w in [w for w in modes if w != "decoded" and "decoded" in modes]:   # against decoded, same run
        d, c = modes["decoded"], modes[w]
        summary[w] = {k: v for k, v in c.items() if k != "runs"}
        summary[f"{w}_over_decoded"] = {
            "weight_bytes": c["weight_bytes"] / d["weight_bytes"],
            "weight_bytes_with_host": (c["weight_bytes"] + c["host_weight_bytes"]) / d["weight_bytes"],
            "request_tokens_per_s_1": c["request_tokens_per_s_1"] / d["request_tokens_per_s_1"],
            **{f"tokens_per_s_{u}": c[f"tokens_per_s_{u}"] / d[f"tokens_per_s_{u}"] for u in [1, *args.users]}}
    (args.out / "generation_gpu.json").write_text(json.dumps({**summary, "modes": modes}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
