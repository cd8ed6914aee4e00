"""Early loads: a preloaded model decoded (and its skeleton built) right after torch's import, on
its own thread, while the main thread still imports the service and uvicorn starts. The loader
(job.py) takes the result when the registry's start-up loads that model (`take`), instead of
loading it again.

    early read (early_read.py, from the first instant) -> decode_archive(early=...)  ┐
                                                        prepare (tokenizer, meta) ┘-> take() -> finish()

Errors are kept and raised by `take()`, so a corrupt archive fails its load, typed, exactly as a
load started by the registry would; `release()` drops a result nobody took."""
from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..timeline import Timeline
from .early_pin import EarlyPin
from .early_read import EarlyRead
from .reading import identity


class EarlyLoad:
    def __init__(self, name: str, path: str, device: torch.device, settings, early: EarlyRead | None,
                 timeline: Timeline, pin: EarlyPin | None = None):
        self.name, self.path, self.device, self.timeline, self.pin = name, path, device, timeline, pin
        self.identity = identity(path)
        self.weights = settings.weights                              # preloads use the default weights mode
        self.context = settings.max_total_tokens
        self.read = early if early is not None and settings.host_cache_budget() > 0 else None
        if self.read is not None:
            self.read.kept = True              # not freed after the load: the host cache may adopt it
        self.started = time.perf_counter()
        self.batches: list[tuple[object, float]] = []
        self._result: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(settings, early), name=f"wcodec-early-load-{name}",
                                        daemon=True)
        self._thread.start()

    def _mark(self, what: str) -> None:
        self.timeline.mark(f"early load {self.name}: {what}")

    def _run(self, settings, early: EarlyRead | None) -> None:
        try:
            self._result.set_result(self._load(settings, early))
        except BaseException as e:  # noqa: BLE001  (raised by take())
            if early is not None:
                early.release()
            self.drop_read()
            self._result.set_exception(e)

    def _load(self, settings, early: EarlyRead | None):
        import cuda_ext
        from codec.decode import Archive

        from ..model import fixed, fp8
        from . import pipeline
        with Archive.open(self.path) as archive:
            opened = archive.entries, archive.reader.files(settings.verify_crc)
        self._mark("header and files read")
        with ThreadPoolExecutor(1, thread_name_prefix="wcodec-pin") as side:
            pinned = side.submit(self._pin, settings.load_ring_buffers, opened[0]) if self.device.type == "cuda" else None
            with self.timeline.span("early load: import cuda_ext (decoder extension)"):
                cuda_ext.available()
            if pinned is not None:
                pinned.result()
        with ThreadPoolExecutor(1, thread_name_prefix="wcodec-prepare") as pool:
            prepared = pool.submit(self._prepare, opened[1])
            decoded = pipeline.decode_archive(self.path, self.device, ring=settings.load_ring_buffers,
                                            verify=settings.verify_crc, opened=opened, early=early,
                                            on_batch=lambda batch, seconds: self.batches.append((batch, seconds)),
                                            mark=self._mark, direct=settings.direct_io(),
                                            threads=settings.read_threads(), compressed=self.weights == "compressed",
                                            form=fixed.form_for(settings.compressed_form, self.device),
                                            fp8_scheme=fp8.scheme_of(*opened, self.name))
            ready = prepared.result()
        self._mark("weights decoded, skeleton ready")
        return decoded, ready

    def _pin(self, ring: int, entries) -> None:
        """The CUDA context and the load's pinned ring buffers, beside the extension's import; then
        the forward's first kernels on a thread that nothing waits for. (service.model.build is
        imported there: the main thread may be importing it, which would block this one.)"""
        from . import pipeline
        with self.timeline.span("early load: CUDA context"):
            torch.empty(1, device=self.device)
        if self.pin is not None:                   # made while torch was imported (early_pin.py)
            pipeline.PINNED.give(self.pin.take())
        with self.timeline.span("early load: pinned ring buffers"):
            pipeline.PINNED.reserve(*pipeline.ring_shape(ring, pipeline.layer_batches(entries)))
        threading.Thread(target=self._first_kernels, args=(_dtype(entries),), name="wcodec-first-kernels",
                         daemon=True).start()

    def _first_kernels(self, dtype: torch.dtype) -> None:
        from ..model import build
        build.first_kernels(self.device, dtype, self.timeline)

    def _prepare(self, files: dict[str, bytes]):
        from ..model import build
        with self.timeline.span(f"early load {self.name}: tokenizer and skeleton"):
            return build.prepare(self.name, files, self.context)

    def matches(self, path, device: torch.device) -> bool:
        try:
            return os.path.abspath(path) == os.path.abspath(self.path) and device == self.device \
                and identity(path) == self.identity
        except OSError:
            return False

    def take(self, on_batch: Callable[[object, float], None]):
        """(Decoded, Prepared) once ready; replays the per-batch callbacks; raises the load's error."""
        decoded, ready = self._result.result()
        for batch, seconds in self.batches:
            on_batch(batch, seconds)
        return decoded, ready

    def release(self) -> None:
        self._thread.join()
        self._result = Future()
        self.drop_read()

    def hand_over_read(self) -> EarlyRead | None:
        """The start-up read, kept after the load, for the host cache to adopt (once)."""
        read, self.read = self.read, None
        return read

    def drop_read(self) -> None:
        """Free the start-up read unless it was handed over."""
        read = self.hand_over_read()
        if read is not None:
            read.kept = False
            read.free()


def _dtype(entries) -> torch.dtype:
    """The dtype of most of an archive's decoded bytes (its forward's matmuls); float8 weights are
    left out: they are served in the model's dtype (fp8.py), and no forward runs in float8."""
    weight: collections.Counter[torch.dtype] = collections.Counter()
    for e in entries:
        if e.torch_dtype.itemsize > 1:
            weight[e.torch_dtype] += e.nbytes
    found = weight.most_common(1)[0][0] if weight else torch.bfloat16
    return found if found.is_floating_point else torch.bfloat16


def start_early_loads(early_reads: dict[str, EarlyRead], paths: dict[str, str], settings, device: torch.device,
                      timeline: Timeline, pin: EarlyPin | None = None) -> dict[str, EarlyLoad]:
    """An early load per preloaded model (each with its early read, if any; the first to need a
    ring takes `pin`'s buffers)."""
    pin = pin if device.type == "cuda" else None
    return {name: EarlyLoad(name, path, device, settings, early_reads.pop(name, None), timeline, pin)
            for name, path in paths.items()}
