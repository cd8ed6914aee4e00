"""The model registry: every model of the store, its state, and its load / unload jobs.

    available --load--> loading --ok--> ready --unload--> unloading --> available
                           \\--error--> failed --load--> loading

* One job per model at a time (`slot.job`): concurrent loads of a model share it; an unload
  waits for a load in progress, then for the model's in-flight requests (leases), then frees.
* Memory budget (`gpu_memory_budget`, bytes): before a load, the least recently used idle
  ready models are unloaded until the new one fits; if even that cannot make it fit, nothing
  is unloaded and the load is refused (507). Used memory is the decoded bytes of resident
  models, or `torch.cuda.memory_allocated` when that is larger (on CUDA).
* An out-of-memory error during a load fails that load alone (the model ends `failed`).
* Host cache (`host_cache_bytes`; service/hostcache.py): a load keeps its archive's compressed
  bytes in host memory, and the model's next load (a switch back) decodes from there, verified
  again, without reading the file.
Every method runs on the event loop; the blocking work runs in worker threads."""
from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import torch

from codec.decode import Archive
from codec.errors import CodecError

from . import demo, devicecheck, loader, memory, modeling, prefetch, preload, resident
from .engine import Engine, Limits, compute
from .errors import InsufficientMemory, LoadFailed, ModelNotFound, ModelNotReady, ServiceError, ValidationFailed
from .hostcache import HostCache, Use
from .metrics import Metrics
from .settings import Settings
from .store import ModelFile, ModelStore, check_name
from .timeline import Timeline

log = logging.getLogger("wcodec.service")


def _mark(timeline: Timeline, name: str, t0: float, what: str) -> None:
    """A load's timeline, at debug level (WCODEC_LOG_LEVEL=DEBUG) and on the process's timeline."""
    log.debug("load %s: %s at %.3f s", name, what, time.perf_counter() - t0)
    timeline.mark(f"load {name}: {what}")


class ModelState(str, enum.Enum):
    AVAILABLE = "available"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


RESIDENT = (ModelState.LOADING, ModelState.READY, ModelState.UNLOADING)


@dataclass
class Progress:
    phase: str = "idle"            # idle, queued, decoding, building, ready, unloading, failed
    bytes_done: int = 0            # decoded bytes so far
    bytes_total: int = 0


@dataclass
class Slot:
    file: ModelFile
    state: ModelState = ModelState.AVAILABLE
    progress: Progress = field(default_factory=Progress)
    served: modeling.ServedModel | None = None
    engine: Engine | None = None
    stats: loader.LoadStats | None = None
    loaded_at: float | None = None             # wall-clock time of the last successful load
    last_error: str | None = None
    last_used: float = 0.0                     # monotonic; orders eviction
    reserved_bytes: int = 0                    # CUDA: allocator reserve taken by its load
    resident: str = "decoded"                  # resident mode of its current / last load
    resident_bytes: int = 0                    # device bytes of its weights (an estimate while loading)
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    job: asyncio.Task | None = None

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def name(self) -> str:
        return self.file.name

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.done()


class Lease:
    """A reference on a ready model for one request; `release()` is idempotent."""

    def __init__(self, slot: Slot):
        self.slot, self._held = slot, True
        slot.in_flight += 1
        slot.idle.clear()
        slot.last_used = time.monotonic()
        self.served, self.engine = slot.served, slot.engine

    def release(self) -> None:
        if self._held:
            self._held = False
            self.slot.in_flight -= 1
            self.slot.last_used = time.monotonic()
            if self.slot.in_flight == 0:
                self.slot.idle.set()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()           # a job nobody awaited (load ?wait=false) must not warn


