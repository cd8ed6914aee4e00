"""`wcodec bench`: our codec against peer codecs, on the same tensors, in one run.

Read me first -- the rules every number follows:
- Every codec sees the same tensors (after `--cast`) and the same thread budget (`threads`).
- Speeds are raw bytes / seconds (MB = 1e6 bytes), each the median of `repeat` runs.
  Ratios are compressed / raw: ours counts the whole archive file, header and padding included.
- Every decode is compared bit-exactly with its input before any number is reported.
- Peers live in `PEERS` (name -> `Peer`); a GPU peer registers itself with `register(Peer(...))`.
- zipnn's `compress` reorders the bytes of its input buffer in place, even of an immutable `bytes`:
  it is handed a fresh copy on every call, made outside the timed region.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from codec import decode
from codec.constants import MAGIC
from codec.encode import compress_state_dict
from codec.sources import open_source

ZIPNN_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
Loader = Callable[[str, int], Any]          # (archive path, threads) -> object with .state_dict


class BenchError(Exception):
    """The benchmark cannot produce an honest number (e.g. a decode is not bit-exact)."""


class DeviceUnavailable(BenchError):
    """The requested decode device cannot be used on this machine."""


@dataclass(frozen=True)
class Workload:
    source: str
    tensors: dict[str, torch.Tensor]
    device: str
    threads: int
    repeat: int

    @property
    def raw_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Peer:
    name: str
    device: str                                 # where the peer's decode runs
    unavailable: Callable[[], str | None]       # why it cannot run here, or None
    run: Callable[[Workload], dict]             # -> {"ratio", "encode_MBps", "decode_MBps", ...}


PEERS: dict[str, Peer] = {}


def register(peer: Peer) -> None:
    PEERS[peer.name] = peer


# --- shared helpers ------------------------------------------------------------------------------


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat uint8 on the CPU (the unit every comparison uses)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def check_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], who: str) -> None:
    if set(expected) != set(got):
        raise BenchError(f"{who}: decoded tensor names differ from the input")
    for name, want in expected.items():
        have = got[name]
        if have.dtype != want.dtype or tuple(have.shape) != tuple(want.shape) \
                or not torch.equal(raw_view(have), raw_view(want)):
            raise BenchError(f"{who}: tensor {name!r} does not decode bit-exact")


def timed(fn: Callable[[], Any], repeat: int, device: str = "cpu") -> tuple[Any, list[float]]:
    """Run fn `repeat` times; its last result and every wall time (synchronized on cuda)."""
    out, seconds = None, []
    for _ in range(max(repeat, 1)):
        out = None                              # free the previous result before the next run
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return out, seconds


def speeds(raw: int, compressed: int, enc_s: list[float], dec_s: list[float]) -> dict:
    enc, dec = statistics.median(enc_s), statistics.median(dec_s)
    return {"ratio": compressed / max(raw, 1),
            "encode_MBps": raw / 1e6 / max(enc, 1e-9), "decode_MBps": raw / 1e6 / max(dec, 1e-9),
            "encode_s": [round(s, 6) for s in enc_s], "decode_s": [round(s, 6) for s in dec_s],
            "compressed_bytes": compressed}


# --- inputs --------------------------------------------------------------------------------------


def is_archive(path: str | os.PathLike) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def fp8_cast(w: torch.Tensor, dtype: torch.dtype, scales: str = "row") -> torch.Tensor:
    """A 2-D weight as fp8 checkpoints store it: divided by per-row (or per-128x128-block) scales
    that map each group's largest magnitude to the format's largest finite value, then cast."""
    top = torch.finfo(dtype).max
    w = w.float()
    if scales == "row":
        return (w / (w.abs().amax(1, keepdim=True) / top).clamp_min(1e-30)).to(dtype)
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % 128, 0, -rows % 128))
    b = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    q = (b / (b.abs().amax((1, 3), keepdim=True) / top).clamp_min(1e-30)).to(dtype)
    return q.reshape(padded.shape)[:rows, :cols].contiguous()


def load_tensors(path: str | os.PathLike, cast: torch.dtype | None = None,
                 gguf_dtype: torch.dtype = torch.bfloat16, fp8_scales: str = "row") -> dict[str, torch.Tensor]:
    """Every tensor of a `.wcodec` archive or a checkpoint source, floats cast to `cast`. An fp8
    `cast` keeps only the 2-D floating tensors (the weights an fp8 checkpoint stores in fp8),
    each cast by fp8_cast with `fp8_scales`: the ratio is then against the raw fp8 bytes."""
    if is_archive(path):
        tensors = decode.load(path).state_dict
    else:
        with open_source(path, gguf_dtype=gguf_dtype) as source:
            tensors = {i.name: source.load(i.name) for i in source.tensors()}
    if cast in FP8_DTYPES:
        return {n: fp8_cast(t, cast, fp8_scales) for n, t in tensors.items() if t.is_floating_point() and t.dim() == 2}
    if cast is not None:
        tensors = {n: t.to(cast) if t.is_floating_point() else t for n, t in tensors.items()}
    return tensors


# --- ours ----------------------------------------------------------------------------------------


def decoder(device: str) -> Loader:
    """Our decoder for `device`: the NumPy reference on the CPU (parallel across tensors), the
    extension's CUDA kernels through the pipelined loader (`wcodec.load`) on cuda."""
    if device == "cpu":
        return lambda path, threads: decode.load(path, workers=threads)
    if device != "cuda":
        raise DeviceUnavailable(f"{device} device unavailable: unknown device")
    if not torch.cuda.is_available():
        raise DeviceUnavailable("cuda device unavailable: torch.cuda.is_available() is False")
    try:
        ext = importlib.import_module("cuda_ext")
    except ImportError as e:
        raise DeviceUnavailable(f"cuda device unavailable: cuda_ext cannot be imported ({e})") from None
    if not ext.available().cuda:
        raise DeviceUnavailable(f"cuda device unavailable: {ext.available().reason}")
    from service.load.pipeline import load_archive
    return lambda path, threads: load_archive(path, "cuda")


