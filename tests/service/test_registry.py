"""The registry's state machine when a load fails part of the way: the model ends `failed` with its
reason, nothing of the failed load stays in memory or in the budget, and a retry loads; control
calls that cross a load (an unload, a refresh, a changed archive), a failed unload, where the
engine is built."""
from __future__ import annotations

import asyncio
import gc
import shutil
import threading
import weakref

import anyio
import pytest
import torch
from service_helpers import DEMO, assert_error, generate_body, with_broken_archive

from service.engine import worker
from service.errors import LoadFailed
from service.load import pipeline
from service.model import paged
from service.registry import ModelState

pytestmark = pytest.mark.anyio


async def _reason(server, name: str) -> dict:
    return next(m for m in (await server.client.post("/v2/repository/index")).json() if m["name"] == name)


async def test_an_engine_that_cannot_start_fails_the_load_and_frees_the_weights(serve, store, monkeypatch) -> None:
    """The KV cache allocated after the weights did not fit: the model stayed `loading` for good
    (a second load raised the first's error again, an unload answered "loading"), its weights and
    its budget charge held."""
    weights, real = [], paged.PagedCache

    class NoRoom(real):
        def __init__(self, *args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(paged, "PagedCache", NoRoom)
    async with serve(store()) as server:
        load = server.registry.loader.load

        def recorded(*args):
            loaded = load(*args)
            weights.append(weakref.ref(loaded.served.model.lm_head.weight))
            return loaded

        monkeypatch.setattr(server.registry.loader, "load", recorded)
        r = await server.client.post(f"/models/{DEMO}/load")
        assert "CUDA out of memory" in assert_error(r, 507, "insufficient_memory")["error"]
        entry = server.registry.get(DEMO)
        assert entry.state is ModelState.FAILED and entry.served is None and entry.engine is None
        assert (await _reason(server, DEMO))["state"] == "UNAVAILABLE"
        assert "CUDA out of memory" in (await _reason(server, DEMO))["reason"]
        gc.collect()
        assert weights[0]() is None and server.registry.used_bytes() == 0
        assert await server.metric("wcodec_model_memory_allocated_bytes", model=DEMO, device="cpu") == 0
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="oom") == 1
        assert (await server.client.get("/health")).status_code == 200
        monkeypatch.setattr(paged, "PagedCache", real)
        assert (await server.client.post(f"/v2/repository/models/{DEMO}/load")).status_code == 200
        assert (await server.client.post("/generate", json=generate_body(4))).status_code == 200


async def test_a_load_failing_mid_way_keeps_none_of_what_it_decoded(serve, store, demo_archive, monkeypatch) -> None:
    """A stream that fails its checksum half-way through the archive: the layers decoded before it
    stayed alive (the failed job's exception held their frames) until the model's next load."""
    decoded = []
    real = pipeline._decode

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        decoded.extend(weakref.ref(t) for t in out.values())
        return out

    monkeypatch.setattr(pipeline, "_decode", recorded)
    root = store("ok")
    data = bytearray(demo_archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / "bad.wcodec").write_bytes(bytes(data))
    async with serve(root, preload=["ok"], host_cache_bytes=0) as server:    # the ring reads 4 batches ahead
        await server.wait_state("ok", ModelState.READY)
        decoded.clear()
        r = await server.client.post("/models/bad/load")
        assert "checksum" in assert_error(r, 500, "load_failed")["error"]
        assert "checksum" in (await _reason(server, "bad"))["reason"]
        gc.collect()
        assert decoded and not [ref for ref in decoded if ref() is not None]
        assert server.registry.used_bytes() == server.registry.get("ok").weight_bytes
        assert (await server.client.post("/generate", json={**generate_body(4), "model": "ok"})).status_code == 200
        (root / "bad.wcodec").write_bytes(demo_archive.read_bytes())       # fixed: a retry loads
        assert (await server.client.post("/v2/repository/models/bad/load")).status_code == 200
        assert server.registry.get("bad").state is ModelState.READY


async def _evicting(server, monkeypatch) -> tuple[asyncio.Future, threading.Event]:
    """The demo ready, then a load of b that must unload it (a budget of 1000, 400 + 700 do not
    fit), held at the demo's unload's last step until the returned event is set (set it with
    `_room`: b's real charge is no 700 units)."""
    registry = server.registry
    await registry.load(DEMO)
    registry.get(DEMO).weight_bytes = 400                  # budget units of these tests
    registry.settings = registry.settings.model_copy(update={"gpu_memory_budget": 1000})
    monkeypatch.setattr(registry.loader, "estimate_bytes", lambda *a: 700)
    gate, unloaded = threading.Event(), registry.loader.unloaded
    monkeypatch.setattr(registry.loader, "unloaded", lambda name: (name != DEMO or gate.wait(60)) and unloaded(name))
    load_b = asyncio.ensure_future(registry.load("b"))
    with anyio.fail_after(30):
        while registry.get(DEMO).state is not ModelState.UNLOADING:
            await asyncio.sleep(0.01)
    return load_b, gate


def _room(server, gate: threading.Event) -> None:
    """Lift the budget of `_evicting` (its units are no bytes: b's load, which charges what it took
    against the budget, would fail), then let the demo's unload end."""
    server.registry.settings = server.registry.settings.model_copy(update={"gpu_memory_budget": None})
    gate.set()


