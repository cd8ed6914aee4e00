"""A reload without downtime, as Triton's: a load of a ready model whose archive changed (another
inode, size or mtime) loads the new version beside the loaded one, which serves until the new
one is ready. Read me first.

    ready(v1) --load, archive changed--> ready(v1), v2 loading beside it (`entry.job`)
        v2 ready: swap (one step on the event loop) --> ready(v2); v1 retiring
        v2 failed:                                  --> ready(v1), its error in `last_error`
    v1 retiring: its in-flight requests finish on it (their leases hold v1's engine), then its
    engine closes and its memory is freed (`entry.retiring`).

* The budget charges both versions while they overlap (`entry.overlap_bytes`: v2's estimate
  while it loads, then v1's bytes until it is freed). Both must fit, after unloading idle models
  as any load does; if they cannot, the reload is refused (507) and v1 serves on: unloading first
  would be an outage nobody asked for. An unload, then a load, reloads with downtime.
* A load meanwhile shares the reload in progress; an unload waits for it, then unloads v2 (and
  for v1 to retire); a model reloading or retiring is never evicted for another's load.
The registry (registry.py) holds the state machine; this is its reload half."""
from __future__ import annotations

import asyncio
import functools
import logging

from codec.errors import CodecError

from .engine import Engine
from .entry import ModelEntry, ModelState, Requests
from .errors import InsufficientMemory, LoadFailed, ServiceError
from .load import failure
from .load.job import Loaded, Progress
from .load.store import ModelFile
from .model.build import ServedModel

log = logging.getLogger("wcodec.service")


class Reloads:
    """ModelRegistry's reload (a mixin: it uses the registry's store, loader, budget and jobs)."""

    async def _start_reload(self, entry: ModelEntry, weights: str | None) -> bool:
        """Start the reload of a ready model whose archive changed; False if unchanged or deleted.
        Refused up front (an unreadable header: 500; both versions beyond the budget: 507), the
        loaded version serves on, untouched."""
        f = self.store.find(entry.name)
        if f is None or f.version == entry.file.version:
            return False
        weights = weights or entry.weights
        need = self._reload_estimate(entry.name, f, weights)
        try:
            victims = self._evict_for(entry, need, self.used_bytes())
        except InsufficientMemory as e:
            raise InsufficientMemory(f"cannot reload {entry.name!r} beside its loaded version, which keeps serving: "
                                     f"{e.message}; unload it, then load it, to reload with downtime") from None
        log.info("reloading %s beside its loaded version: its archive changed", entry.name)
        entry.overlap_bytes += need
        entry.progress = Progress("making room" if victims else "queued", 0, f.decoded_bytes)
        await self._spawn(entry, victims, functools.partial(self._reload_job, entry, f, weights, need), "reload")
        return True

    def _reload_estimate(self, name: str, f: ModelFile, weights: str) -> int:
        try:
            need, error = self.loader.estimate_bytes(f.path, weights), f.error
        except CodecError as e:
            need, error = 0, str(e)
        if error:                                   # the store could not read its header either
            raise LoadFailed(f"cannot reload {name!r} (the loaded version stays): {error}")
        return need

    async def _reload_job(self, entry: ModelEntry, f: ModelFile, weights: str, need: int,
                          evicted: asyncio.Future) -> None:
        await evicted
        entry.progress.phase = "queued"
        try:
            loaded, engine = await self._make(entry.name, f.path, weights, entry.progress, need,
                                              lambda: self.charged_bytes() - need)    # the loaded version's in
        except failure.Failed as failed:
            await asyncio.to_thread(self.loader.free_memory)
            entry.overlap_bytes -= need
            self.loader.show_memory(entry.name, entry.served, entry.reserved_bytes)    # the loaded version's
            raise self._reload_failed(entry, failed) from None
        self._swap(entry, f, loaded, engine, need)

    def _swap(self, entry: ModelEntry, f: ModelFile, loaded: Loaded, engine: Engine, need: int) -> None:
        """The new version serves from this step on (new leases take it); the replaced one retires."""
        old = entry.served, entry.engine, entry.requests, entry.weight_bytes
        entry.file, entry.requests = f, Requests()
        entry.overlap_bytes += entry.weight_bytes - need      # the new one's estimate out, the old one's bytes in
        self._ready(entry, loaded, engine)
        task = asyncio.create_task(self._retire(entry, *old), name=f"retire {entry.name}")
        entry.retiring.add(task)
        task.add_done_callback(entry.retiring.discard)
        log.info("reloaded %s: the new version serves; the replaced one closes after its %d requests",
                 entry.name, old[2].count)

    async def _retire(self, entry: ModelEntry, served: ServedModel, engine: Engine, requests: Requests,
                      nbytes: int) -> None:
        """A replaced version: its requests finish on it, then its engine closes (the model's cache
        metrics are the new engine's now) and its memory goes back; charged until then."""
        await requests.idle.wait()
        await self._close(entry.name, engine, served, untrack=False)     # a close that fails is logged
        del engine, served
        await asyncio.to_thread(self.loader.free_memory)
        entry.overlap_bytes -= nbytes
        log.info("the replaced version of %s is closed and its memory freed", entry.name)

    def _reload_failed(self, entry: ModelEntry, failed: failure.Failed) -> ServiceError:
        """The loaded version serves on (`ready`); the reload's error is its `last_error`."""
        entry.last_error = f"reload failed, the loaded version serves: {failed.error.message}"
        self.metrics.loads.labels(entry.name, failed.result).inc()
        entry.progress = Progress(ModelState.READY.value, entry.file.decoded_bytes, entry.file.decoded_bytes)
        log.error("reload of %s failed; the loaded version serves on: %s", entry.name, failed.error.message)
        return failed.error
