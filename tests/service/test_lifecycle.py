"""The model lifecycle through the HTTP API on the real demo model: start-up, load, generate
(the chat-formatted question answers Paris), stream, chat, metrics, unload back to baseline."""
from __future__ import annotations

import gc
import json
import shutil
import weakref

import pytest
from service_helpers import CHAT_PROMPT, DEMO, generate_body, with_broken_archive

from service.load import demo as demo_module
from service.model import cpu_dtype
from service.registry import ModelState

pytestmark = pytest.mark.anyio


def sse_events(text: str) -> list[dict | str]:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_stream_matches(events: list[dict], body: dict, tokenizer) -> None:
    """TGI's stream: one event per token, the last one with the text and details of /generate."""
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == body["generated_text"]
    assert [e["token"] for e in events] == body["details"]["tokens"]
    assert events[-1]["generated_text"] == body["generated_text"]
    assert events[-1]["details"]["finish_reason"] == "eos_token"
    assert events[-1]["details"]["input_length"] == len(tokenizer(CHAT_PROMPT)["input_ids"])


async def test_load_generate_stream_unload(serve, store) -> None:
    async with serve(store()) as server:
        c = server.client
        listed = (await c.get("/models")).json()["models"]
        assert [(m["name"], m["state"]) for m in listed] == [(DEMO, "available")]
        # Q4_1 blocks kept (codec gguf): 0.335 of the bf16 weights they dequantize to
        assert 0.3 < listed[0]["ratio"] < 0.37 and listed[0]["decoded_bytes"] == 269030016

        r = await c.post(f"/models/{DEMO}/load")
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["state"] == "ready" and info["device"] == "cpu" and info["loaded_at"]
        assert info["progress"] == {"phase": "ready", "bytes_done": 269030016, "bytes_total": 269030016}
        assert all(info["last_load"][k] > 0 for k in ("read_s", "decode_s", "build_s", "total_s"))
        ready = (await c.get("/health/ready")).json()
        gauge = await server.metric("wcodec_process_start_to_ready_seconds")
        assert ready == {"status": "ready", "ready_models": [DEMO], "process_start_to_ready_s": pytest.approx(gauge)}
        assert gauge > 0

        r = await c.post("/generate", json=generate_body())
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["generated_text"].startswith("The capital of France is Paris"), body
        details = body["details"]
        assert details["finish_reason"] == "eos_token" and details["seed"] is None
        assert details["generated_tokens"] == len(details["tokens"]) and details["tokens"][-1]["special"]

        r = await c.post("/generate_stream", json=generate_body())
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert_stream_matches(sse_events(r.text), body, server.registry.get(DEMO).served.tokenizer)

        assert await server.metric("wcodec_decode_batch_duration_seconds_count", model=DEMO, codec="gguf",
                                   device="cpu") > 0
        # the bf16 weights (float32 under WCODEC_CPU_DTYPE=float32), plus, where bf16 is not native
        # to this CPU, the float32 scratch (a block of rows of the tied 49152 x 576 head)
        itemsize = server.registry.get(DEMO).served.dtype.itemsize
        head = server.registry.get(DEMO).served.model.lm_head
        scratch = (cpu_dtype.CHUNK_FLOATS // 576) * 576 * 4 if isinstance(head, cpu_dtype.MixedLinear) else 0
        copy = head._buffers.get("packed_copy")                  # linear16's packed copy of the tied head
        scratch += 0 if copy is None else copy.nbytes
        assert await server.metric("wcodec_model_memory_allocated_bytes", model=DEMO,
                                   device="cpu") == 269030016 * itemsize // 2 + scratch

        weight = weakref.ref(server.registry.get(DEMO).served.model.model.embed_tokens.weight)
        r = await c.post(f"/models/{DEMO}/unload")
        assert r.status_code == 200 and r.json()["state"] == "available"
        gc.collect()
        assert weight() is None, "the decoded weights outlive the unload"
        assert server.registry.used_bytes() == 0
        assert await server.metric("wcodec_model_memory_allocated_bytes", model=DEMO, device="cpu") == 0
        assert await server.metric("wcodec_model_state", model=DEMO, state="available") == 1
        assert (await c.post("/generate", json=generate_body())).status_code == 503


async def test_compat_route_and_chat(serve, store) -> None:
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        c = server.client
        r = await c.post("/", json={**generate_body(), "stream": False})
        assert r.status_code == 200 and r.json()[0]["generated_text"].startswith("The capital of France is Paris")
        r = await c.post("/", json={**generate_body(), "stream": True})
        assert sse_events(r.text)[-1]["generated_text"].startswith("The capital of France is Paris")

        question = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
                    "temperature": 0}
        r = await c.post("/v1/chat/completions", json=question)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"].startswith("The capital of France is Paris")
        assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] > 0
        r = await c.post("/v1/chat/completions", json={**question, "stream": True})
        chunks = sse_events(r.text)
        assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "stop"
        text = "".join(ch["choices"][0]["delta"]["content"] for ch in chunks[:-1])
        assert text == body["choices"][0]["message"]["content"]

        info = (await c.get("/info")).json()
        assert info["model_id"] == DEMO and info["model_device_type"] == "cpu" and info["max_total_tokens"] > 0