def measure_ours(w: Workload, load: Loader) -> dict:
    with tempfile.TemporaryDirectory(prefix="wcodec-bench-") as tmp:
        path = os.path.join(tmp, "bench.wcodec")
        stats, enc_s = timed(lambda: compress_state_dict(w.tensors, path, workers=w.threads), w.repeat)
        model, dec_s = timed(lambda: load(path, w.threads), w.repeat, w.device)
        check_equal(w.tensors, model.state_dict, "wcodec")
        del model
    out = speeds(w.raw_bytes, stats.file_bytes, enc_s, dec_s)
    out.update(file_bytes=stats.file_bytes, stored_bytes=stats.stored_bytes, verify_crc32=True)
    return out


# --- zipnn ---------------------------------------------------------------------------------------


def _zipnn_unavailable() -> str | None:
    return None if importlib.util.find_spec("zipnn") else "zipnn is not installed"


def _zipnn_encode(w: Workload, coders: dict) -> tuple[dict[str, bytes], float]:
    blobs, seconds = {}, 0.0
    for name, t in w.tensors.items():
        coder = coders.get(t.dtype)
        if coder is None or t.numel() == 0:
            continue                            # not a float zipnn knows: counted raw
        buf = bytearray(raw_view(t).numpy().tobytes())      # zipnn reorders its input in place
        t0 = time.perf_counter()
        blobs[name] = coder.compress(buf)
        seconds += time.perf_counter() - t0
    return blobs, seconds


def _zipnn_decode(w: Workload, coders: dict, blobs: dict[str, bytes]) -> tuple[dict, float]:
    out, seconds = {}, 0.0
    for name, blob in blobs.items():
        coder = coders[w.tensors[name].dtype]
        t0 = time.perf_counter()
        out[name] = coder.decompress(blob)
        seconds += time.perf_counter() - t0
    return out, seconds


def _zipnn_check(w: Workload, decoded: dict) -> None:
    for name, data in decoded.items():
        if bytes(data) != raw_view(w.tensors[name]).numpy().tobytes():
            raise BenchError(f"zipnn: tensor {name!r} does not decode bit-exact")


