"""Cold start end to end (issue 9): from process start to the first generated token, `wcodec serve`
with the model preloaded against what a user does instead -- transformers
`AutoModelForCausalLM.from_pretrained(folder, dtype=bfloat16, device_map=DEVICE)` on the same weights
as one .safetensors file, then `generate(max_new_tokens=1)` -- each in a fresh process, in pairs
(ours CRCs on, theirs, ours CRCs off, ...) so that machine load touches both sides alike; page
cache warm, then dropped before every run. Then a load into a running server against
`safetensors.torch.load_file(device=DEVICE)` (host cache off: each load reads the page cache), and
model switches: in a server with the host cache on, a first load, then unload + load again, which
decodes from the archive kept in (pinned) host memory. Each side's import time is printed separately.

    python bench/cold_start.py --demo --runs 3                         # CPU: the demo model
    python bench/cold_start.py --make-7b --tokenizer DIR --runs 3      # GPU: Llama-2-7B-shaped, random bf16
    python bench/cold_start.py --archive M.wcodec --only warm,server   # any archive

--cold drop: `echo 3 > /proc/sys/vm/drop_caches` before each run (root); --cold evict: only the
model files' pages (posix_fadvise), for shared machines. Results: one JSON (--json) and a table.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
NAME = "model"


# --- the baseline, run as `cold_start.py --baseline FOLDER --device D` in a fresh process ---------

def baseline(folder: str, device: str) -> None:
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    imported = time.perf_counter()
    # device_map needs accelerate; a CPU load is the default placement without it
    placement = {"device_map": device} if device != "cpu" else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **placement)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    loaded = time.perf_counter()
    inputs = tokenizer(PROMPT, return_tensors="pt").to(device)
    out = model.generate(**inputs, max_new_tokens=1, do_sample=False)
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"first_token_wall": time.time(), "import_s": imported - t0, "load_s": loaded - imported,
                      "token": int(out[0, -1])}), flush=True)


# --- preparation -----------------------------------------------------------------------------------

def _hf_folder(archive: Path, folder: Path) -> None:
    """The archive's weights as model.safetensors, beside its embedded config and tokenizer files."""
    import wcodec
    from safetensors.torch import save_file
    model = wcodec.load(archive, "cpu")
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    for name, blob in model.files.items():
        (folder / name).write_bytes(blob)


def _make_7b(work: Path, tokenizer: Path) -> Path:
    """A Llama-2-7B-shaped model of random bf16 (bench/service_gpu.py's), as .wcodec and as a folder."""
    sys.path.insert(0, str(HERE))
    from safetensors.torch import save_file
    from service_gpu import LLAMA7B, seven_b_state

    from codec.encode import compress_state_dict
    files = {p.name: p.read_bytes() for p in tokenizer.iterdir() if p.is_file()}
    files["config.json"] = json.dumps(LLAMA7B).encode()
    state = seven_b_state()
    archive = work / "src" / f"{NAME}.wcodec"
    archive.parent.mkdir(parents=True, exist_ok=True)
    compress_state_dict(state, archive, workers=os.cpu_count() or 1, files=files)
    (work / "hf").mkdir(parents=True, exist_ok=True)
    save_file(state, work / "hf" / "model.safetensors", metadata={"format": "pt"})
    for name, blob in files.items():
        (work / "hf" / name).write_bytes(blob)
    return archive


def prepare(args: argparse.Namespace, work: Path) -> Path:
    """WORK/store/model.wcodec and WORK/hf/ (kept between calls: delete WORK to rebuild)."""
    store = work / "store"
    if (store / f"{NAME}.wcodec").is_file() and (work / "hf" / "model.safetensors").is_file():
        return store
    if args.make_7b:
        archive = _make_7b(work, Path(args.tokenizer))
    elif args.demo:
        from service.load.demo import build_demo
        archive = build_demo(work / "src", workers=os.cpu_count())
        _hf_folder(archive, work / "hf")
    else:
        archive = Path(args.archive)
        _hf_folder(archive, work / "hf")
    store.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(archive, store / f"{NAME}.wcodec")
    return store


