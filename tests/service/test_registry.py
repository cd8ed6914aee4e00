"""The registry's state machine when a load fails part of the way: the model ends `failed` with its
reason, nothing of the failed load stays in memory or in the budget, and a retry loads."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from service_helpers import DEMO, assert_error, generate_body

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
