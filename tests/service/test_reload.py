"""A reload without downtime, as Triton's (service/reload.py): a load of a ready model whose archive
changed loads the new version beside the loaded one, which serves until the swap; its requests
finish on it, then it is freed. A reload that fails or does not fit leaves the loaded version
serving. Two reloads, an unload or generations that cross a reload each get a defined answer."""
from __future__ import annotations

import asyncio
import gc
import shutil
import threading
import weakref

import anyio
import pytest
from service_helpers import CHAT_PROMPT, DEMO, assert_error, generate_body

from service.engine import GenRequest
from service.engine.sampling import SamplingParams
from service.registry import ModelState

pytestmark = pytest.mark.anyio


def _rewrite(registry, data: bytes | None = None, source=None) -> None:
    """A deploy's new archive for the demo: another inode (a copy of `source`, or `data`)."""
    path = registry.store.root / f"{DEMO}.wcodec"
    path.unlink()
    if data is None:
        shutil.copy(source, path)
    else:
        path.write_bytes(data)


def _held_loads(registry, monkeypatch) -> threading.Event:
    """From now on the registry's loads wait until the returned event is set."""
    gate, real = threading.Event(), registry.loader.load
    monkeypatch.setattr(registry.loader, "load", lambda *args: gate.wait(20) and real(*args))
    return gate


async def _held_reload(server, demo_archive, monkeypatch, url: str) -> tuple[threading.Event, asyncio.Future]:
    """A new archive for the demo and a reload of it sent to `url`, begun, its load held until the
    returned event is set; and the reload's answer to come."""
    _rewrite(server.registry, source=demo_archive)
    gate, entry = _held_loads(server.registry, monkeypatch), server.registry.get(DEMO)
    reload = asyncio.ensure_future(server.client.post(url))
    with anyio.fail_after(30):
        while not entry.busy:
            await asyncio.sleep(0.01)
    return gate, reload


async def _retired(entry) -> None:
    with anyio.fail_after(30):
        while entry.retiring:
            await asyncio.sleep(0.01)
    gc.collect()


async def _index_state(client) -> tuple[str, str]:
    m = next(m for m in (await client.post("/v2/repository/index")).json() if m["name"] == DEMO)
    return m["state"], m["reason"]


async def test_a_reload_serves_the_loaded_version_until_the_new_one_is_ready(serve, store, demo_archive,
                                                                             monkeypatch) -> None:
    """The reload unloaded first: the model was `unloading`, then `loading`, and answered 503 until
    the new version was ready. Now it stays `ready` and generates; Triton's load answers once the
    new version serves, and the old one is freed."""
    async with serve(store()) as server:
        registry, c = server.registry, server.client
        entry = await registry.load(DEMO)
        old_weight = weakref.ref(entry.served.model.lm_head.weight)
        gate, reload = await _held_reload(server, demo_archive, monkeypatch, f"/v2/repository/models/{DEMO}/load")
        assert (await c.get(f"/models/{DEMO}")).json()["state"] == "ready"
        assert await _index_state(c) == ("READY", "")
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200
        gate.set()
        assert ((r := await reload).status_code, r.content) == (200, b"")
        assert entry.state is ModelState.READY and entry.file.version == registry.store.find(DEMO).version
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200
        await _retired(entry)
        assert old_weight() is None and entry.served.model.lm_head.weight is not None
        assert entry.overlap_bytes == 0 and registry.charged_bytes() == entry.weight_bytes
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="ok") == 2


async def test_a_reload_does_not_wait_for_the_old_versions_requests(serve, store, demo_archive) -> None:
    """load?wait=false on a changed model blocked until the loaded version's in-flight requests
    had finished (the unload waited for them). Now it answers 202 at once; Triton's load answers
    once the new version serves. A request that holds the old version (its lease taken, its
    generation not yet queued, as inference.start does between them) runs on the old engine,
    which closes after it."""
    async with serve(store()) as server:
        registry, c = server.registry, server.client
        entry = await registry.load(DEMO)
        lease = registry.acquire(DEMO)
        try:
            old_engine = lease.engine
            _rewrite(registry, source=demo_archive)
            with anyio.fail_after(10):
                r = await c.post(f"/models/{DEMO}/load", params={"wait": "false"})
            assert r.status_code == 202 and r.json()["state"] == "ready", r.text
            with anyio.fail_after(60):
                assert (await c.post(f"/v2/repository/models/{DEMO}/load")).status_code == 200
            assert entry.engine is not old_engine and entry.retiring and entry.in_flight == 0
            req = GenRequest(lease.served.tokenizer(CHAT_PROMPT)["input_ids"], SamplingParams(max_new_tokens=4))
            old_engine.submit(req)                              # raised "unloading" had it been closed
            req.add_done_callback(lease.release)
            assert (await req.result()).finish_reason in ("length", "eos_token")
        finally:
            lease.release()                                 # a lease left held would hang the shutdown
        await _retired(entry)
        assert old_engine._closed and not entry.engine._closed
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200