# --- one measured run each way ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cold(mode: str, files: list[Path]) -> None:
    if mode == "drop":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    elif mode == "evict":
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 26):
                pass


def _server(store: Path, device: str, verify: bool, preload: bool, log: Path,
            **settings: str) -> tuple[subprocess.Popen, str]:
    """`wcodec serve` in a fresh process; `settings`: more WCODEC_<NAME> variables, by lowercase name."""
    port = free_port()
    env = {**os.environ, "WCODEC_MODEL_STORE": str(store), "WCODEC_DEMO": "false", "WCODEC_DEVICE": device,
           "WCODEC_PRELOAD": json.dumps([NAME] if preload else []), "WCODEC_VERIFY_CRC": str(verify).lower(),
           "WCODEC_LOG_LEVEL": "debug", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **{f"WCODEC_{k.upper()}": v for k, v in settings.items()}}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "wcodec", "serve", "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def _until(client, url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if client.get(url).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def ours(store: Path, device: str, verify: bool, log: Path) -> dict:
    import httpx
    t0 = time.time()
    proc, base = _server(store, device, verify, True, log)
    try:
        with httpx.Client(base_url=base, timeout=900) as client:
            _until(client, "/health/ready", proc)
            r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1}})
            first = time.time()
            r.raise_for_status()
            startup = client.get("/health/startup").json()
            model = client.get(f"/models/{NAME}").json()
    finally:
        proc.terminate()
        proc.wait(60)
    spans = startup["timeline"]
    imports = sum(e["seconds"] for e in spans if e["name"].startswith(("import ", "warm-up: import")))
    return {"first_token_s": first - t0, "ready_s": startup["process_start_to_ready_s"], "import_s": imports,
            "load_total_s": (model.get("last_load") or {}).get("total_s"), "timeline": spans}


def theirs(folder: Path, device: str) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--baseline", str(folder), "--device", device],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"the baseline failed:\n{out.stderr[-3000:]}")
    child = json.loads(out.stdout.strip().splitlines()[-1])
    return {"first_token_s": child["first_token_wall"] - t0, "import_s": child["import_s"], "load_s": child["load_s"]}


def table(args, store: Path, work: Path, cold: str) -> dict:
    archive, weights = store / f"{NAME}.wcodec", work / "hf" / "model.safetensors"
    rows: dict[str, list[dict]] = {"ours_crc_on": [], "theirs": [], "ours_crc_off": []}
    for i in range(args.runs):
        for side in rows:
            if cold == "warm":
                warm([archive, weights])
            else:
                make_cold(cold, [archive, weights])
            log = work / "logs" / f"{cold}-{side}-{i}.log"
            r = theirs(work / "hf", args.device) if side == "theirs" else \
                ours(store, args.device, side == "ours_crc_on", log)
            rows[side].append(r)
            print(f"  {cold} run {i} {side}: first token {r['first_token_s']:.2f} s, imports {r['import_s']:.2f} s",
                  flush=True)
    med = {side: statistics.median(r["first_token_s"] for r in runs) for side, runs in rows.items()}
    ratios = [o["first_token_s"] / t["first_token_s"] for o, t in zip(rows["ours_crc_on"], rows["theirs"])]
    return {"runs": rows, "median_first_token_s": med, "paired_ratios_crc_on": ratios,
            "ratio_of_medians_crc_on": med["ours_crc_on"] / med["theirs"],
            "median_import_s": {side: statistics.median(r["import_s"] for r in runs) for side, runs in rows.items()}}


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _load_unload(client) -> dict:
    t = time.perf_counter()
    client.post(f"/models/{NAME}/load").raise_for_status()
    run = {"wall_s": time.perf_counter() - t, **client.get(f"/models/{NAME}").json()["last_load"]}
    client.post(f"/models/{NAME}/unload").raise_for_status()
    return run