class ModelRegistry:
    def __init__(self, settings: Settings, metrics: Metrics, *, timeline: Timeline | None = None,
                 early: dict | None = None):
        self.settings, self.metrics = settings, metrics
        self.timeline = timeline or Timeline()
        self.early = dict(early or {})             # name -> prefetch.EarlyRead or preload.EarlyLoad (first load)
        self.store = ModelStore(settings.model_store)
        self.device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.startup: asyncio.Task | None = None
        self.startup_error: str | None = None
        self._slots: dict[str, Slot] = {}
        self._lock = asyncio.Lock()
        self.host_cache = HostCache(settings.host_cache_budget(), pin=self.device.type == "cuda",
                                    timeline=self.timeline)
        metrics.watch_host_cache(self.host_cache)
        memory.tune_allocator()                    # an unloaded model's host memory goes back (memory.py)

    # --- lookup -------------------------------------------------------------------------------

    def refresh(self) -> list[Slot]:
        """Every model of the store (new files appear, deleted idle ones go)."""
        files = self.store.scan()
        for f in files.values():
            self._track(f)
        for name in [n for n, s in self._slots.items() if n not in files and s.state not in RESIDENT]:
            del self._slots[name]
        return [self._slots[n] for n in sorted(self._slots)]

    def _track(self, f: ModelFile) -> Slot:
        slot = self._slots.get(f.name)
        if slot is None:
            slot = self._slots[f.name] = Slot(f)
            self.metrics.track_model(f.name)
            self.metrics.set_state(f.name, slot.state.value)
        elif slot.state not in RESIDENT:
            slot.file = f
        return slot

    def get(self, name: str) -> Slot:
        check_name(name)
        slot = self._slots.get(name)
        if slot is not None and slot.state in RESIDENT:
            return slot
        f = self.store.find(name)
        if f is None:
            raise ModelNotFound(f"no model {name!r} in the store {self.store.root}")
        return self._track(f)

    def has(self, name: str) -> bool:
        with contextlib.suppress(ModelNotFound, ValidationFailed):
            return self.get(name) is not None
        return False

    def resolve(self, name: str | None) -> str:
        """The model a request means: its own, else the default, else the only ready one."""
        name = name or self.settings.default_model
        if name:
            return name
        ready = [s.name for s in self._slots.values() if s.state is ModelState.READY]
        if len(ready) > 1:
            raise ValidationFailed(f"several models are ready ({', '.join(sorted(ready))}): name one in `model`")
        if not ready:
            raise ModelNotReady("no model is ready", self.settings.retry_after_s)
        return ready[0]

    def acquire(self, name: str) -> Lease:
        slot = self.get(name)
        if slot.state is not ModelState.READY:
            raise ModelNotReady(f"model {name!r} is {slot.state.value}", self.settings.retry_after_s)
        return Lease(slot)

    # --- state ----------------------------------------------------------------------------------

    def _set_state(self, slot: Slot, state: ModelState, phase: str | None = None) -> None:
        slot.state = state
        slot.progress.phase = phase or state.value
        self.metrics.set_state(slot.name, state.value)

    def used_bytes(self, exclude: Slot | None = None) -> int:
        resident = sum(s.resident_bytes for s in self._slots.values() if s.state in RESIDENT and s is not exclude)
        if self.device.type == "cuda":
            return max(resident, torch.cuda.memory_allocated(self.device))
        return resident

    # --- load -----------------------------------------------------------------------------------

    async def load(self, name: str, wait: bool = True, resident: str | None = None) -> Slot:
        """Load a model (shared with a load in progress). `resident`: "decoded" or "compressed"
        (default: the settings'); a ready model is returned as it is, in its mode."""
        slot = self.get(name)
        async with self._lock:
            while slot.busy and slot.state is ModelState.UNLOADING:
                with contextlib.suppress(ServiceError):
                    await asyncio.shield(slot.job)
            if slot.state is ModelState.READY:
                slot.last_used = time.monotonic()
                return slot
            if slot.state is not ModelState.LOADING:
                slot.resident = resident or self.settings.resident
                slot.resident_bytes = self._estimate(slot)
                await self._make_room(slot)
                self._set_state(slot, ModelState.LOADING, "queued")
                slot.progress = Progress("queued", 0, slot.file.decoded_bytes)
                slot.job = asyncio.create_task(self._load_job(slot), name=f"load {name}")
                slot.job.add_done_callback(_retrieve)
        if wait:
            await asyncio.shield(slot.job)
        return slot

    def _estimate(self, slot: Slot) -> int:
        """Device bytes the load will take, from the archive's header."""
        if slot.resident == "decoded":
            return slot.file.decoded_bytes
        with Archive.open(slot.file.path) as archive:
            slots = self.settings.resident_slots if self.device.type == "cuda" else 1
            return resident.estimate_bytes(archive.entries, slots)

    async def _make_room(self, slot: Slot) -> None:
        budget = self.settings.gpu_memory_budget
        need = slot.resident_bytes
        if budget is None or self.used_bytes(slot) + need <= budget:
            return
        used, freed, victims = self.used_bytes(slot), 0, []
        idle = [s for s in self._slots.values() if s.state is ModelState.READY and s.in_flight == 0]
        for other in sorted(idle, key=lambda s: s.last_used):
            victims.append(other)
            freed += other.resident_bytes
            if used - freed + need <= budget:
                break
        else:
            self.metrics.loads.labels(slot.name, "rejected").inc()
            raise InsufficientMemory(f"model {slot.name!r} needs {need} bytes; {used} of the budget of {budget} "
                                     f"bytes are in use and unloading idle models frees only {freed}")
        for other in victims:
            log.info("unloading idle model %s to make room for %s", other.name, slot.name)
            await self._start_unload(other)

    async def _load_job(self, slot: Slot) -> None:
        try:
            served, stats = await asyncio.to_thread(self._load_blocking, slot)
        except (torch.cuda.OutOfMemoryError, MemoryError) as e:
            raise self._failed(slot, InsufficientMemory(f"out of memory while loading {slot.name!r}: {e}"), "oom")
        except CodecError as e:
            raise self._failed(slot, LoadFailed(f"cannot load {slot.name!r}: {e}"), "failed")
        except LoadFailed as e:
            raise self._failed(slot, e, "failed")
        except Exception as e:
            log.exception("loading %s failed", slot.name)
            raise self._failed(slot, LoadFailed(f"cannot load {slot.name!r}: {type(e).__name__}: {e}"), "failed")
        s, mark = self.settings, partial(_mark, self.timeline, slot.name, time.perf_counter())
        mark("back on the event loop")
        slot.served, slot.stats, slot.loaded_at, slot.last_error = served, stats, time.time(), None
        slot.engine = Engine(served, self.metrics, Limits(s.max_batch_size, s.max_batch_tokens, s.max_queue,
                                                          s.batch_wait_ms / 1e3)).start()
        slot.last_used = time.monotonic()
        self._record_load(slot, stats)
        self._set_state(slot, ModelState.READY)
        mark("engine started, ready")

    def _reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def _load_blocking(self, slot: Slot) -> tuple[modeling.ServedModel, loader.LoadStats]:
        t0, reserved = time.perf_counter(), self._reserved()
        slot.progress.phase = "decoding"
        mark = partial(_mark, self.timeline, slot.name, t0)
        mark("started")
        early = self.early.pop(slot.name, None)
        if (isinstance(early, preload.EarlyLoad) and early.matches(slot.file.path, self.device)
                and early.compressed == (slot.resident == "compressed")):
            decoded, ready = early.take(partial(self._on_batch, slot))      # decoded since torch's import
            t0 = early.started
            read = early.hand_over_read()
            if read is not None:                                             # a switch back reads no file
                self.host_cache.adopt(str(slot.file.path), read)
        else:
            decoded, ready = self._decode_and_prepare(slot, mark, early)
        slot.progress.phase = "building"
        mark("skeleton ready")
        on_forward = self.metrics.forward_decode_seconds.labels(slot.name, slot.resident).observe
        served = modeling.finish(slot.name, ready, decoded, self.device, self.settings.resident_slots, on_forward)
        slot.resident_bytes = served.weight_bytes          # the budget counts the archive's dtype (README)
        served = compute.for_cpu(served, self.settings.cpu_dtype)
        mark("weights assigned")
        decoded.stats.total_s = time.perf_counter() - t0
        slot.reserved_bytes = self._reserved() - reserved if self.device.type == "cuda" else served.weight_bytes
        return served, decoded.stats

    def _decode_and_prepare(self, slot: Slot, mark, early) -> tuple[loader.Decoded, modeling.Prepared]:
        """Decode the weights while the skeleton is built on another thread."""
        with Archive.open(slot.file.path) as archive:
            opened = archive.entries, archive.reader.files(self.settings.verify_crc)
        mark("header and files read")
        if isinstance(early, preload.EarlyLoad):              # of another file or device: not used
            early.release()
        early = early if isinstance(early, prefetch.EarlyRead) else None
        s = self.settings
        with ThreadPoolExecutor(1, thread_name_prefix="wcodec-prepare") as pool:
            prepared = pool.submit(modeling.prepare, slot.name, opened[1])
            with self.host_cache.use(str(slot.file.path), verify=devicecheck.on_host(self.device, s.verify_crc),
                                     threads=s.read_threads(), direct=s.direct_io(), early=early) as cached:
                self._count_cache(slot, cached)
                mark(f"archive bytes from: {cached.source}")
                decoded = loader.decode_archive(slot.file.path, self.device, ring=s.load_ring_buffers,
                                                verify=s.verify_crc, on_batch=partial(self._on_batch, slot),
                                                opened=opened, mark=mark, early=cached.read,
                                                direct=s.direct_io(), threads=s.read_threads(),
                                                compressed=slot.resident == "compressed")
            decoded.stats.source = cached.source
            return decoded, prepared.result()

    def _count_cache(self, slot: Slot, cached: Use) -> None:
        if cached.looked:
            (self.metrics.host_cache_hits if cached.hit else self.metrics.host_cache_misses).labels(slot.name).inc()

    def _on_batch(self, slot: Slot, batch: loader.Batch, seconds: float) -> None:
        """Runs on the loading thread after each decoded layer batch."""
        slot.progress.bytes_done += batch.decoded_bytes
        device, m = self.device.type, self.metrics
        m.decode_seconds.labels(slot.name, batch.codec, device).observe(seconds)
        for e in batch.entries:
            m.decode_compressed.labels(slot.name, e.codec, device).inc(sum(s["length"] for s in e.streams.values()))
            m.decode_decoded.labels(slot.name, e.codec, device).inc(e.nbytes)

    def _record_load(self, slot: Slot, stats: loader.LoadStats) -> None:
        for phase, seconds in stats.phases().items():
            self.metrics.load_seconds.labels(slot.name, phase).observe(seconds)
        self.metrics.load_throughput.labels(slot.name).set(stats.decoded_bytes / max(stats.total_s, 1e-9))
        self.metrics.loads.labels(slot.name, "ok").inc()
        self.metrics.set_memory(slot.name, self.device.type, slot.served.weight_bytes, max(slot.reserved_bytes, 0))
        for mode in ("decoded", "compressed"):
            self.metrics.resident_bytes.labels(slot.name, mode).set(slot.served.weight_bytes if mode == slot.resident else 0)
        slot.progress.bytes_done = slot.progress.bytes_total

    def _failed(self, slot: Slot, error: ServiceError, result: str) -> ServiceError:
        slot.last_error = error.message
        self.metrics.loads.labels(slot.name, result).inc()
        self._set_state(slot, ModelState.FAILED)
        self._free_memory()
        return error

    def _free_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):      # the engine thread's matmul workspace
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
        memory.release()

    # --- unload ---------------------------------------------------------------------------------

    async def unload(self, name: str) -> Slot:
        slot = self.get(name)
        while slot.busy:                           # a load or an unload in progress
            with contextlib.suppress(ServiceError):
                await asyncio.shield(slot.job)
        if slot.state is ModelState.READY:
            await self._start_unload(slot)
        elif slot.state is ModelState.FAILED:
            self._set_state(slot, ModelState.AVAILABLE)
        return slot

    async def _start_unload(self, slot: Slot) -> None:
        slot.job = asyncio.create_task(self._unload_job(slot), name=f"unload {slot.name}")
        await asyncio.shield(slot.job)

    async def _unload_job(self, slot: Slot) -> None:
        self._set_state(slot, ModelState.UNLOADING)
        await slot.idle.wait()                     # in-flight requests finish first
        engine, served, slot.engine, slot.served = slot.engine, slot.served, None, None
        if engine is not None:
            await asyncio.to_thread(engine.close)
        if served is not None:                     # a request still unwinding may hold `served`:
            served.model.to("meta")                # it keeps a skeleton, the weights go now
            if served.schedule is not None:        # compressed mode: hooks, slots, kept streams
                served.schedule.remove()
                served.schedule = None
        del engine, served
        await asyncio.to_thread(self._free_memory)
        self.metrics.set_memory(slot.name, self.device.type, 0, 0)
        self.metrics.resident_bytes.labels(slot.name, slot.resident).set(0)
        slot.progress = Progress()
        self._set_state(slot, ModelState.AVAILABLE)

    # --- start-up and shutdown ------------------------------------------------------------------

    async def start(self) -> None:
        """Build the demo into an empty store (WCODEC_DEMO), then load the preload list."""
        try:
            await asyncio.to_thread(modeling.warm_up, self.device, self.timeline)
            if self.settings.demo:
                await asyncio.to_thread(demo.ensure_demo, self.store.root, self.settings.demo_workers)
            for name in self._preload_names():
                await self.load(name)
            self.timeline.mark("start-up: preloads done")
        except Exception as e:                     # a background task: report it, keep serving
            self.startup_error = str(e)
            log.exception("start-up failed")
        finally:
            while self.early:                      # preloads that did not use theirs
                self.early.popitem()[1].release()

    def _preload_names(self) -> list[str]:
        if self.settings.preload is not None:
            return self.settings.preload
        demo_file = self.store.root / f"{demo.DEMO_NAME}.wcodec"
        return [demo.DEMO_NAME] if self.settings.demo and demo_file.is_file() else []

    async def close(self) -> None:
        if self.startup is not None:
            self.startup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.startup
        for slot in list(self._slots.values()):
            while slot.busy:
                with contextlib.suppress(Exception):
                    await asyncio.shield(slot.job)
            if slot.engine is not None:
                await asyncio.to_thread(slot.engine.close)
            slot.engine = slot.served = None
        self.host_cache.clear()
        self._free_memory()
