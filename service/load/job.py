"""One model's load, archive -> servable model on the device: the registry's one entry point into
this room (`Loader`). Read me first.

    early load taken (early_load.py)  ─┐
    or: host cache / file -> pipeline  ├─> model.build.finish -> CPU dtype -> Loaded
        beside model.build.prepare    ─┘

* A preloaded model's first load takes its early load (decoded since torch's import), when it is
  of this very file, device and weights mode; its start-up read goes to the host cache.
* Otherwise the weights are decoded through the pipeline (pipeline.py) from the host cache or
  the file, while the tokenizer and meta skeleton are built on another thread.
* Per-batch decode metrics, host cache hits and the load's own metrics are recorded here; the
  registry only moves the model's state.
Everything but `estimate_bytes` blocks: the registry runs it in a worker thread."""
from __future__ import annotations

import gc
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from codec.decode import Archive
from codec.errors import CodecError

from ..errors import LoadFailed
from ..metrics import Metrics
from ..model import build, compressed, cpu_dtype, device_wide, fixed, fp8, fp8_linear, llama
from ..settings import Settings
from ..timeline import Timeline
from . import devicecheck, memory, pipeline
from .early_load import EarlyLoad
from .hostcache import HostCache
from .pipeline import Decoded, LoadStats
from .ring import Batch

log = logging.getLogger("wcodec.service")


@dataclass
class Progress:
    phase: str = "idle"            # idle, queued, decoding, building, ready, unloading, failed
    bytes_done: int = 0            # decoded bytes so far
    bytes_total: int = 0


@dataclass
class Loaded:
    served: build.ServedModel
    stats: LoadStats
    reserved_bytes: int            # CUDA: allocator reserve the load took; CPU: the weights' bytes