def switches(args, store: Path, work: Path) -> dict:
    """Model switches, CRCs on: a first load (page cache warm; the archive enters the host cache),
    then unload + load `--switches` times, each from the host cache. Before the switches the
    server is given up to 30 s to page-lock what it keeps (wcodec_host_cache_pinned_bytes)."""
    import httpx
    archive = store / f"{NAME}.wcodec"
    budget = {} if args.host_cache_bytes is None else {"host_cache_bytes": str(args.host_cache_bytes)}
    proc, base = _server(store, args.device, True, False, work / "logs" / "server-switches.log", **budget)
    try:
        with httpx.Client(base_url=base, timeout=900) as client:
            _until(client, "/health", proc)
            warm([archive])
            first = _load_unload(client)
            deadline = time.time() + 30
            while args.device == "cuda" and time.time() < deadline and \
                    _metric(client, "wcodec_host_cache_pinned_bytes") < _metric(client, "wcodec_host_cache_bytes"):
                time.sleep(0.05)
            cached = {k: _metric(client, f"wcodec_host_cache_{k}") for k in ("bytes", "pinned_bytes")}
            runs = [_load_unload(client) for _ in range(args.switches)]
    finally:
        proc.terminate()
        proc.wait(60)
    return {"first_load": first, "switches": runs, "host_cache": cached}


def server_loads(args, store: Path, work: Path) -> dict:
    """A load into a running server (page cache warm, host cache off) against
    safetensors.torch.load_file; then model switches (host cache on)."""
    import httpx
    import torch
    from safetensors.torch import load_file
    archive, weights = store / f"{NAME}.wcodec", work / "hf" / "model.safetensors"
    warm([archive, weights])
    st = []
    for _ in range(args.runs):
        t = time.perf_counter()
        sd = load_file(weights, device=args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        st.append(time.perf_counter() - t)
        del sd
    out = {"safetensors_load_file_s": st}
    for verify in (True, False):
        proc, base = _server(store, args.device, verify, False, work / "logs" / f"server-{verify}.log",
                             host_cache_bytes="0")
        try:
            with httpx.Client(base_url=base, timeout=900) as client:
                _until(client, "/health", proc)
                runs = []
                for _ in range(args.runs + 1):           # the first load pays first-touch costs: reported apart
                    warm([archive])
                    runs.append(_load_unload(client))
        finally:
            proc.terminate()
            proc.wait(60)
        out[f"wcodec_crc_{'on' if verify else 'off'}"] = runs
    best = statistics.median(r["wall_s"] for r in out["wcodec_crc_on"][1:])
    out["ratio_crc_on"] = best / statistics.median(st)
    if args.switches:
        sw = out["switches_crc_on"] = switches(args, store, work)
        out["ratio_first_load_crc_on"] = sw["first_load"]["wall_s"] / statistics.median(st)
        out["ratios_switch_crc_on"] = [r["wall_s"] / statistics.median(st) for r in sw["switches"]]
        out["ratio_switch_crc_on"] = statistics.median(out["ratios_switch_crc_on"])
    return out


BYTECODE_OF = ("fastapi", "pydantic", "uvicorn", "service.app", "codec.container", "transformers", "safetensors")


def bytecode() -> dict[str, bool]:
    """Whether each package's first module has its compiled bytecode beside it. Where it has not
    and PYTHONDONTWRITEBYTECODE is set (the lent GPU boxes), every start compiles that package
    anew: pip installs with bytecode, and the image compiles ours (Dockerfile)."""
    import importlib.util
    have = {}
    for name in BYTECODE_OF:
        spec = importlib.util.find_spec(name)
        have[name] = bool(spec and spec.origin and os.path.exists(importlib.util.cache_from_source(spec.origin)))
    return have


def describe() -> dict:
    import platform

    import torch
    import transformers
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    load = os.getloadavg()
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gpu": gpu, "cpus": os.cpu_count(),
            "loadavg": load, "dont_write_bytecode": sys.flags.dont_write_bytecode, "bytecode": bytecode()}