async def test_sampling_parameters_and_stops(serve, store) -> None:
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        c = server.client
        sampled = [(await c.post("/generate", json=generate_body(8, do_sample=True, temperature=0.9, top_k=40,
                                                                     top_p=0.9, seed=7))).json() for _ in range(2)]
        assert sampled[0] == sampled[1] and sampled[0]["details"]["seed"] == 7
        r = (await c.post("/generate", json=generate_body(12, stop=[" France"]))).json()
        assert r["details"]["finish_reason"] == "stop_sequence" and r["generated_text"].endswith(" France")
        r = (await c.post("/generate", json=generate_body(3, return_full_text=True, details=False))).json()
        assert r["generated_text"].startswith(CHAT_PROMPT) and r.get("details") is None
        r = (await c.post("/generate", json=generate_body(3, repetition_penalty=1.3, truncate=20))).json()
        assert r["details"]["finish_reason"] == "length" and r["details"]["generated_tokens"] == 3


async def test_wait_false_answers_202_with_progress(serve, store) -> None:
    async with serve(store()) as server:
        r = await server.client.post(f"/models/{DEMO}/load", params={"wait": "false"})
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "loading" and r.json()["progress"]["bytes_total"] == 269030016
        await server.wait_state(DEMO, ModelState.READY)
        info = (await server.client.get(f"/models/{DEMO}")).json()
        assert info["progress"]["bytes_done"] == info["progress"]["bytes_total"]
        r = await server.client.post(f"/models/{DEMO}/load", params={"wait": "false"})
        assert r.status_code == 200 and r.json()["state"] == "ready"


async def test_startup_loads_the_demo_while_health_answers(serve, store) -> None:
    async with serve(store(), demo=True, preload=None) as server:
        assert (await server.client.get("/health")).status_code == 200
        r = await server.client.get("/health/ready")
        assert r.status_code == 503 and r.headers["retry-after"]
        await server.wait_state(DEMO, ModelState.READY)
        assert (await server.client.get("/health/ready")).status_code == 200
        # README: liveness alone (it answered an empty `ready_models` while the demo was ready)
        assert (await server.client.get("/health")).json() == {"status": "ok"}
        r = await server.client.post("/generate", json=generate_body())
        assert r.json()["generated_text"].startswith("The capital of France is Paris")


async def test_empty_store_builds_the_demo(serve, tmp_path, demo_archive, monkeypatch) -> None:
    def fake_build(store, workers=None):            # the real build ran once, for the session
        store.mkdir(parents=True, exist_ok=True)
        return shutil.copy(demo_archive, store / f"{DEMO}.wcodec")

    monkeypatch.setattr(demo_module, "build_demo", fake_build)
    async with serve(tmp_path / "empty", demo=True, preload=None) as server:
        await server.wait_state(DEMO, ModelState.READY)
        assert (tmp_path / "empty" / f"{DEMO}.wcodec").is_file()