class Loader:
    def __init__(self, settings: Settings, metrics: Metrics, device: torch.device, timeline: Timeline,
                 early: dict[str, EarlyLoad] | None = None):
        self.settings, self.metrics, self.device, self.timeline = settings, metrics, device, timeline
        self.early = dict(early or {})             # name -> the start-up's early load (its first load)
        self.host_cache = HostCache(settings.host_cache_budget(), pin=device.type == "cuda", timeline=timeline)
        metrics.watch_host_cache(self.host_cache)
        memory.tune_allocator()                    # an unloaded model's host memory goes back (memory.py)

    def estimate_bytes(self, path, weights: str) -> int:
        """Device bytes the load will take, every buffer it makes included, from the archive's
        header and config.json (whether llama.py or transformers' classes serve the model: the
        latter hold GGUF blocks and the fixed-rate form decoded): the weights as held, decoded or
        compressed, and what the CPU's compute adds to them (cpu_dtype.added_bytes: the float32
        cast, linear16's packed copy of a tied head, the mixed matmul's scratch). The registry
        charges it before the load and checks the load's own figure against it after."""
        with Archive.open(path) as archive:
            entries, config = archive.entries, _config(archive)
        form, native = self._form(), llama.native_config(config, self.settings.max_total_tokens)
        scheme = _fp8_scheme(config, entries)              # fp8 weights held dequantized, or kept (fp8_linear.py)
        keeps_fp8 = weights == "compressed" and native is not None and scheme is not None \
            and fp8_linear.available(self.device)
        entries = fp8.served_entries(entries, scheme, fp8_linear.served_bytes(entries, scheme) if keeps_fp8 else None)
        if weights == "decoded" and self.device.type != "cpu":
            return sum(e.nbytes for e in entries)
        blocks, floats = compressed.kept_entries(entries, form, native is not None)
        held = "compressed" if weights == "compressed" and blocks + floats else "decoded"
        if held == "decoded":
            need, blocks = sum(e.nbytes for e in entries), []
        else:
            scratch = self.settings.compressed_scratch if self.device.type == "cuda" else 1
            host = fixed.host_names(native) if form == "fixed" else frozenset()
            need = compressed.estimate_bytes(entries, scratch, form, host, native is not None)
        return need + cpu_dtype.added_bytes(_held(entries, native, held, blocks), self.device, self.settings.cpu_dtype)

    def _form(self) -> str:
        return fixed.form_for(self.settings.compressed_form, self.device)

    def warm_up(self) -> None:
        build.warm_up(self.device, self.timeline)

    def load(self, name: str, path, weights: str, progress: Progress) -> Loaded:
        t0, reserved = time.perf_counter(), self._reserved()
        progress.phase = "decoding"
        mark = partial(self._mark, name, t0)
        mark("started")
        on_batch = partial(self._on_batch, name, progress)
        early = self.early.pop(name, None)
        if early is not None and early.matches(path, self.device) and early.weights == weights:
            decoded, ready = early.take(on_batch)          # decoded since torch's import
            t0 = early.started
            read = early.hand_over_read()
            if read is not None:                           # a switch back reads no file
                self.host_cache.adopt(str(path), read)
        else:
            if early is not None:                          # of another file, device or mode: not used
                early.release()
            decoded, ready = self._decode_and_prepare(name, path, weights, on_batch, mark)
        progress.phase = "building"
        mark("skeleton ready")
        served = self._build(name, weights, decoded, ready)
        mark("model assembled")
        served = cpu_dtype.for_cpu(served, self.settings.cpu_dtype)
        mark("weights assigned")
        decoded.stats.total_s = time.perf_counter() - t0
        cuda = self.device.type == "cuda"
        loaded = Loaded(served, decoded.stats, self._reserved() - reserved if cuda else served.weight_bytes)
        self._record(name, loaded, progress)
        return loaded

    def _build(self, name: str, weights: str, decoded: Decoded, ready: build.Prepared) -> build.ServedModel:
        t0 = time.perf_counter()
        on_forward = self.metrics.forward_decode_seconds.labels(name, weights).observe
        served = build.finish(name, ready, decoded.tensors, decoded.layers, self.device,
                              self.settings.compressed_scratch, on_forward, decoded.blocks, decoded.fixed, decoded.fp8)
        decoded.stats.build_s = ready.seconds + time.perf_counter() - t0
        return served

    def _decode_and_prepare(self, name: str, path, weights: str, on_batch, mark) -> tuple[Decoded, build.Prepared]:
        """Decode the weights while the skeleton is built on another thread."""
        s = self.settings
        with Archive.open(path) as archive:
            opened = archive.entries, archive.reader.files(s.verify_crc)
        mark("header and files read")
        fp8_scheme = fp8.scheme_of(*opened, name)                # a quantization it cannot serve: refused here
        with ThreadPoolExecutor(1, thread_name_prefix="wcodec-prepare") as pool:
            prepared = pool.submit(build.prepare, name, opened[1], s.max_total_tokens)
            with self.host_cache.use(str(path), verify=devicecheck.on_host(self.device, s.verify_crc),
                                     threads=s.read_threads(), direct=s.direct_io()) as cached:
                if cached.looked:
                    (self.metrics.host_cache_hits if cached.hit else self.metrics.host_cache_misses).labels(name).inc()
                mark(f"archive bytes from: {cached.source}")
                decoded = pipeline.decode_archive(path, self.device, ring=s.load_ring_buffers, verify=s.verify_crc,
                                         on_batch=on_batch, opened=opened, mark=mark, early=cached.read,
                                         direct=s.direct_io(), threads=s.read_threads(),
                                         compressed=weights == "compressed", form=self._form(),
                                         fp8_scheme=fp8_scheme)
            decoded.stats.source = cached.source
            return decoded, prepared.result()

    def _mark(self, name: str, t0: float, what: str) -> None:
        """A load's timeline, at debug level (WCODEC_LOG_LEVEL=DEBUG) and on the process's timeline."""
        log.debug("load %s: %s at %.3f s", name, what, time.perf_counter() - t0)
        self.timeline.mark(f"load {name}: {what}")

    def _on_batch(self, name: str, progress: Progress, batch: Batch, seconds: float) -> None:
        """Runs on the loading thread after each decoded layer batch."""
        progress.bytes_done += batch.decoded_bytes
        device, m = self.device.type, self.metrics
        m.decode_seconds.labels(name, batch.codec, device).observe(seconds)
        for e in batch.entries:
            m.decode_compressed.labels(name, e.codec, device).inc(sum(s["length"] for s in e.streams.values()))
            m.decode_decoded.labels(name, e.codec, device).inc(e.nbytes)

    def _record(self, name: str, loaded: Loaded, progress: Progress) -> None:
        stats, served = loaded.stats, loaded.served
        for phase, seconds in stats.phases().items():
            self.metrics.load_seconds.labels(name, phase).observe(seconds)
        self.metrics.load_throughput.labels(name).set(stats.decoded_bytes / max(stats.total_s, 1e-9))
        self.show_memory(name, served, loaded.reserved_bytes)
        progress.bytes_done = progress.bytes_total

    def show_memory(self, name: str, served: build.ServedModel, reserved_bytes: int) -> None:
        """The memory metrics of the version that serves `name` (a failed reload's load had
        replaced the loaded version's)."""
        self.metrics.set_memory(name, self.device.type, served.weight_bytes, max(reserved_bytes, 0))
        self.metrics.set_weight_bytes(name, served.weights, served.weight_bytes, served.host_bytes)

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def unloaded(self, name: str) -> None:
        """A model's weights were released (ServedModel.release): give the memory back, zero its
        memory metrics."""
        self.free_memory()
        self.metrics.set_memory(name, self.device.type, 0, 0)
        self.metrics.set_weight_bytes(name, None, 0)

    def free_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            with device_wide.LOCK:                                     # never beside an engine's capture
                torch.cuda.synchronize(self.device)
                if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # the engine thread's matmul workspace
                    torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
        memory.release()

    def release_early(self) -> None:
        """Start-up is over: free the early loads that no load took."""
        while self.early:
            self.early.popitem()[1].release()

    def close(self) -> None:
        self.release_early()
        self.host_cache.clear()
        self.free_memory()