def report(result: dict) -> None:
    print("\n| page cache | transformers + safetensors | wcodec serve, CRCs on | CRCs off | ratio (on) |")
    print("|---|---|---|---|---|")
    for cold, t in result["tables"].items():
        m = t["median_first_token_s"]
        print(f"| {cold} | {m['theirs']:.2f} s | {m['ours_crc_on']:.2f} s | {m['ours_crc_off']:.2f} s | "
              f"{t['ratio_of_medians_crc_on']:.2f} (paired: {', '.join(f'{r:.2f}' for r in t['paired_ratios_crc_on'])}) |")
        imp = t["median_import_s"]
        print(f"|   imports (median) | {imp['theirs']:.2f} s | {imp['ours_crc_on']:.2f} s | {imp['ours_crc_off']:.2f} s | |")
    if "server" not in result:
        return
    s = result["server"]
    print(f"\nload into a running server: safetensors {statistics.median(s['safetensors_load_file_s']):.3f} s; "
          f"wcodec CRCs on {[round(r['wall_s'], 3) for r in s['wcodec_crc_on']]}, "
          f"off {[round(r['wall_s'], 3) for r in s['wcodec_crc_off']]}; ratio (on, after the first) "
          f"{s['ratio_crc_on']:.3f}")
    if "switches_crc_on" in s:
        sw = s["switches_crc_on"]
        print(f"model switches, host cache on, CRCs on ({sw['host_cache']['bytes'] / 1e9:.2f} GB kept, "
              f"{sw['host_cache']['pinned_bytes'] / 1e9:.2f} GB page-locked): first load "
              f"{sw['first_load']['wall_s']:.3f} s (ratio {s['ratio_first_load_crc_on']:.3f}, source "
              f"{sw['first_load'].get('source')}); switches {[round(r['wall_s'], 3) for r in sw['switches']]} "
              f"(ratios {[round(r, 3) for r in s['ratios_switch_crc_on']]}, median {s['ratio_switch_crc_on']:.3f}; "
              f"sources {sorted({r.get('source') for r in sw['switches']})})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help=argparse.SUPPRESS)
    ap.add_argument("--archive")
    ap.add_argument("--demo", action="store_true")
    ap.add_argument("--make-7b", action="store_true")
    ap.add_argument("--tokenizer", help="folder of tokenizer files for --make-7b")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (bytecode caches, extension build)")
    ap.add_argument("--cold", default="drop", choices=["drop", "evict", "none"], help="how the dropped rows are made")
    ap.add_argument("--only", default="warm,cold,server", help="which of warm, cold, server")
    ap.add_argument("--switches", type=int, default=5,
                    help="server: model switches (unload, load from the host cache) after a first load; 0: none")
    ap.add_argument("--host-cache-bytes", type=int, default=None,
                    help="server switches: WCODEC_HOST_CACHE_BYTES (default: the server's own default)")
    ap.add_argument("--work", default="/tmp/wcodec-coldstart")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.baseline:
        return baseline(args.baseline, args.device or "cpu")
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    store = prepare(args, work)
    result = {**describe(), "device": args.device, "archive_bytes": (store / f"{NAME}.wcodec").stat().st_size,
              "safetensors_bytes": (work / "hf" / "model.safetensors").stat().st_size, "tables": {}}
    print(json.dumps({k: v for k, v in result.items() if k != "tables"}), flush=True)
    for _ in range(args.warmup):
        ours(store, args.device, True, work / "logs" / "warmup.log"), theirs(work / "hf", args.device)
    only = args.only.split(",")
    if "warm" in only:
        result["tables"]["warm"] = table(args, store, work, "warm")
    if "cold" in only and args.cold != "none":
        result["tables"][f"cold ({args.cold})"] = table(args, store, work, args.cold)
    if "server" in only:
        result["server"] = server_loads(args, store, work)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
