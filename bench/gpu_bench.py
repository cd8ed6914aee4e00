"""GPU decode benchmark: wcodec beside DFloat11 and nvCOMP ANS on the same bf16 weights, in one run.

    python bench/gpu_bench.py [--layers 6] [--model-layers 32] [--json OUT.json]

Prints the device-to-device copy (the ceiling) and pinned host->device bandwidth, then for each
workload the ratio, GB/s of decoded output and latency per launch; then a 7B-shaped model decoded
from pinned host memory into GPU tensors, copies included. Weights are trained-like bf16 (`weights`)
made on the GPU (seeded). DFloat11's encoder is a Python loop (~7 MB/s), so it encodes one
transformer layer and decodes it as many times as there are layers (the same decode work).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

import cuda_ext
from codec.decode import Archive
from codec.encode import compress_state_dict
from cuda_ext import plans

LAYER = {"q": (4096, 4096), "k": (4096, 4096), "v": (4096, 4096), "o": (4096, 4096),
         "gate": (11008, 4096), "up": (11008, 4096), "down": (4096, 11008)}


def timed(fn, repeat: int = 10) -> float:
    """Median seconds of fn() on the current stream (CUDA events), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def ceilings() -> dict:
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    host = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    return {"d2d_copy_TBps": 2 * x.numel() / timed(lambda: y.copy_(x), 5) / 1e12,
            "pinned_h2d_GBps": host.numel() / timed(lambda: x.copy_(host, non_blocking=True), 5) / 1e9}