def _held(entries, native: llama.LlamaConfig | None, weights: str, blocks: list) -> cpu_dtype.Held:
    """The model a load will hold as `weights` (`blocks`: the entries it keeps as GGUF blocks),
    as the CPU's compute setting will meet it: its dtype (ServedModel.dtype: the blocks', else
    the first parameter's, the embedding table's) and, where llama.py serves it, its Linears."""
    table = [e for e in entries if e.name == llama.EMBEDDING] or entries[:1]
    dtype = blocks[0].torch_dtype if blocks else table[0].torch_dtype if table else torch.float32
    if native is None:                             # transformers' classes: no Linear of llama.py's
        return cpu_dtype.Held(weights, dtype, entries)
    linears, shared = llama.linear_weights(native, entries)
    ids = {id(e) for e in blocks}
    return cpu_dtype.Held(weights, dtype, entries, linears, shared, [e for e in linears if id(e) in ids])


def _fp8_scheme(config: dict | None, entries) -> fp8.Scheme | None:
    """fp8.scheme, None for a quantization that cannot be served (its load refuses it, saying why)."""
    try:
        return fp8.scheme(config, entries)
    except LoadFailed:
        return None


def _config(archive: Archive) -> dict | None:
    """The archive's embedded config.json (unchecked: the load checks every stream), None if it
    has none or it is not a JSON object."""
    rec = archive.reader.header.get("files", {}).get("config.json")
    if rec is None:
        return None
    try:
        config = json.loads(archive.reader.checked_stream(rec, "file 'config.json'", False).tobytes())
    except (ValueError, CodecError):
        return None
    return config if isinstance(config, dict) else None
