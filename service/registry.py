"""The model registry: every model of the store, its state, and its load / unload jobs.

    available --load--> loading --ok--> ready --unload--> unloading --> available
                           \\--error--> failed --load--> loading

* One job per model at a time (`entry.job`): concurrent loads of a model share it; an unload
  waits for a load in progress, then for the model's in-flight requests (leases), then frees.
* Memory budget (`gpu_memory_budget`, bytes): before a load, the least recently used idle
  ready models are unloaded until the new one fits; if even that cannot make it fit, nothing
  is unloaded and the load is refused (507). Used memory is the weight bytes of resident
  models as held (their `weight_bytes`: the load's estimate from the header while it runs, every
  buffer the load makes included, then the figure the metrics report, which is no more; a load
  that took more is logged as an error, and fails where the budget cannot hold it), or
  `torch.cuda.memory_allocated` when that is larger (on CUDA).
* A load that fails anywhere, its engine's start (the KV cache) included, fails that load alone:
  the model ends `failed` with its error (507 for out of memory, else 500), and what the load had
  made is freed before the error is answered.
The load itself (early loads, the host cache, the decode, the model's build) is service/load/'s
(`Loader`), run in a worker thread; this file only moves states. Every method runs on the event
loop."""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import traceback
from dataclasses import dataclass, field

import torch

from codec.errors import CodecError

from .engine import Engine, limits
from .errors import InsufficientMemory, LoadFailed, ModelNotFound, ModelNotReady, ServiceError, ValidationFailed
from .load import demo
from .load.early_load import EarlyLoad
from .load.job import Loaded, Loader, LoadStats, Progress
from .load.store import ModelFile, ModelStore, check_name
from .metrics import Metrics
from .model.build import ServedModel
from .settings import Settings
from .timeline import Timeline

log = logging.getLogger("wcodec.service")


class ModelState(str, enum.Enum):
    AVAILABLE = "available"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


HOLDS_MEMORY = (ModelState.LOADING, ModelState.READY, ModelState.UNLOADING)   # states with weights on the device


@dataclass
class ModelEntry:
    file: ModelFile
    state: ModelState = ModelState.AVAILABLE
    progress: Progress = field(default_factory=Progress)
    served: ServedModel | None = None
    engine: Engine | None = None
    stats: LoadStats | None = None
    loaded_at: float | None = None             # wall-clock time of the last successful load
    last_error: str | None = None
    last_used: float = 0.0                     # monotonic; orders eviction
    reserved_bytes: int = 0                    # CUDA: allocator reserve taken by its load
    weights: str = "decoded"                   # how its weights are held: "decoded" or "compressed"
    weight_bytes: int = 0                      # device bytes of its weights as held (an estimate while loading)
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

    def __init__(self, entry: ModelEntry):
        self.entry, self._held = entry, True
        entry.in_flight += 1
        entry.idle.clear()
        entry.last_used = time.monotonic()
        self.served, self.engine = entry.served, entry.engine

    def release(self) -> None:
        if self._held:
            self._held = False
            self.entry.in_flight -= 1
            self.entry.last_used = time.monotonic()
            if self.entry.in_flight == 0:
                self.entry.idle.set()