async def test_a_reload_the_budget_cannot_hold_beside_the_loaded_version_is_refused(serve, store,
                                                                                    demo_archive) -> None:
    """Both versions must fit while they overlap. The reload unloaded the loaded version when the
    new one fitted alone (an outage, nothing said); now it is a 507 that says how to reload with
    downtime (unload, then load), and the loaded version serves on."""
    async with serve(store()) as server:
        registry, c = server.registry, server.client
        entry = await registry.load(DEMO)
        registry.settings = registry.settings.model_copy(update={"gpu_memory_budget": entry.weight_bytes * 3 // 2})
        _rewrite(registry, source=demo_archive)
        body = assert_error(await c.post(f"/models/{DEMO}/load"), 507, "insufficient_memory")
        assert "beside its loaded version" in body["error"] and "unload it, then load it" in body["error"]
        assert entry.state is ModelState.READY and not entry.busy and entry.overlap_bytes == 0
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="rejected") == 1
        assert (await c.post(f"/models/{DEMO}/unload")).json()["state"] == "available"
        assert (await c.post(f"/models/{DEMO}/load")).json()["state"] == "ready"
        assert entry.file.version == registry.store.find(DEMO).version


async def test_a_reload_that_fails_leaves_the_loaded_version_serving(serve, store, demo_archive) -> None:
    """A new archive whose stream fails its checksum left the model `failed` (the loaded version
    unloaded before). Now the load answers the failure; the model stays `ready` on the loaded
    version (the index: READY, no reason), /models' last_error says what failed, and the memory
    and its metrics are the loaded version's."""
    async with serve(store()) as server:
        registry, c = server.registry, server.client
        entry = await registry.load(DEMO)
        data = bytearray(demo_archive.read_bytes())
        data[len(data) // 2] ^= 0xFF
        _rewrite(registry, bytes(data))
        assert "checksum" in assert_error(await c.post(f"/models/{DEMO}/load"), 500, "load_failed")["error"]
        info = (await c.get(f"/models/{DEMO}")).json()
        assert info["state"] == "ready" and info["progress"]["phase"] == "ready"
        assert "reload failed" in info["last_error"] and "checksum" in info["last_error"]
        assert await _index_state(c) == ("READY", "")
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200
        assert registry.charged_bytes() == entry.weight_bytes and entry.overlap_bytes == 0
        assert await server.metric("wcodec_model_weight_bytes", model=DEMO, weights=entry.weights) == entry.weight_bytes
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="failed") == 1
        _rewrite(registry, source=demo_archive)                # fixed: the reload goes through
        assert (await c.post(f"/models/{DEMO}/load")).json()["last_error"] is None


async def test_two_reloads_at_once_share_one_load(serve, store, demo_archive, monkeypatch) -> None:
    """A second load while the reload runs shares it (as loads share a load): both answer once
    the new version serves, which was loaded once; the model is `ready` throughout."""
    async with serve(store()) as server:
        registry, c = server.registry, server.client
        await registry.load(DEMO)
        gate, first = await _held_reload(server, demo_archive, monkeypatch, f"/models/{DEMO}/load")
        second = asyncio.ensure_future(c.post(f"/v2/repository/models/{DEMO}/load"))
        with anyio.fail_after(10):
            r = await c.post(f"/models/{DEMO}/load", params={"wait": "false"})
        assert r.status_code == 202 and r.json()["state"] == "ready"
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200
        gate.set()
        assert (await first).json()["state"] == "ready" and (await second).status_code == 200
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="ok") == 2


async def test_an_unload_during_a_reload_waits_for_it_then_frees_both_versions(serve, store, demo_archive,
                                                                              monkeypatch) -> None:
    """Control calls of a model are serialized: the unload waits for the reload (the loaded version
    serving meanwhile), then unloads the new version; it answers once both versions are freed."""
    async with serve(store()) as server:
        registry, c = server.registry, server.client
        entry = await registry.load(DEMO)
        old_weight = weakref.ref(entry.served.model.lm_head.weight)
        gate, reload = await _held_reload(server, demo_archive, monkeypatch, f"/models/{DEMO}/load")
        unload = asyncio.ensure_future(c.post(f"/models/{DEMO}/unload"))
        await asyncio.sleep(0.2)
        assert not unload.done() and entry.state is ModelState.READY
        assert (await c.post("/generate", json=generate_body(4))).status_code == 200
        gate.set()
        assert (await reload).status_code == 200
        assert (await unload).json()["state"] == "available"
        gc.collect()
        assert old_weight() is None and entry.served is None and not entry.retiring
        assert registry.charged_bytes() == 0 and entry.overlap_bytes == 0
