"""Many requests at once: 16 parallel generates (batched), a duplicate load and an unload in the
middle of them, each ending with its documented status; concurrent loads share one job; a prompt
and a chat template are made off the event loop."""
from __future__ import annotations

import functools
import gc
import threading
import weakref

import anyio
import pytest
from service_helpers import DEMO, generate_body

from service import inference
from service.registry import ModelState

pytestmark = pytest.mark.anyio


async def _gather(*calls):
    results = [None] * len(calls)

    async def run(i, call):
        results[i] = await call

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(run, i, call)
    return results


async def test_parallel_generates_with_a_duplicate_load_and_an_unload(serve, store) -> None:
    async with serve(store(), preload=[DEMO], max_batch_size=8) as server:
        await server.wait_state(DEMO, ModelState.READY)
        c, entry = server.client, server.registry.get(DEMO)
        weight = weakref.ref(entry.served.model.lm_head.weight)
        results = [None] * 18

        async def call(i, method, url, body=None):
            results[i] = await c.request(method, url, json=body)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(call, i, "POST", "/generate", generate_body(8))
            with anyio.fail_after(30):
                while entry.in_flight < 16:                 # every generate holds its lease
                    await anyio.sleep(0.005)
            await call(16, "POST", f"/models/{DEMO}/load")      # ready: answers at once, mid-flight
            assert entry.in_flight > 0
            tg.start_soon(call, 17, "POST", f"/models/{DEMO}/unload")

        generates, load, unload = results[:16], results[16], results[17]
        assert [r.status_code for r in generates] == [200] * 16
        assert {r.json()["generated_text"] for r in generates} == {"The capital of France is Paris."}
        assert load.status_code == 200 and load.json()["state"] == "ready"       # it was ready: at once
        assert unload.status_code == 200 and unload.json()["state"] == "available"
        assert unload.json()["in_flight"] == 0
        steps = await server.metric("wcodec_generate_batch_size_count", model=DEMO)
        rows = await server.metric("wcodec_generate_batch_size_sum", model=DEMO)
        assert rows / steps > 2, "concurrent requests were not batched"
        assert await server.metric("wcodec_generate_batch_size_bucket", model=DEMO, le="8.0") == steps  # max 8
        assert await server.metric("wcodec_generate_requests_total", model=DEMO, status="ok") == 16
        gc.collect()
        assert weight() is None and server.registry.used_bytes() == 0
        r = await c.post("/generate", json=generate_body(4))
        assert r.status_code == 503 and r.headers["retry-after"]


async def test_concurrent_loads_share_one_job(serve, store) -> None:
    async with serve(store()) as server:
        rs = await _gather(*(server.client.post(f"/models/{DEMO}/load") for _ in range(3)))
        assert [r.status_code for r in rs] == [200, 200, 200]
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="ok") == 1
        rs = await _gather(*(server.client.post(f"/models/{DEMO}/unload") for _ in range(2)))
        assert [r.json()["state"] for r in rs] == ["available", "available"]


async def test_unload_during_a_load_waits_for_it(serve, store) -> None:
    async with serve(store()) as server:
        load = await server.client.post(f"/models/{DEMO}/load", params={"wait": "false"})
        assert load.status_code == 202 and load.json()["state"] == "loading"
        unload = await server.client.post(f"/models/{DEMO}/unload")
        assert unload.status_code == 200 and unload.json()["state"] == "available"
        assert await server.metric("wcodec_model_loads_total", model=DEMO, result="ok") == 1



def _held_point(route: str, served) -> tuple[object, str]:
    """What a route calls to tokenize (or template) its prompt: (object, attribute)."""
    if route == "/tokenize":
        return served, "tokenizer"
    if route.startswith("/v1"):
        return served.tokenizer, "apply_chat_template"
    return inference, "_tokenize"


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions", "/tokenize"])
async def test_prompts_are_tokenized_off_the_event_loop(serve, store, monkeypatch, route) -> None:
    """A prompt of megabytes takes the tokenizer seconds (2 MB: 2 to 6.6 s), as may a chat template
    of many messages: on the event loop, that stalled every other request, /health included. Here
    the tokenizer (or the template) is held until /health has answered."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        entered, gate, waits = threading.Event(), threading.Event(), []
        owner, name = _held_point(route, server.registry.get(DEMO).served)
        real = getattr(owner, name)

        def held(*args, **kwargs):
            entered.set()
            waits.append(gate.wait(10))                  # False: /health never answered meanwhile
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, held)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if route.startswith("/v1") \
            else generate_body(2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(server.client.post, route, json=body))
            await anyio.to_thread.run_sync(entered.wait, 10)
            assert (await server.client.get("/health")).status_code == 200
            gate.set()
        assert waits == [True], waits
