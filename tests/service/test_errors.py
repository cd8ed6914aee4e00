"""Every error path, in TGI's error shape {error, error_type} (the OpenAI routes' shape:
test_openai.py): 422, 404, 503 + Retry-After, 429 + Retry-After,
424, 507 (budget and out-of-memory), 401/403 with the admin token, 500 for a corrupt archive,
and model names that try to leave the store."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from service_helpers import DEMO, QUEUE_OF_ONE, assert_error, generate_body, when_queue_full

from service.load import pipeline
from service.deps import get_settings
from service.engine import grammar
from service.model import paged
from service.registry import ModelState

pytestmark = pytest.mark.anyio
DECODED = 269030016


BAD_BODIES = [
    {"inputs": ""},
    {"parameters": {}},
    {"inputs": "hi", "parameters": {"max_new_tokens": 0}},
    {"inputs": "hi", "parameters": {"top_p": 1.5}},
    {"inputs": "hi", "parameters": {"temperature": 0}},
    {"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
    {"inputs": "hi", "parameters": {"best_of": 2}},                            # best_of needs sampling
    {"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True, "seed": 1}},   # ... and no seed
    {"inputs": "hi", "parameters": {"best_of": 5, "do_sample": True}},
    {"inputs": "hi", "parameters": {"typical_p": 1.0}},                       # TGI's: 0 < typical_p < 1
    {"inputs": "hi", "parameters": {"frequency_penalty": 2.5}},               # TGI's: -2 to 2
    {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": {"type": "nonsense"}}}},   # no such type
    {"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}},
    {"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": {"a": 1}}}},
    {"inputs": "hi", "parameters": {"grammar": {"type": "yaml", "value": "a"}}},
    {"inputs": "hi", "parameters": {"grammar": {"type": "json", "value": {"type": "integer", "minimum": 0}}}},  # not held
    {"inputs": "hi", "parameters": {"grammar": {"type": "json_schema", "value": {"type": "integer"}}}},  # no `schema`
    {"inputs": "hi", "parameters": {"adapter_id": "lora-1"}},
    {"inputs": "hi", "parameters": {"top_n_tokens": 21}},
    {"inputs": "hi", "parameters": {"top_n_tokens": -1}},
    {"inputs": "hi", "parameters": {"max_new_tokens": 5000}},
    {"inputs": "hi", "parameters": {"truncate": 0}},
    {"inputs": "hi", "parameters": {"truncate": 1025}},                       # TGI's: at most the input limit
    {"inputs": "hi", "parameters": {"do_sample": True, "seed": 2**64}},        # was a 500: beyond manual_seed
]


async def test_422_validation(serve, store) -> None:
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        for body in BAD_BODIES:
            for route in ("/generate", "/generate_stream", "/"):
                assert_error(await server.client.post(route, json=body), 422, "validation")
        best_of = {"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True}}     # not when streaming
        assert_error(await server.client.post("/generate_stream", json=best_of), 422, "validation")
        assert_error(await server.client.post("/", json={**best_of, "stream": True}), 422, "validation")
        prefill = {"inputs": "hi", "parameters": {"decoder_input_details": True}}         # TGI's: not streamed
        assert_error(await server.client.post("/generate_stream", json=prefill), 422, "validation")
        assert_error(await server.client.post("/", json={**prefill, "stream": True}), 422, "validation")
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        for bad, param in (({"messages": []}, "messages"), ({**chat, "max_tokens": 0}, "max_tokens"),
                           ({**chat, "stop": ["1", "2", "3", "4", "5"]}, "stop")):
            r = await server.client.post("/v1/chat/completions", json=bad)            # OpenAI's shape and status
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_422_not_json_and_several_ready_models(serve, store) -> None:
    async with serve(store("a", "b"), preload=["a", "b"]) as server:
        await server.wait_state("b", ModelState.READY)
        r = await server.client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert_error(r, 422, "validation")
        body = assert_error(await server.client.post("/generate", json=generate_body(2)), 422, "validation")
        assert "several models" in body["error"]
        assert (await server.client.post("/generate", json={**generate_body(2), "model": "b"})).status_code == 200


async def test_404_unknown_model_and_route(serve, store) -> None:
    async with serve(store()) as server:
        c = server.client
        assert_error(await c.get("/models/nope"), 404, "not_found")
        assert_error(await c.post("/models/nope/load"), 404, "not_found")
        assert_error(await c.post("/models/nope/unload"), 404, "not_found")
        assert_error(await c.post("/generate", json={**generate_body(), "model": "nope"}), 404, "not_found")
        assert_error(await c.get("/no/such/route"), 404, "not_found")


@pytest.mark.parametrize("path", ["/models/..%2F..%2Fetc%2Fpasswd/load", "/models/a/b/load", "/models/a%2Fb/load",
                                  "/models/%2E%2E/load", "/models/.hidden/load", "/models/a..b/load",
                                  "/models/a%5Cb/load", "/models/a%00b/load", "/models/" + "x" * 200 + "/load"])
async def test_names_cannot_leave_the_store(serve, store, tmp_path, path) -> None:
    (tmp_path / "secret.wcodec").write_bytes(b"outside the store")
    async with serve(store()) as server:
        r = await server.client.post(path)
        assert r.status_code in (404, 422), r.text
        assert r.json()["error_type"] in ("not_found", "validation")
        assert [m["name"] for m in (await server.client.get("/models")).json()["models"]] == [DEMO]


async def test_503_with_retry_after_until_ready(serve, store) -> None:
    async with serve(store(), retry_after_s=7) as server:
        r = await server.client.post("/generate", json=generate_body())
        assert_error(r, 503, "model_not_ready")
        assert r.headers["retry-after"] == "7"
        r = await server.client.post("/generate", json={**generate_body(), "model": DEMO})
        assert_error(r, 503, "model_not_ready")
        assert r.headers["retry-after"] == "7"          # it said "model '...' is available": it is not loaded
        assert r.json()["error"] == f"model '{DEMO}' is not ready (state available): POST /models/{DEMO}/load loads it"
        assert_error(await server.client.get("/health/ready"), 503, "model_not_ready")


async def test_429_when_the_queue_is_full(serve, store, monkeypatch) -> None:
    async with serve(store(), preload=[DEMO], **QUEUE_OF_ONE) as server:
        await server.wait_state(DEMO, ModelState.READY)
        held = []

        async def send():
            held.append(await server.client.post("/generate", json=generate_body(4)))

        rejected = await when_queue_full(server, monkeypatch, send,
                                         lambda: server.client.post("/generate", json=generate_body(4)))
        body = assert_error(rejected, 429, "overloaded")
        assert body["error"].startswith("Model is overloaded: "), body         # TGI's words, then ours
        assert rejected.headers["retry-after"] == "1"
        assert [r.status_code for r in held] == [200, 200]
        assert await server.metric("wcodec_generate_requests_total", model=DEMO, status="overloaded") == 1
        # TGI's max_concurrent_requests counts every request in flight, running or waiting: the 429
        # came with two in flight (one running, one waiting); /info said 1 (WCODEC_MAX_QUEUE alone)
        assert (await server.client.get("/info")).json()["max_concurrent_requests"] == len(held) == 2


async def test_429_when_no_grammar_compile_slot_frees(serve, store) -> None:
    """Both compile slots busy (slow patterns): a grammar request waited without bound; it waits
    WCODEC_GRAMMAR_COMPILE_S for a slot, then answers TGI's overloaded 429, and the event loop
    answers other requests meanwhile."""
    async with serve(store(), preload=[DEMO], grammar_compile_s=1) as server:
        await server.wait_state(DEMO, ModelState.READY)
        body = generate_body(4, grammar={"type": "regex", "value": "[0-9]{3}"})
        held = [grammar._compiles.acquire(timeout=0) for _ in range(grammar.COMPILES)]
        try:
            assert all(held)
            started = time.monotonic()
            waiting = asyncio.ensure_future(server.client.post("/generate", json=body))
            await asyncio.sleep(0.3)
            assert (await server.client.get("/health")).status_code == 200 and not waiting.done()
            rejected = await asyncio.wait_for(waiting, 10)
        finally:
            for _ in range(grammar.COMPILES):
                grammar._compiles.release()
        assert_error(rejected, 429, "overloaded")
        assert rejected.headers["retry-after"] == "1" and 1 <= time.monotonic() - started < 10
        assert rejected.json()["error"].startswith("Model is overloaded: `grammar`: 2 grammars are being compiled")
        assert await server.metric("wcodec_generate_requests_total", model=DEMO, status="overloaded") == 1
        assert (await server.client.post("/generate", json=body)).status_code == 200     # not kept


async def test_424_when_generation_fails(serve, store, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        monkeypatch.setattr(paged, "forward", broken)
        body = assert_error(await server.client.post("/generate", json=generate_body()), 424, "generation")
        assert "the device fell over" in body["error"]
        assert_error(await server.client.post("/generate_stream", json=generate_body()), 424, "generation")
        assert_error(await server.client.post("/", json={**generate_body(), "stream": True}), 424, "generation")
        assert server.registry.get(DEMO).in_flight == 0
        for gauge in ("wcodec_generate_running_requests", "wcodec_generate_queue_depth", "wcodec_kv_cache_blocks_used"):
            assert await server.metric(gauge, model=DEMO) == 0, gauge                   # back at rest
        monkeypatch.undo()
        assert (await server.client.post("/generate", json=generate_body(2))).status_code == 200
        counted = {s: await server.metric("wcodec_generate_requests_total", model=DEMO, status=s)
                   for s in ("ok", "error", "cancelled", "overloaded")}
        assert counted == {"ok": 1, "error": 3, "cancelled": 0, "overloaded": 0}           # each once
        assert await server.metric("wcodec_generate_generated_tokens_total", model=DEMO) == 2


async def test_507_when_the_model_cannot_fit(serve, store) -> None:
    """A budget of one model as held and 1000 bytes (more than its bf16 bytes where the CPU's
    compute adds to them: the estimate counts that now, and refused the preload of DECODED + 1000)."""
    async with serve(store("small", "big"), preload=["small"]) as server:
        await server.wait_state("small", ModelState.READY)
        server.registry.settings.gpu_memory_budget = server.registry.get("small").weight_bytes + 1000
        lease = server.registry.acquire("small")                 # busy: it may not be evicted
        body = assert_error(await server.client.post("/models/big/load"), 507, "insufficient_memory")
        assert "needs" in body["error"]
        assert server.registry.get("small").state is ModelState.READY        # nothing else disturbed
        assert server.registry.get("big").state is ModelState.AVAILABLE
        lease.release()
        r = await server.client.post("/models/big/load")                     # idle now: evicted
        assert r.status_code == 200 and r.json()["state"] == "ready"
        assert server.registry.get("small").state is ModelState.AVAILABLE


async def test_507_budget_smaller_than_the_model(serve, store) -> None:
    async with serve(store(), gpu_memory_budget=1000) as server:
        assert_error(await server.client.post(f"/models/{DEMO}/load"), 507, "insufficient_memory")
        assert_error(await server.client.post(f"/models/{DEMO}/load", params={"wait": "false"}), 507,
                     "insufficient_memory")
        assert (await server.client.get(f"/models/{DEMO}")).json()["state"] == "available"


async def test_eviction_unloads_the_least_recently_used(serve, store) -> None:
    """A budget of two models as held (more than their bf16 bytes where the CPU's compute adds to
    them: an AVX-512 CPU's linear16 packs a copy of the demo's tied head)."""
    async with serve(store("a", "b", "c")) as server:
        c = server.client
        r = await c.post("/models/a/load")
        assert r.status_code == 200
        server.registry.settings.gpu_memory_budget = 2 * r.json()["weight_bytes"]
        assert (await c.post("/models/b/load")).status_code == 200
        assert (await c.post("/generate", json={**generate_body(1), "model": "a"})).status_code == 200   # a: recent
        assert (await c.post("/models/c/load")).status_code == 200
        states = {m["name"]: m["state"] for m in (await c.get("/models")).json()["models"]}
        assert states == {"a": "ready", "b": "available", "c": "ready"}


async def test_out_of_memory_fails_that_load_alone(serve, store, monkeypatch) -> None:
    real = pipeline.decode_archive

    def oom(path, *args, **kwargs):
        if "big" in str(path):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pipeline, "decode_archive", oom)
    async with serve(store("small", "big"), preload=["small"]) as server:
        await server.wait_state("small", ModelState.READY)
        body = assert_error(await server.client.post("/models/big/load"), 507, "insufficient_memory")
        assert "out of memory" in body["error"]
        info = (await server.client.get("/models/big")).json()
        assert info["state"] == "failed" and "out of memory" in info["last_error"]
        assert (await server.client.post("/generate", json={**generate_body(2), "model": "small"})).status_code == 200
        monkeypatch.setattr(pipeline, "decode_archive", real)
        assert (await server.client.post("/models/big/load")).json()["state"] == "ready"


async def test_corrupt_archive_fails_its_load(serve, tmp_path, demo_archive) -> None:
    data = bytearray(demo_archive.read_bytes())
    data[len(data) // 2] ^= 0xFF                                   # inside some tensor's stream
    root = tmp_path / "store"
    root.mkdir()
    (root / "bad.wcodec").write_bytes(bytes(data))
    async with serve(root) as server:
        body = assert_error(await server.client.post("/models/bad/load"), 500, "load_failed")
        assert "checksum" in body["error"] and body["error"].count("\n") == 0
        assert (await server.client.get("/models/bad")).json()["state"] == "failed"
        assert (await server.client.post("/models/bad/unload")).json()["state"] == "available"


async def test_admin_token(serve, store) -> None:
    async with serve(store(), admin_token="s3cret") as server:
        c = server.client
        r = await c.post(f"/models/{DEMO}/load")
        assert_error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(await c.post(f"/models/{DEMO}/load", headers={"Authorization": "Bearer nope"}), 403, "forbidden")
        assert_error(await c.post(f"/models/{DEMO}/unload", headers={"Authorization": "Bearer nope"}), 403,
                     "forbidden")
        assert (await c.get("/models")).status_code == 200                   # reading needs no token
        ok = {"Authorization": "Bearer s3cret"}
        assert (await c.post(f"/models/{DEMO}/load", headers=ok)).status_code == 200
        assert (await c.post(f"/models/{DEMO}/unload", headers=ok)).status_code == 200


async def test_limits_come_from_the_settings_dependency(serve, store) -> None:
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        small = server.app.state.settings.model_copy(update={"max_total_tokens": 40, "max_input_tokens": 30})
        server.app.dependency_overrides[get_settings] = lambda: small
        body = assert_error(await server.client.post("/generate", json=generate_body(12)), 422, "validation")
        assert "must have less than 30 tokens" in body["error"]
        assert (await server.client.get("/info")).json()["max_total_tokens"] == 40
        server.app.dependency_overrides.clear()
        assert (await server.client.post("/generate", json=generate_body(2))).status_code == 200


async def test_a_chat_template_that_refuses_the_messages_is_a_template_error(serve, store) -> None:
    """Mistral's, Llama-2's and Gemma's templates raise_exception on roles that do not alternate:
    TGI's 422 template_error (OpenAI's 400), not a 500."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        tok = server.registry.get(DEMO).served.tokenizer
        kept = tok.chat_template
        tok.__dict__.pop("_template", None)
        tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        try:
            body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "max_tokens": 2}
            r = await server.client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "messages"
            assert_error(await server.client.post("/chat_tokenize", json=body), 422, "template_error")
        finally:
            tok.chat_template = kept
            tok.__dict__.pop("_template", None)