async def test_an_unload_sent_while_a_load_makes_room_waits_for_that_load(serve, store, monkeypatch) -> None:
    """b was `available` while its load evicted the demo: an unload of b answered "available" at once,
    then the load went on and b ended ready. Triton's unload returns once the model is unloaded: it
    waits for the load, then unloads; another model's unload does not wait."""
    async with serve(with_broken_archive(store(DEMO, "b"))) as server:
        registry = server.registry
        with pytest.raises(LoadFailed):
            await registry.load("broken")
        load_b, gate = await _evicting(server, monkeypatch)
        unload_b = asyncio.ensure_future(registry.unload("b"))
        assert (await asyncio.wait_for(registry.unload("broken"), 10)).state is ModelState.AVAILABLE
        for _ in range(20):
            await asyncio.sleep(0)
        assert registry.get("b").state is ModelState.LOADING and not unload_b.done()
        _room(server, gate)
        await load_b
        assert (await unload_b).state is ModelState.AVAILABLE
        assert registry.get("b").state is ModelState.AVAILABLE and registry.used_bytes() == 0


async def test_a_model_whose_file_goes_while_it_loads_stays_tracked(serve, store, monkeypatch) -> None:
    """A refresh while b's load made room dropped b's entry (its file was being replaced): the load
    then finished on an entry nobody tracked (charged nowhere, never unloadable) and the file's
    return made a new, `available` one. A loading model keeps its entry until it is unloaded."""
    async with serve(store(DEMO, "b")) as server:
        registry, root = server.registry, server.registry.store.root
        load_b, gate = await _evicting(server, monkeypatch)
        (root / "b.wcodec").rename(root / "b.moved")
        listed = {m["name"]: m["state"] for m in (await server.client.get("/models")).json()["models"]}
        assert listed["b"] == "loading"
        (root / "b.moved").rename(root / "b.wcodec")
        _room(server, gate)
        loaded = await load_b
        assert registry.get("b") is loaded and loaded.state is ModelState.READY
        assert registry.used_bytes() == loaded.weight_bytes > 0
        assert (await registry.unload("b")).state is ModelState.AVAILABLE and registry.used_bytes() == 0


async def test_a_load_of_a_ready_model_whose_archive_changed_reloads_it(serve, store, demo_archive,
                                                                      monkeypatch) -> None:
    """Triton's load reloads a loaded model (TRITONSERVER_ServerLoadModel); here it was a no-op
    whatever the file. Unchanged: no reload. Changed (another inode): a reload the budget cannot
    hold both ways answers 507 and keeps the loaded version; else the new version is loaded."""
    async with serve(store()) as server:
        registry, c = server.registry, server.client
        entry = await registry.load(DEMO)
        assert (await c.post(f"/models/{DEMO}/load")).status_code == 200
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="ok") == 1
        path = registry.store.root / f"{DEMO}.wcodec"
        path.unlink()
        shutil.copy(demo_archive, path)                     # a deploy's copy: another inode and mtime
        registry.settings = registry.settings.model_copy(update={"gpu_memory_budget": entry.weight_bytes})
        estimate = registry.loader.estimate_bytes
        monkeypatch.setattr(registry.loader, "estimate_bytes", lambda *a: entry.weight_bytes + 1)
        r = await c.post(f"/models/{DEMO}/load")
        assert "the budget of" in assert_error(r, 507, "insufficient_memory")["error"]
        assert registry.get(DEMO).state is ModelState.READY
        monkeypatch.setattr(registry.loader, "estimate_bytes", estimate)
        registry.settings = registry.settings.model_copy(update={"gpu_memory_budget": None})
        r = await c.post(f"/models/{DEMO}/load")
        assert r.status_code == 200 and r.json()["state"] == "ready", r.text
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="ok") == 2
        assert registry.get(DEMO).file.version == registry.store.find(DEMO).version
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200


async def test_an_engine_that_fails_to_close_ends_the_unload_failed_and_freed(serve, store, monkeypatch) -> None:
    """engine.close raising left the model `unloading` for good (its weights held and charged) and
    the unload answered an untyped 500."""
    real = worker.Engine.close

    def failing(engine, untrack: bool = True) -> None:
        real(engine, untrack)
        raise RuntimeError("the worker did not stop")

    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        weight = weakref.ref(server.registry.get(DEMO).served.model.lm_head.weight)
        monkeypatch.setattr(worker.Engine, "close", failing)
        r = await server.client.post(f"/models/{DEMO}/unload")
        assert "did not stop" in assert_error(r, 500, "unload_failed")["error"]
        entry = server.registry.get(DEMO)
        assert entry.state is ModelState.FAILED and "did not stop" in entry.last_error
        gc.collect()
        assert weight() is None and server.registry.used_bytes() == 0
        assert await server.metric("wcodec_model_memory_allocated_bytes", model=DEMO, device="cpu") == 0
        monkeypatch.setattr(worker.Engine, "close", real)
        assert (await server.client.post(f"/models/{DEMO}/load")).status_code == 200


async def test_the_engine_is_built_off_the_event_loop(serve, store, monkeypatch) -> None:
    """Its KV cache allocation (paging.py) and the weights' joins ran on the event loop, which
    answered nothing meanwhile."""
    threads, init = [], worker.Engine.__init__

    def recorded(engine, *args, **kwargs) -> None:
        threads.append(threading.current_thread())
        init(engine, *args, **kwargs)

    monkeypatch.setattr(worker.Engine, "__init__", recorded)
    async with serve(store()) as server:
        await server.registry.load(DEMO)
        assert threads and threads[0] is not threading.current_thread()
        assert (await server.client.post("/generate", json=generate_body(4))).status_code == 200
