"""The model registry: every model of the store, its state, and its load / unload jobs.

    available --load--> loading --ok--> ready --unload--> unloading --ok--> available
                           \\--error--> failed <--------------------/ engine.close failed
    failed --load--> loading;  ready --load, its archive changed--> ready (a reload: reload.py)

* One job per model at a time (`entry.job`: a load, a reload, an unload): concurrent loads of a
  model share it; an unload waits for a load or reload in progress (from the moment it is
  budgeted: `loading`, phase "making room", while the idle models it evicts unload), then for
  the model's in-flight requests (leases, a replaced version's too), then frees. A model
  `loading` or later holds its entry: a refresh never drops it.
* Memory budget: budget.py (which idle models a load evicts; the load's charge checked against
  its estimate). A load's evictions are waited for with the lock held (the next load budgets
  after them); unloads take no lock.
* A load that fails anywhere, its engine's start (the KV cache) included, fails that load alone:
  the model ends `failed` with its error (507 for out of memory, else 500), and what the load had
  made is freed before the error is answered; a reload's leaves the loaded version `ready`.
The load itself (early loads, the host cache, the decode, the model's build) is service/load/'s
(`Loader`), run in a worker thread; this file only moves states. Every method runs on the event
loop."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine

import torch

from codec.errors import CodecError

from .engine import Engine, limits
from .budget import check_charge, evictions
from .entry import HOLDS_MEMORY, Lease, ModelEntry, ModelState
from .errors import (InsufficientMemory, LoadFailed, ModelNotFound, ModelNotReady, ServiceError, UnloadFailed,
                     ValidationFailed)
from .load import demo, failure
from .load.early_load import EarlyLoad
from .load.job import Loaded, Loader, Progress
from .load.store import ModelFile, ModelStore, check_name
from .metrics import Metrics
from .model.build import ServedModel
from .reload import Reloads
from .settings import Settings
from .timeline import Timeline

log = logging.getLogger("wcodec.service")


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()           # a job nobody awaited (load ?wait=false) must not warn


class ModelRegistry(Reloads):
    def __init__(self, settings: Settings, metrics: Metrics, *, timeline: Timeline | None = None,
                 early: dict[str, EarlyLoad] | None = None):
        self.settings, self.metrics = settings, metrics
        self.timeline = timeline or Timeline()
        self.store = ModelStore(settings.model_store)
        self.device = settings.torch_device()
        self.loader = Loader(settings, metrics, self.device, self.timeline, early)
        self.startup: asyncio.Task | None = None
        self._startup_errors: dict[str, str] = {}    # model (or "": start-up itself) -> its error
        self._entries: dict[str, ModelEntry] = {}
        self._lock = asyncio.Lock()

    @property
    def host_cache(self):
        return self.loader.host_cache

    @property
    def startup_error(self) -> str | None:
        """The first start-up error still standing (a preload's goes once that model loads)."""
        return next(iter(self._startup_errors.values()), None)

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
        """The weight bytes the budget charges the models that hold memory (but `exclude`), a
        reload's other version included (reload.py)."""
        return sum(e.weight_bytes + e.overlap_bytes for e in self._entries.values()
                   if e.state in HOLDS_MEMORY and e is not exclude)

    def used_bytes(self, exclude: ModelEntry | None = None) -> int:
        held = self.charged_bytes(exclude)
        if self.device.type == "cuda":
            return max(held, torch.cuda.memory_allocated(self.device))
        return held

    # --- load -----------------------------------------------------------------------------------

    async def load(self, name: str, wait: bool = True, weights: str | None = None) -> ModelEntry:
        """Load a model (shared with a load or reload in progress). `weights`: "decoded" or
        "compressed" (default: the settings'); a ready model is returned as it is, held as it is,
        unless its archive changed since: then it reloads (reload.py), serving meanwhile. A load of
        a model being unloaded waits for the unload outside the lock, so other models' loads go on."""
        while True:
            entry = self.get(name)                 # the tracked entry (a refresh may have dropped one)
            while entry.busy and entry.state is ModelState.UNLOADING:
                with contextlib.suppress(ServiceError):
                    await asyncio.shield(entry.job)
            async with self._lock:
                if self.get(name) is not entry or entry.busy and entry.state is ModelState.UNLOADING:
                    continue                       # dropped, or an unload began meanwhile; else its file as now
                if entry.state is ModelState.READY and not entry.busy and not await self._start_reload(entry, weights):
                    entry.last_used = time.monotonic()
                    return entry                   # unchanged
                if entry.state not in (ModelState.LOADING, ModelState.READY):
                    await self._start_load(entry, weights)
            break
        if wait:
            await asyncio.shield(entry.job)
        return entry

    async def _start_load(self, entry: ModelEntry, weights: str | None) -> None:
        """Budget the load, mark it `loading` and start its job, then wait for the idle models it
        evicts (lock held): an unload or a refresh meanwhile sees the model loading, not available."""
        entry.weights = weights or self.settings.weights
        try:                                        # compressed: the archive's header says how much
            entry.weight_bytes = self.loader.estimate_bytes(entry.file.path, entry.weights)
        except CodecError as e:
            raise self._failed(entry, LoadFailed(f"cannot load {entry.name!r}: {e}"), "failed") from None
        victims = self._evict_for(entry, entry.weight_bytes, self.used_bytes(entry))
        phase = "making room" if victims else "queued"
        entry.progress = Progress(phase, 0, entry.file.decoded_bytes)
        self._set_state(entry, ModelState.LOADING, phase)
        await self._spawn(entry, victims, functools.partial(self._load_job, entry), "load")

    async def _spawn(self, entry: ModelEntry, victims: list[ModelEntry],
                     job: Callable[[asyncio.Future], Coroutine], what: str) -> None:
        """Start `entry`'s job once the idle `victims` are unloaded (lock held: the next load budgets
        after them); every victim is UNLOADING before the first await (a new request gets 503)."""
        for other in victims:
            log.info("unloading idle model %s to make room for %s", other.name, entry.name)
            self._begin_unload(other)
        evicted = asyncio.gather(*(asyncio.shield(v.job) for v in victims), return_exceptions=True)
        entry.job = asyncio.create_task(job(evicted), name=f"{what} {entry.name}")
        entry.job.add_done_callback(_retrieve)
        await asyncio.shield(evicted)               # a victim whose engine failed to close is freed too

    def _evict_for(self, entry: ModelEntry, need: int, used: int) -> list[ModelEntry]:
        """The idle ready models (not `entry`; none reloading or draining a replaced version) to
        unload for `need` bytes beside `used`; 507 if they cannot make room."""
        idle = [e for e in self._entries.values() if e.state is ModelState.READY and e.in_flight == 0
                and not e.busy and not e.retiring and e is not entry]
        try:
            return evictions(entry.name, need, used, self.settings.gpu_memory_budget, idle)
        except InsufficientMemory:
            self.metrics.loads.labels(entry.name, "rejected").inc()
            raise

    async def _load_job(self, entry: ModelEntry, evicted: asyncio.Future) -> None:
        await evicted
        entry.progress.phase = "queued"
        try:
            loaded, engine = await self._make(entry.name, entry.file.path, entry.weights, entry.progress,
                                              entry.weight_bytes, functools.partial(self.charged_bytes, entry))
        except failure.Failed as failed:
            await asyncio.to_thread(self.loader.unloaded, entry.name)     # memory back before the answer
            raise self._failed(entry, failed.error, failed.result) from None
        self._ready(entry, loaded, engine)

    async def _make(self, name: str, path, weights: str, progress: Progress, estimate: int,
                    others: Callable[[], int]) -> tuple[Loaded, Engine]:
        """Load a version and start its engine, its charge checked against `estimate` beside the
        `others()` bytes charged once it is loaded. A failure anywhere, the engine's start (the KV
        cache) included, releases what it had made and raises failure.Failed with the typed error."""
        loaded = None
        try:
            loaded = await asyncio.to_thread(self.loader.load, name, path, weights, progress)
            self.timeline.mark(f"load {name}: back on the event loop")
            check_charge(name, estimate, loaded.served.weight_bytes, others(), self.settings.gpu_memory_budget)
            engine = await asyncio.to_thread(Engine, loaded.served, self.metrics, limits(self.settings),
                                             self.timeline)    # its KV cache and joins: off the loop
            engine.start()                                    # its own thread captures the graphs
            return loaded, engine
        except Exception as e:
            failed = failure.Failed(*failure.load_error(name, e))
            failure.forget_frames(e)               # their locals hold what the load had decoded
        if loaded is not None:                     # built, then refused (its charge) or its engine did not start
            loaded.served.release()
        del loaded
        raise failed

    def _ready(self, entry: ModelEntry, loaded: Loaded, engine: Engine) -> None:
        entry.served, entry.stats, entry.reserved_bytes = loaded.served, loaded.stats, loaded.reserved_bytes
        entry.weights = loaded.served.weights                  # as held: an int8 archive's stay decoded
        entry.weight_bytes = loaded.served.weight_bytes        # as held: the estimate or less (check_charge)
        entry.loaded_at, entry.last_error = time.time(), None
        self._startup_errors.pop(entry.name, None)             # its preload's error is history
        entry.engine, entry.last_used = engine, time.monotonic()
        self.metrics.loads.labels(entry.name, "ok").inc()
        self._set_state(entry, ModelState.READY)
        self.timeline.mark(f"load {entry.name}: engine started, ready")

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
        """Frees the weights whether or not the engine closes; one that fails to close leaves the
        model `failed` with the error (500 unload_failed), charged nothing: its weights are gone.
        A version a reload replaced is waited for too: the answer comes once all is freed."""
        await entry.idle.wait()                    # in-flight requests finish first
        engine, served, entry.engine, entry.served = entry.engine, entry.served, None, None
        error = await self._close(entry.name, engine, served)
        del engine, served
        await asyncio.gather(*entry.retiring, return_exceptions=True)
        await asyncio.to_thread(self.loader.unloaded, entry.name)
        entry.progress = Progress()
        if error is not None:
            entry.last_error = error.message
            self._set_state(entry, ModelState.FAILED)
            raise error
        self._set_state(entry, ModelState.AVAILABLE)

    async def _close(self, name: str, engine: Engine | None, served: ServedModel | None,
                     untrack: bool = True) -> UnloadFailed | None:
        """Close a version's engine, then release its weights whether or not it closed."""
        error = None
        try:
            if engine is not None:
                await asyncio.to_thread(engine.close, untrack)
        except Exception as e:
            log.exception("closing the engine of %s failed", name)
            error = UnloadFailed(f"unloading {name!r}: its engine failed to close: {type(e).__name__}: {e}")
            failure.forget_frames(e)               # their locals hold the engine and its cache
        if served is not None:                     # a request still unwinding may hold `served`
            served.release()
        return error

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
            self._startup_errors.setdefault("", str(e))
            log.exception("start-up failed")
        finally:
            self.loader.release_early()            # preloads that did not use theirs

    def _preload_failed(self, name: str, error: ServiceError) -> None:
        """A preload that failed is `failed` in /models with its error, whatever refused it: a load
        refused before it began (the memory budget: 507) left the model `available` and no error,
        where nobody had seen the answer."""
        self._startup_errors.setdefault(name, error.message)
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
            await asyncio.gather(*entry.retiring, return_exceptions=True)
            if entry.engine is not None:
                await asyncio.to_thread(entry.engine.close)
            entry.engine = entry.served = None
        self.loader.close()