async def test_an_unexpected_exception_keeps_the_routes_error_shape(serve, store, monkeypatch) -> None:
    """A bug (here a tokenizer that fails) is a 500 in TGI's shape, or OpenAI's on /v1, never
    Starlette's text/plain; the exception still reaches the server's log."""
    import httpx

    from service import inference

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        monkeypatch.setattr(inference, "_tokenize", broken)
        transport = httpx.ASGITransport(app=server.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://wcodec.test") as client:
            body = assert_error(await client.post("/generate", json=generate_body(2)), 500, "internal")
            assert "RuntimeError: boom" in body["error"]
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text


async def test_413_for_a_body_over_the_payload_limit(serve, store) -> None:
    """TGI's router refuses a body over its payload limit (2 MB) with 413 before parsing it; a body
    of any size was read whole and parsed (a 12 MB prompt: 7.8 s and 1.4 GB more memory, then a
    422). Said by its Content-Length, or sent in chunks without one; OpenAI's shape on /v1. Each is
    counted under its route's template (one refused unread was refused before the routing, and counted
    `<unmatched>`); a path no route takes is a 404 whatever its body, as TGI's."""
    async with serve(store(), payload_limit=1000) as server:
        big = json.dumps({"inputs": "a " * 600})

        async def chunks():
            for _ in range(4):
                yield big[:400].encode()
        headers = {"content-type": "application/json"}
        for body in (big, chunks()):
            r = await server.client.post("/generate", content=body, headers=headers)
            assert "1000 bytes" in assert_error(r, 413, "payload_too_large")["error"]
        r = await server.client.post("/v1/completions", json={"prompt": "a " * 600})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
        r = await server.client.post("/generate", json={"inputs": "a " * 400})       # 810 bytes: read, parsed
        assert_error(r, 503, "model_not_ready")
        assert (await server.client.post("/nope", content=big, headers=headers)).status_code == 404   # as TGI
        counted = {route: await server.metric("wcodec_http_requests_total", route=route, method="POST", status="413")
                   for route in ("/generate", "/v1/completions", "<unmatched>")}
        assert counted == {"/generate": 2, "/v1/completions": 1, "<unmatched>": 0}, counted   # refused unread too


async def test_a_lone_surrogate_in_a_stop_sequence_is_refused(serve, store) -> None:
    """JSON lets a string carry a lone UTF-16 surrogate, which no generated text can hold: a stop
    sequence of one was taken (200) and could never stop anything; the prompt's was refused."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        headers = {"content-type": "application/json"}
        body = b'{"inputs": "hi", "parameters": {"max_new_tokens": 2, "stop": ["a\\ud800"]}}'
        r = await server.client.post("/generate", headers=headers, content=body)
        assert "`stop` is not valid Unicode" in assert_error(r, 422, "validation")["error"]
        r = await server.client.post("/v1/completions", headers=headers,
                                     content=b'{"prompt": "hi", "max_tokens": 2, "stop": "\\udc00"}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


async def test_a_body_nested_past_pythons_json_is_a_validation_error(serve, store) -> None:
    """A body of arrays nested 100 000 deep (200 KB) sent without a JSON content type: the route
    refuses it (422; 400 on /v1), and counting that refusal parsed it (refusals.py), whose
    RecursionError was a 500."""
    deep = b"[" * 100_000 + b"]" * 100_000
    async with serve(store()) as server:
        for headers in ({"content-type": "text/plain"}, {}):
            for route in ("/generate", "/generate_stream", "/"):
                r = await server.client.post(route, content=deep, headers=headers)
                assert_error(r, 422, "validation")
            for route in ("/v1/chat/completions", "/v1/completions"):
                r = await server.client.post(route, content=deep, headers=headers)
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


async def test_a_field_of_the_wrong_json_type_is_refused_as_tgis_serde_refuses_it(serve, store) -> None:
    """TGI's router reads a request with serde: "20" or 2.0 or true for max_new_tokens, "yes" for a
    boolean, are 422s (pydantic's default coerced them, and "yes" started a stream); a JSON
    integer for a float parameter is taken, as serde takes it."""
    wrong = [{"max_new_tokens": "20"}, {"max_new_tokens": 2.0}, {"max_new_tokens": True}, {"do_sample": "yes"},
             {"details": 1}, {"seed": "7"}, {"top_k": 1.0}]
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        for params in wrong:
            for route in ("/generate", "/generate_stream", "/"):
                r = await server.client.post(route, json={"inputs": "hi", "parameters": params})
                assert_error(r, 422, "validation")
        assert_error(await server.client.post("/", json={"inputs": "hi", "stream": "yes"}), 422, "validation")
        ok = await server.client.post("/generate", json={"inputs": "hi", "parameters": {
            "max_new_tokens": 2, "temperature": 1, "do_sample": True, "seed": 3}})
        assert ok.status_code == 200 and ok.json()["generated_text"], ok.text