async def test_tiny_model_anywhere(serve, tmp_path, tiny_archive) -> None:
    """The self-contained tiny model (what the GPU tests use) loads and generates on the CPU."""
    (tmp_path / "s").mkdir()
    shutil.copy(tiny_archive, tmp_path / "s" / "tiny.wcodec")
    async with serve(tmp_path / "s", preload=["tiny"]) as server:
        await server.wait_state("tiny", ModelState.READY)
        r = await server.client.post("/generate", json={"inputs": "What is", "parameters": {"max_new_tokens": 5}})
        assert r.status_code == 200 and r.json()["details"]["generated_tokens"] >= 1
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert (await server.client.post("/v1/chat/completions", json=chat)).status_code == 200


async def test_a_load_sent_beside_an_unload_ends_with_the_model_loaded(serve, store) -> None:
    """Triton serializes a model's control calls: the load waits for the unload, then loads again
    (it answered "ready" while the unload that followed left the model unloaded)."""
    import asyncio
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        unload = asyncio.ensure_future(server.registry.unload(DEMO))
        await asyncio.sleep(0)                  # the unload's task is made, and has not run yet
        loaded = await server.registry.load(DEMO)
        assert (await unload).state is not ModelState.UNLOADING
        assert loaded.state is ModelState.READY and server.registry.get(DEMO).state is ModelState.READY
        assert (await server.client.post("/generate", json=generate_body(4))).status_code == 200