def weights(shapes: dict, seed: int, device: str = "cuda") -> dict:
    """Trained-like bf16 weights (on the CPU), made on `device` (seeded): matrices with per-row scales
    log-normal (sigma 0.35) around 0.02 and 1 in 10 000 weights an outlier x8; vectors (norms)
    around 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = (1 + 0.02 * torch.randn(shape, generator=g, device=device)).bfloat16().cpu()
            continue
        rows, cols = shape
        scale = 0.02 * torch.exp(0.35 * torch.randn(rows, 1, generator=g, device=device))
        w = torch.randn(rows, cols, generator=g, device=device) * scale
        w = torch.where(torch.rand(rows, cols, generator=g, device=device) < 1e-4, w * 8, w)
        out[name] = w.bfloat16().cpu()
    return out


def layer_shapes(n_layers: int) -> dict:
    return {f"model.layers.{i}.{k}.weight": s for i in range(n_layers) for k, s in LAYER.items()}


class Ours:
    """An archive on disk, its streams on the GPU, and one plan per launch granularity."""

    def __init__(self, state: dict, workdir: Path, name: str):
        self.path = workdir / f"{name}.wcodec"
        t = time.perf_counter()
        self.stats = compress_state_dict(state, self.path, workers=16)
        self.encode_s = time.perf_counter() - t
        with Archive.open(self.path) as a:
            self.entries = a.entries
            self.plan = plans.build(a.entries, a.path)
            self.data = torch.from_numpy(a.reader.buf[self.plan.start:self.plan.end].copy()).cuda()
        self.raw = sum(e.nbytes for e in self.entries)

    def layer_plans(self) -> list:
        by_layer = {}
        for e in self.entries:
            by_layer.setdefault(e.layer, []).append(e)
        return [plans.build(es, self.path, self.plan.start, self.plan.end) for es in by_layer.values()]

    def run(self, state: dict) -> dict:
        out = cuda_ext.decode_plan(self.plan, self.data)
        exact = all(torch.equal(out[k].view(torch.int16).cpu(), v.view(torch.int16)) for k, v in state.items())
        one = timed(lambda: cuda_ext.decode_plan(self.plan, self.data))
        layers = self.layer_plans()
        per_layer = timed(lambda: [cuda_ext.decode_plan(p, self.data) for p in layers])
        return {"ratio": self.stats.file_bytes / self.raw, "bit_exact": exact, "encode_MBps": self.raw / self.encode_s / 1e6,
                "GBps_one_launch": self.raw / one / 1e9, "GBps_launch_per_layer": self.raw / per_layer / 1e9,
                "latency_ms_one_launch": one * 1e3, "latency_ms_per_layer": per_layer * 1e3 / len(layers)}


class DFloat11:
    """DFloat11's own encoder and PTX kernel (through cupy) over a list of tensors, decoded by one
    launch into one output (its own granularity: a transformer block)."""

    def __init__(self, tensors: list[torch.Tensor]):
        from dfloat11.dfloat11_utils import encode_weights, get_32bit_codec, get_codec, get_luts
        flat = [t.flatten() for t in tensors]
        _, counter = get_codec(torch.cat(flat))
        codec, _, table = get_32bit_codec(counter)
        luts = get_luts(table)
        encoded, other, positions, gaps, _ = encode_weights(flat, codec, bytes_per_thread=8, threads_per_block=512)
        self.n_el, self.n_bytes, self.n_luts = other.numel(), encoded.numel(), luts.shape[0]
        pos = positions.numpy().view("uint32")
        self.shared = 512 * 4 + 4 + int((pos[1:].astype("int64") - pos[:-1].astype("int64")).max()) * 2
        self.dev = [t.contiguous().view(torch.uint8).cuda() for t in (luts, encoded, other, positions.view(torch.uint8), gaps)]
        self.out = torch.empty(self.n_el, dtype=torch.bfloat16, device="cuda")
        self.grid = (int(math.ceil(self.n_bytes / (512 * 8))),)
        self.stored = sum(t.numel() for t in self.dev)
        self.expected = torch.cat(flat)

    def launch(self) -> None:
        import cupy as cp
        from dfloat11 import dfloat11 as dfl
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            dfl._decode(grid=self.grid, block=(512,), shared_mem=self.shared,
                        args=[d.data_ptr() for d in self.dev] + [self.out.data_ptr(), self.n_luts, self.n_bytes, self.n_el])

    def bit_exact(self) -> bool:
        self.launch()
        torch.cuda.synchronize()
        return torch.equal(self.out.cpu().view(torch.int16), self.expected.view(torch.int16))

    @property
    def ratio(self) -> float:
        return self.stored / (2 * self.n_el)


def dfloat11(layer: dict, repeats: int) -> dict:
    """One launch per transformer layer."""
    d = DFloat11(list(layer.values()))
    exact, per = d.bit_exact(), timed(d.launch)
    return {"ratio": d.ratio, "bit_exact": exact, "GBps_launch_per_layer": 2 * d.n_el / per / 1e9,
            "latency_ms_per_layer": per * 1e3, "layers_decoded": repeats}


def nvcomp_ans(state: dict) -> dict:
    """nvCOMP ANS with data_type '<f2' (its best setting for 16-bit data), one call per tensor."""
    from nvidia import nvcomp
    codec = nvcomp.Codec(algorithm="ANS", data_type="<f2")
    tensors = [t.cuda().view(torch.uint8).reshape(-1) for t in state.values()]
    comp = [codec.encode(nvcomp.as_array(t)) for t in tensors]
    torch.cuda.synchronize()
    dec = [codec.decode(c) for c in comp]
    torch.cuda.synchronize()
    exact = all(torch.equal(torch.from_dlpack(d).view(torch.uint8).reshape(-1), t) for d, t in zip(dec, tensors))
    raw = sum(t.numel() for t in tensors)
    t = timed(lambda: [codec.decode(c) for c in comp], 5)
    return {"ratio": sum(c.buffer_size for c in comp) / raw, "bit_exact": exact, "GBps": raw / t / 1e9,
            "latency_ms": t * 1e3 / len(tensors)}


def seven_b(workdir: Path, n_layers: int) -> dict:
    """A Llama-2-7B-shaped model: from pinned host memory into GPU tensors, copies included."""
    shapes = {"model.embed_tokens.weight": (32000, 4096), **layer_shapes(n_layers), "lm_head.weight": (32000, 4096)}
    state = weights(shapes, seed=7)
    path = workdir / "7b.wcodec"
    t = time.perf_counter()
    stats = compress_state_dict(state, path, workers=16)
    encode_s = time.perf_counter() - t
    with Archive.open(path) as a:
        entries = a.entries
        whole = plans.build(entries, a.path)
        host = torch.empty(whole.end - whole.start, dtype=torch.uint8, pin_memory=True)
        host.numpy()[:] = a.reader.buf[whole.start:whole.end]
    groups = {}
    for e in entries:
        groups.setdefault(e.layer if e.layer is None else e.layer // 4, []).append(e)   # 4 layers a launch
    batch_plans = [plans.build(es, path) for es in groups.values()]       # each its own byte range
    device_buf = torch.empty_like(host, device="cuda")
    copy_stream = torch.cuda.Stream()

    def load():
        decoded, events = {}, []
        for p in batch_plans:
            lo, hi = p.start - whole.start, p.end - whole.start
            with torch.cuda.stream(copy_stream):
                device_buf[lo:hi].copy_(host[lo:hi], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            events.append((p, ev, lo, hi))
        for p, ev, lo, hi in events:
            torch.cuda.current_stream().wait_event(ev)
            decoded.update(cuda_ext.decode_plan(p, device_buf[lo:hi]))
        torch.cuda.synchronize()
        return decoded
    out = load()
    exact = all(torch.equal(out[k].view(torch.int16).cpu(), v.view(torch.int16)) for k, v in list(state.items())[:12])
    del out
    times = []
    for _ in range(5):
        t = time.perf_counter()
        out = load()
        times.append(time.perf_counter() - t)
        del out
    raw = sum(t.nbytes for t in state.values())
    device_buf.copy_(host)                                  # the whole model in bulk: one launch, from GPU memory
    job = cuda_ext.Prepared(whole, device_buf, plans.outputs(whole, "cuda"))
    one_launch = timed(job.run, 3)
    job.check()
    return {"raw_GB": raw / 1e9, "compressed_GB": (whole.end - whole.start) / 1e9, "ratio": stats.file_bytes / raw,
            "encode_s_16_cores": encode_s, "load_s_median": statistics.median(times), "load_s_best": min(times),
            "launches": len(batch_plans), "bit_exact_sampled": exact,
            "one_bulk_launch_from_gpu_GBps": raw / one_launch / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--model-layers", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "decoder": cuda_ext.available().path}
    result["ceilings"] = ceilings()
    print(json.dumps(result), flush=True)
    work = Path(tempfile.mkdtemp(prefix="wcodec-bench-"))
    workloads = {"256x256": {"w": (256, 256)}, "4096x4096": {"w": (4096, 4096)},
                 f"7B-layer x{args.layers}": layer_shapes(args.layers)}
    for name, shapes in workloads.items():
        state = weights(shapes, seed=1)
        row = {"ours": Ours(state, work, name.replace(" ", "_")).run(state)}
        for peer, fn in (("nvcomp_ans", lambda: nvcomp_ans(state)),
                         ("dfloat11", lambda: dfloat11(dict(list(state.items())[:len(LAYER)]), args.layers))):
            try:
                row[peer] = fn()
            except Exception as e:                                    # a peer that fails is reported, not fatal
                row[peer] = {"error": f"{type(e).__name__}: {e}"[:200]}
        result[name] = row
        print(name, json.dumps(row), flush=True)
    result["7B_from_pinned"] = seven_b(work, args.model_layers)
    print("7B", json.dumps(result["7B_from_pinned"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