def _forget_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames that a failed load's exceptions (and those they
    chain) hold: the tensors it had decoded, its model, would else live as long as the job's
    exception, until the model's next load (and in torch.cuda.memory_allocated, which the budget
    reads, meanwhile)."""
    while error is not None:
        traceback.clear_frames(error.__traceback__)
        error = error.__context__


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()           # a job nobody awaited (load ?wait=false) must not warn


class ModelRegistry:
    def __init__(self, settings: Settings, metrics: Metrics, *, timeline: Timeline | None = None,
                 early: dict[str, EarlyLoad] | None = None):
        self.settings, self.metrics = settings, metrics
        self.timeline = timeline or Timeline()
        self.store = ModelStore(settings.model_store)
        self.device = settings.torch_device()
        self.loader = Loader(settings, metrics, self.device, self.timeline, early)
        self.startup: asyncio.Task | None = None
        self.startup_error: str | None = None
        self._entries: dict[str, ModelEntry] = {}
        self._lock = asyncio.Lock()

    @property
    def host_cache(self):
        return self.loader.host_cache

    # --- lookup -------------------------------------------------------------------------------

    def refresh(self) -> list[ModelEntry]:
        """Every model of the store (new files appear, deleted idle ones go)."""
        files = self.store.scan()
        for f in files.values():
            self._track(f)
        for name in [n for n, s in self._entries.items() if n not in files and s.state not in HOLDS_MEMORY]:
            del self._entries[name]
            self.metrics.untrack_model(name)
        return [self._entries[n] for n in sorted(self._entries)]

    def _track(self, f: ModelFile) -> ModelEntry:
        entry = self._entries.get(f.name)
        if entry is None:
            entry = self._entries[f.name] = ModelEntry(f)
            self.metrics.track_model(f.name)
            self.metrics.set_state(f.name, entry.state.value)
        elif entry.state not in HOLDS_MEMORY:
            entry.file = f
        return entry

    def get(self, name: str) -> ModelEntry:
        check_name(name)
        entry = self._entries.get(name)
        if entry is not None and entry.state in HOLDS_MEMORY:
            return entry
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
        ready = [s.name for s in self._entries.values() if s.state is ModelState.READY]
        if len(ready) > 1:
            raise ValidationFailed(f"several models are ready ({', '.join(sorted(ready))}): name one in `model`")
        if not ready:
            raise ModelNotReady("no model is ready", self.settings.retry_after_s)
        return ready[0]

    def acquire(self, name: str) -> Lease:
        entry = self.get(name)
        if entry.state is not ModelState.READY:
            loads = entry.state in (ModelState.AVAILABLE, ModelState.FAILED)
            how = f": POST /models/{name}/load loads it" if loads else ""
            raise ModelNotReady(f"model {name!r} is not ready (state {entry.state.value}){how}",
                                self.settings.retry_after_s)
        return Lease(entry)

    # --- state ----------------------------------------------------------------------------------

    def _set_state(self, entry: ModelEntry, state: ModelState, phase: str | None = None) -> None:
        entry.state = state
        entry.progress.phase = phase or state.value
        self.metrics.set_state(entry.name, state.value)

    def charged_bytes(self, exclude: ModelEntry | None = None) -> int:
        """The weight bytes the budget charges the models that hold memory (but `exclude`)."""
        return sum(e.weight_bytes for e in self._entries.values() if e.state in HOLDS_MEMORY and e is not exclude)

    def used_bytes(self, exclude: ModelEntry | None = None) -> int:
        held = self.charged_bytes(exclude)
        if self.device.type == "cuda":
            return max(held, torch.cuda.memory_allocated(self.device))
        return held

    # --- load -----------------------------------------------------------------------------------

    async def load(self, name: str, wait: bool = True, weights: str | None = None) -> ModelEntry:
        """Load a model (shared with a load in progress). `weights`: "decoded" or "compressed"
        (default: the settings'); a ready model is returned as it is, held as it is. A load of a
        model being unloaded waits for the unload outside the lock, so other models' loads go on."""
        entry = self.get(name)
        while True:
            while entry.busy and entry.state is ModelState.UNLOADING:
                with contextlib.suppress(ServiceError):
                    await asyncio.shield(entry.job)
            async with self._lock:
                if entry.busy and entry.state is ModelState.UNLOADING:     # one began meanwhile
                    continue
                if entry.state is ModelState.READY:
                    entry.last_used = time.monotonic()
                    return entry
                if entry.state is not ModelState.LOADING:
                    await self._start_load(entry, weights)
            break
        if wait:
            await asyncio.shield(entry.job)
        return entry

    async def _start_load(self, entry: ModelEntry, weights: str | None) -> None:
        """Budget the load (evicting idle models where it must), then start its job (lock held)."""
        entry.weights = weights or self.settings.weights
        try:                                        # compressed: the archive's header says how much
            entry.weight_bytes = self.loader.estimate_bytes(entry.file.path, entry.weights,
                                                            entry.file.decoded_bytes)
        except CodecError as e:
            raise self._failed(entry, LoadFailed(f"cannot load {entry.name!r}: {e}"), "failed") from None
        await self._make_room(entry)
        self._set_state(entry, ModelState.LOADING, "queued")
        entry.progress = Progress("queued", 0, entry.file.decoded_bytes)
        entry.job = asyncio.create_task(self._load_job(entry), name=f"load {entry.name}")
        entry.job.add_done_callback(_retrieve)

    async def _make_room(self, entry: ModelEntry) -> None:
        budget = self.settings.gpu_memory_budget
        need = entry.weight_bytes
        if budget is None or self.used_bytes(entry) + need <= budget:
            return
        used, freed, victims = self.used_bytes(entry), 0, []
        idle = [e for e in self._entries.values() if e.state is ModelState.READY and e.in_flight == 0]
        for other in sorted(idle, key=lambda e: e.last_used):
            victims.append(other)
            freed += other.weight_bytes
            if used - freed + need <= budget:
                break
        else:
            self.metrics.loads.labels(entry.name, "rejected").inc()
            raise InsufficientMemory(f"model {entry.name!r} needs {need} bytes; {used} of the budget of {budget} "
                                     f"bytes are in use and unloading idle models frees only {freed}")
        for other in victims:                       # all UNLOADING before the first await: none
            log.info("unloading idle model %s to make room for %s", other.name, entry.name)
            self._begin_unload(other)               # takes a new request meanwhile (503 instead)
        for other in victims:
            await asyncio.shield(other.job)

    async def _load_job(self, entry: ModelEntry) -> None:
        loaded = None
        try:
            loaded = await asyncio.to_thread(self.loader.load, entry.name, entry.file.path, entry.weights,
                                             entry.progress)
            self.timeline.mark(f"load {entry.name}: back on the event loop")
            self._check_charge(entry, loaded.served)
            engine = Engine(loaded.served, self.metrics, limits(self.settings), self.timeline).start()
        except Exception as e:
            error, result = self._load_error(entry, e)
            _forget_frames(e)                      # their locals hold what the load had decoded
        else:
            self._ready(entry, loaded, engine)
            return
        if loaded is not None:                     # built, then refused (its charge) or its engine did not start
            loaded.served.release()
        del loaded
        await asyncio.to_thread(self.loader.unloaded, entry.name)     # memory back before the answer
        raise self._failed(entry, error, result)

    def _load_error(self, entry: ModelEntry, e: Exception) -> tuple[ServiceError, str]:
        """The typed error of a failed load, and its wcodec_model_loads_total result."""
        if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
            return InsufficientMemory(f"out of memory while loading {entry.name!r}: {e}"), "oom"
        if isinstance(e, InsufficientMemory):               # _check_charge
            return e, "oom"
        if isinstance(e, LoadFailed):
            return e, "failed"
        if isinstance(e, CodecError):
            return LoadFailed(f"cannot load {entry.name!r}: {e}"), "failed"
        log.exception("loading %s failed", entry.name)
        return LoadFailed(f"cannot load {entry.name!r}: {type(e).__name__}: {e}"), "failed"

    def _ready(self, entry: ModelEntry, loaded: Loaded, engine: Engine) -> None:
        entry.served, entry.stats, entry.reserved_bytes = loaded.served, loaded.stats, loaded.reserved_bytes
        entry.weights = loaded.served.weights                  # as held: an int8 archive's stay decoded
        entry.weight_bytes = loaded.served.weight_bytes        # as held: the estimate or less (_check_charge)
        entry.loaded_at, entry.last_error = time.time(), None
        entry.engine, entry.last_used = engine, time.monotonic()
        self.metrics.loads.labels(entry.name, "ok").inc()
        self._set_state(entry, ModelState.READY)
        self.timeline.mark(f"load {entry.name}: engine started, ready")

    def _check_charge(self, entry: ModelEntry, served: ServedModel) -> None:
        """The load's own bytes against the estimate charged before it, which counts every buffer
        the load makes (Loader.estimate_bytes), so more is an estimate's bug: logged as an error,
        and where the budget cannot hold the difference, the load fails (507; its memory is given
        back by the failed load's path), so that no load leaves the budget exceeded. One that fits
        is kept: a model that fits refused for a wrong estimate would be an outage."""
        estimate, real, budget = entry.weight_bytes, served.weight_bytes, self.settings.gpu_memory_budget
        if real <= estimate:
            return
        log.error("load of %s took %d weight bytes, %d more than the estimate charged before it: "
                  "Loader.estimate_bytes misses a buffer", entry.name, real, real - estimate)
        if budget is not None and self.charged_bytes(entry) + real > budget:
            raise InsufficientMemory(f"model {entry.name!r} took {real} bytes, more than its estimate of {estimate}, "
                                     f"and {self.charged_bytes(entry)} of the budget of {budget} bytes are charged "
                                     "to other models")

    def _failed(self, entry: ModelEntry, error: ServiceError, result: str) -> ServiceError:
        entry.last_error = error.message
        self.metrics.loads.labels(entry.name, result).inc()
        self._set_state(entry, ModelState.FAILED)
        return error

    # --- unload ---------------------------------------------------------------------------------

    async def unload(self, name: str) -> ModelEntry:
        entry = self.get(name)
        while entry.busy:                          # a load or an unload in progress
            with contextlib.suppress(ServiceError):
                await asyncio.shield(entry.job)
        if entry.state is ModelState.READY:
            await self._start_unload(entry)
        elif entry.state is ModelState.FAILED:
            self._set_state(entry, ModelState.AVAILABLE)
        return entry

    async def _start_unload(self, entry: ModelEntry) -> None:
        await asyncio.shield(self._begin_unload(entry))

    def _begin_unload(self, entry: ModelEntry) -> asyncio.Task:
        """UNLOADING now, not when the task first runs: a load sent meanwhile waits for the unload,
        then loads again (it took the model for ready and answered 200, then the unload ran)."""
        self._set_state(entry, ModelState.UNLOADING)
        entry.job = asyncio.create_task(self._unload_job(entry), name=f"unload {entry.name}")
        return entry.job

    async def _unload_job(self, entry: ModelEntry) -> None:
        await entry.idle.wait()                    # in-flight requests finish first
        engine, served, entry.engine, entry.served = entry.engine, entry.served, None, None
        if engine is not None:
            await asyncio.to_thread(engine.close)
        if served is not None:                     # a request still unwinding may hold `served`
            served.release()
        del engine, served
        await asyncio.to_thread(self.loader.unloaded, entry.name)
        entry.progress = Progress()
        self._set_state(entry, ModelState.AVAILABLE)

    # --- start-up and shutdown ------------------------------------------------------------------

    async def start(self) -> None:
        """Build the demo into an empty store (WCODEC_DEMO), then load the preload list."""
        try:
            await asyncio.to_thread(self.loader.warm_up)
            if self.settings.demo:
                await asyncio.to_thread(demo.ensure_demo, self.store.root, self.settings.demo_workers)
            for name in self._preload_names():     # each loads or fails on its own
                try:
                    await self.load(name)
                except ServiceError as e:
                    self._preload_failed(name, e)
            self.timeline.mark("start-up: preloads done")
        except Exception as e:                     # a background task: report it, keep serving
            self.startup_error = str(e)
            log.exception("start-up failed")
        finally:
            self.loader.release_early()            # preloads that did not use theirs

    def _preload_failed(self, name: str, error: ServiceError) -> None:
        """A preload that failed is `failed` in /models with its error, whatever refused it: a load
        refused before it began (the memory budget: 507) left the model `available` and no error,
        where nobody had seen the answer."""
        self.startup_error = self.startup_error or error.message
        log.error("preload of %s failed: %s", name, error.message)
        entry = self._entries.get(name)
        if entry is not None and entry.state is ModelState.AVAILABLE:
            entry.last_error = error.message
            self._set_state(entry, ModelState.FAILED)

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
        for entry in list(self._entries.values()):
            while entry.busy:
                with contextlib.suppress(Exception):
                    await asyncio.shield(entry.job)
            if entry.engine is not None:
                await asyncio.to_thread(entry.engine.close)
            entry.engine = entry.served = None
        self.loader.close()