async def test_preloads_load_or_fail_each_on_their_own(serve, store) -> None:
    """A typo or a broken archive in WCODEC_PRELOAD stopped every preload after it; readiness
    follows WCODEC_DEFAULT_MODEL where it names one."""
    root = with_broken_archive(store())
    async with serve(root, preload=["typo", "broken", DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        assert server.registry.get("broken").state is ModelState.FAILED
        assert (await server.client.get("/health/ready")).status_code == 200
    async with serve(root, preload=[DEMO], default_model="broken") as server:
        await server.wait_state(DEMO, ModelState.READY)
        r = await server.client.get("/health/ready")
        assert r.status_code == 503 and "'broken'" in r.json()["error"]


async def test_a_preload_the_memory_budget_refuses_is_failed_with_its_error(serve, store) -> None:
    """README: a failed preload is `failed` in /models. Refused by WCODEC_GPU_MEMORY_BUDGET (507,
    before the load began) it stayed `available`, its `last_error` null."""
    async with serve(store(), preload=[DEMO], gpu_memory_budget=1000) as server:
        await server.registry.startup
        info = (await server.client.get(f"/models/{DEMO}")).json()
        assert info["state"] == "failed" and "the budget of 1000 bytes" in info["last_error"], info
        assert (await server.client.get("/health/ready")).status_code == 503


async def test_readiness_forgets_a_preload_error_once_that_model_loads(serve, store) -> None:
    """/health/ready's 503 kept the failed preload's error after the model had loaded since (and was
    unloaded again): the error of a start-up that is over."""
    async with serve(store(), preload=[DEMO], gpu_memory_budget=1000) as server:
        await server.registry.startup
        assert "the budget of 1000 bytes" in (await server.client.get("/health/ready")).json()["error"]
        server.registry.settings = server.registry.settings.model_copy(update={"gpu_memory_budget": None})
        assert (await server.client.post(f"/models/{DEMO}/load")).status_code == 200
        assert (await server.client.post(f"/models/{DEMO}/unload")).status_code == 200
        r = await server.client.get("/health/ready")
        assert r.status_code == 503 and r.json()["error"] == "no model is ready yet"


@pytest.mark.parametrize("weights", ["decoded", "compressed"])
async def test_an_unreadable_archive_is_a_failed_load_in_both_weights_modes(serve, store, weights) -> None:
    root = with_broken_archive(store())
    async with serve(root) as server:
        r = await server.client.post("/models/broken/load", params={"weights": weights})
        assert r.status_code == 500 and r.json()["error_type"] == "load_failed", r.text
        assert server.registry.get("broken").state is ModelState.FAILED
        assert await server.metric("wcodec_model_loads_total", model="broken", result="failed") == 1


async def test_a_load_waiting_for_an_unload_does_not_hold_up_other_models(serve, store) -> None:
    """Model a drains a request before it unloads, and a load of a waits for that: a load of b
    goes on meanwhile (it waited behind the registry's lock)."""
    import asyncio
    async with serve(store(DEMO, "b"), preload=[DEMO]) as server:
        registry = server.registry
        await server.wait_state(DEMO, ModelState.READY)
        lease = registry.acquire(DEMO)                     # a request in flight on a
        try:
            unload = asyncio.ensure_future(registry.unload(DEMO))
            reload = asyncio.ensure_future(registry.load(DEMO))
            await asyncio.sleep(0.1)
            assert registry.get(DEMO).state is ModelState.UNLOADING and not reload.done()
            assert (await asyncio.wait_for(registry.load("b"), 60)).state is ModelState.READY
        finally:
            lease.release()
        await unload
        assert (await reload).state is ModelState.READY


async def test_eviction_marks_every_victim_before_it_waits_on_any(serve, store, monkeypatch) -> None:
    """Loading c must unload a and b: both stop taking requests at once, so b cannot be given a
    request while a unloads and then be unloaded under it."""
    import asyncio
    from service.errors import ModelNotReady
    async with serve(store(DEMO, "b", "c")) as server:
        registry = server.registry
        for name in (DEMO, "b"):
            await registry.load(name)
            registry.get(name).weight_bytes = 400          # budget units of this test
        registry.settings = registry.settings.model_copy(update={"gpu_memory_budget": 1000})
        monkeypatch.setattr(registry.loader, "estimate_bytes", lambda *a: 700)
        load_c = asyncio.ensure_future(registry.load("c"))
        while registry.get(DEMO).state is ModelState.READY:
            await asyncio.sleep(0)
        assert registry.get("b").state is ModelState.UNLOADING
        with pytest.raises(ModelNotReady):
            registry.acquire("b")
        registry.settings = registry.settings.model_copy(update={"gpu_memory_budget": None})   # c takes
        assert (await load_c).state is ModelState.READY          # more than the fake 700 (_check_charge)


async def test_models_say_how_a_model_is_held_not_what_was_asked(serve, tmp_path, tiny_archive) -> None:
    """An int8 archive asked for compressed is held decoded (its tensors are no float streams):
    /models said "compressed" while /metrics counted decoded bytes."""
    from codec.decode import load
    from codec.encode import compress_source
    from codec.sources import StateDictSource
    model = load(tiny_archive, workers=1)
    root = tmp_path / "store"
    root.mkdir()
    with StateDictSource(model.state_dict, model.files) as source:
        compress_source(source, root / "q.wcodec", workers=1, lossy="int8")
    async with serve(root) as server:
        r = await server.client.post("/models/q/load", params={"weights": "compressed"})
        assert r.status_code == 200 and r.json()["weights"] == "decoded", r.text
        assert await server.metric("wcodec_model_weight_bytes", model="q", weights="compressed") == 0
        assert await server.metric("wcodec_model_weight_bytes", model="q", weights="decoded") > 0


@pytest.mark.parametrize("weights", ["decoded", "compressed"])
async def test_an_archive_this_server_cannot_build_is_a_typed_failed_load(serve, tmp_path, minilm_dir, weights) -> None:
    """MiniLM (BERT, no LM head): the same typed load_failed in both modes (compressed mode raised
    an AttributeError from deep in its schedule, with a traceback in the log)."""
    from codec.encode import compress
    root = tmp_path / "store"
    root.mkdir()
    compress(minilm_dir, root / "m.wcodec", workers=1)
    async with serve(root) as server:
        r = await server.client.post("/models/m/load", params={"weights": weights})
        assert r.status_code == 500 and r.json()["error_type"] == "load_failed", r.text
        assert "tensors unknown to" in r.json()["error"] and "AttributeError" not in r.json()["error"]