def _zipnn_run(w: Workload) -> dict:
    from zipnn import ZipNN
    coders = {dt: ZipNN(input_format="byte", bytearray_dtype=name, threads=w.threads)
              for dt, name in ZIPNN_DTYPES.items()}
    enc = [_zipnn_encode(w, coders) for _ in range(max(w.repeat, 1))]
    blobs = enc[-1][0]
    dec = [_zipnn_decode(w, coders, blobs) for _ in range(max(w.repeat, 1))]
    _zipnn_check(w, dec[-1][0])
    coded_raw = sum(raw_view(w.tensors[n]).numel() for n in blobs)
    compressed = sum(len(b) for b in blobs.values()) + w.raw_bytes - coded_raw
    return speeds(w.raw_bytes, compressed, [s for _, s in enc], [s for _, s in dec])


register(Peer("zipnn", "cpu", _zipnn_unavailable, _zipnn_run))


# --- one run -------------------------------------------------------------------------------------


def run_peers(w: Workload) -> tuple[dict[str, dict], dict[str, str]]:
    """Every registered peer on the workload: {name: numbers} and {name: why it did not run}."""
    done, skipped = {}, {}
    for name, peer in PEERS.items():
        reason = peer.unavailable()
        if reason is not None:
            skipped[name] = reason
            continue
        try:
            done[name] = {"device": peer.device, **peer.run(w)}
        except Exception as e:  # noqa: BLE001 -- a third-party failure must not sink our numbers
            skipped[name] = f"failed: {type(e).__name__}: {e}"
    return done, skipped


def run_bench(path: str | os.PathLike, *, device: str = "cpu", threads: int = 1, repeat: int = 3,
              cast: torch.dtype | None = None, gguf_dtype: torch.dtype = torch.bfloat16,
              fp8_scales: str = "row") -> dict:
    """Ours and every available peer on the tensors of `path`; one JSON-ready dict."""
    load = decoder(device)                      # fail before any heavy work
    tensors = load_tensors(path, cast, gguf_dtype, fp8_scales)
    w = Workload(os.fspath(path), tensors, device, threads, repeat)
    result = {"source": w.source, "device": device, "threads": threads, "repeat": repeat,
              "cast": None if cast is None else str(cast).removeprefix("torch.")
              + (f" ({fp8_scales} scales)" if cast in FP8_DTYPES else ""),
              "tensors": len(tensors), "raw_bytes": w.raw_bytes}
    result.update(measure_ours(w, load))
    if device == "cpu":
        result["cpp_twin"] = measure_cpp_twin(w)
    result["peers"], result["peers_skipped"] = run_peers(w)
    return result


def measure_cpp_twin(w: Workload) -> dict:
    """The extension's C++ CPU twin, one thread: decode MB/s per thread (beside zipnn's)."""
    ext = importlib.import_module("cuda_ext")
    from service.load.pipeline import load_archive
    avail = ext.available()
    if not avail.cpp:
        return {"skipped": avail.reason}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="wcodec-bench-") as tmp:
            path = os.path.join(tmp, "bench.wcodec")
            compress_state_dict(w.tensors, path, workers=w.threads)
            model, dec_s = timed(lambda: load_archive(path, "cpu", verify=False), w.repeat)
            check_equal(w.tensors, model.state_dict, "wcodec c++ twin")
    finally:
        torch.set_num_threads(threads)
    return {"threads": 1, "decode_MBps_per_thread": w.raw_bytes / 1e6 / statistics.median(dec_s), "decode_s": dec_s}


def format_table(result: dict) -> str:
    """The human summary of `run_bench`'s dict."""
    head = (f"{result['source']}: {result['tensors']} tensors, {result['raw_bytes'] / 1e6:.2f} MB raw"
            f" (cast {result['cast'] or 'none'}), {result['threads']} threads, median of {result['repeat']}")
    rows = [("codec", "device", "ratio", "encode MB/s", "decode MB/s")]
    for name, r in [("wcodec", result), *result["peers"].items()]:
        rows.append((name, r["device"], f"{r['ratio']:.4f}", f"{r['encode_MBps']:.1f}",
                     f"{r['decode_MBps']:.1f}"))
    twin = result.get("cpp_twin", {})
    if "decode_MBps_per_thread" in twin:
        rows.append(("wcodec-c++", "cpu/1 thread", f"{result['ratio']:.4f}", "-", f"{twin['decode_MBps_per_thread']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [head] + ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in rows]
    lines += [f"{name}: skipped ({why})" for name, why in result["peers_skipped"].items()]
    return "\n".join(lines)
