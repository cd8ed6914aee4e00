"""/metrics: every documented family, `wcodec_` names, route templates (not raw paths) as labels."""
from __future__ import annotations

import contextlib
import functools
import json
import re
import threading

import anyio
import pytest
from pydantic import ValidationError
from service_helpers import DEMO, QUEUE_OF_ONE, generate_body, when_queue_full, with_broken_archive

from service.engine.worker import GenRequest
from service.metrics import Metrics
from service.engine.sampling import Finished
from service.model import paged
from service.registry import ModelState

pytestmark = pytest.mark.anyio

FAMILIES = [
    "wcodec_decode_batch_duration_seconds", "wcodec_decode_compressed_bytes_total", "wcodec_decode_decoded_bytes_total",
    "wcodec_model_load_duration_seconds", "wcodec_model_load_throughput_bytes_per_second", "wcodec_model_loads_total",
    "wcodec_model_state", "wcodec_gpu_memory_allocated_bytes", "wcodec_gpu_memory_reserved_bytes",
    "wcodec_model_memory_allocated_bytes", "wcodec_model_memory_reserved_bytes", "wcodec_model_host_weight_bytes", "wcodec_generate_requests_total",
    "wcodec_generate_request_duration_seconds", "wcodec_generate_time_to_first_token_seconds",
    "wcodec_generate_queue_duration_seconds", "wcodec_generate_prefill_duration_seconds",
    "wcodec_generate_time_per_output_token_seconds", "wcodec_generate_prompt_tokens_total",
    "wcodec_generate_generated_tokens_total", "wcodec_generate_prompt_cached_tokens_total",
    "wcodec_generate_preemptions_total",
    "wcodec_generate_queue_depth", "wcodec_generate_batch_size",
    "wcodec_generate_running_requests",
    "wcodec_generate_batch_tokens", "wcodec_generate_inter_token_latency_seconds",
    "wcodec_http_requests_total", "wcodec_http_request_duration_seconds",
    "wcodec_host_cache_bytes", "wcodec_host_cache_entries", "wcodec_host_cache_hits_total",
    "wcodec_host_cache_misses_total", "wcodec_host_cache_pinned_bytes",
]


async def test_every_family_after_a_load_and_a_generate(serve, store) -> None:
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        await server.client.post("/generate", json=generate_body(4))
        await server.client.get(f"/models/{DEMO}")
        text = (await server.client.get("/metrics")).text
        samples = [line for line in text.splitlines() if line and not line.startswith("#")]
        names = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in samples}
        assert all(n.startswith("wcodec_") for n in names), names
        for family in FAMILIES:
            assert any(n == family or n.startswith(family + "_") for n in names), family
        for phase in ("read", "h2d", "decode", "build", "total"):
            assert await server.metric("wcodec_model_load_duration_seconds_count", model=DEMO, phase=phase) == 1
        assert await server.metric("wcodec_gpu_memory_allocated_bytes") == 0              # CPU server
        assert await server.metric("wcodec_model_load_throughput_bytes_per_second", model=DEMO) > 0
        assert await server.metric("wcodec_decode_compressed_bytes_total", model=DEMO, codec="gguf",
                                   device="cpu") > 0
        assert await server.metric("wcodec_generate_time_to_first_token_seconds_count", model=DEMO) == 1
        queue = await server.metric("wcodec_generate_queue_duration_seconds_sum", model=DEMO)
        prefill = await server.metric("wcodec_generate_prefill_duration_seconds_sum", model=DEMO)
        assert queue >= 0 and prefill > 0                                  # the time to first token, split
        assert queue + prefill == pytest.approx(
            await server.metric("wcodec_generate_time_to_first_token_seconds_sum", model=DEMO), abs=1e-9)
        assert await server.metric("wcodec_generate_inter_token_latency_seconds_count", model=DEMO) == 3   # 4 tokens
        assert await server.metric("wcodec_generate_batch_tokens_sum", model=DEMO) \
            == await server.metric("wcodec_generate_prompt_tokens_total", model=DEMO) + 3   # prefill, 3 decodes
        assert await server.metric("wcodec_generate_prompt_tokens_total", model=DEMO) > 0
        assert await server.metric("wcodec_http_requests_total", method="GET", route="/models/{name}",
                                   status="200") == 1


def test_a_long_generation_lands_in_a_finite_bucket() -> None:
    """4096 tokens at a CPU's 80 ms a step take 328 s: the request and HTTP duration buckets stopped
    at 120 s, so such a request fell in +Inf, where histogram_quantile can say no more than 120 s."""
    m = Metrics()
    seconds = 4096 * 0.08
    m.request_seconds.labels(DEMO).observe(seconds)
    m.http_seconds.labels("POST", "/generate", "200").observe(seconds)
    for name, labels in (("wcodec_generate_request_duration_seconds", {"model": DEMO}),
                         ("wcodec_http_request_duration_seconds", {"method": "POST", "route": "/generate",
                                                                   "status": "200"})):
        assert m.registry.get_sample_value(f"{name}_bucket", {**labels, "le": "240.0"}) == 0, name
        assert m.registry.get_sample_value(f"{name}_bucket", {**labels, "le": "480.0"}) == 1, name


def test_a_long_wait_for_the_first_token_lands_in_a_finite_bucket() -> None:
    """A request queued behind long ones on a CPU waits minutes for its first token: the queue,
    prefill and TTFT buckets stopped at 120 s, where histogram_quantile can say no more."""
    m = Metrics()
    for h in (m.queue_seconds, m.prefill_seconds, m.ttft):
        h.labels(DEMO).observe(300.0)
    for name in ("queue_duration", "prefill_duration", "time_to_first_token"):
        sample = f"wcodec_generate_{name}_seconds_bucket"
        assert m.registry.get_sample_value(sample, {"model": DEMO, "le": "240.0"}) == 0, name
        assert m.registry.get_sample_value(sample, {"model": DEMO, "le": "480.0"}) == 1, name


async def test_a_step_is_counted_before_the_rows_it_finished_are_answered(serve, store, monkeypatch) -> None:
    """The step that makes a request's last token is in /metrics before the request is answered:
    the worker's answer (GenRequest.put of the outcome) sees every step already observed."""
    seen: list[float | None] = []
    put = GenRequest.put

    def put_and_look(req, item):
        if isinstance(item, Finished):
            seen.append(server.app.state.metrics.registry.get_sample_value(
                "wcodec_generate_batch_tokens_sum", {"model": DEMO}))
        put(req, item)

    monkeypatch.setattr(GenRequest, "put", put_and_look)
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        await server.client.post("/generate", json=generate_body(4))
        prompt = await server.metric("wcodec_generate_prompt_tokens_total", model=DEMO)
        assert seen == [prompt + 3]                           # prefill and 3 decodes, all observed


async def test_http_methods_are_a_bounded_label(serve, store) -> None:
    """Any token parses as a method (h11): the label takes the standard ones, the rest as OTHER,
    so no client can grow the series."""
    async with serve(store()) as server:
        for i in range(5):
            assert (await server.client.request(f"X{i:04d}", "/health")).status_code == 405
        text = (await server.client.get("/metrics")).text
        assert "X0000" not in text
        assert await server.metric("wcodec_http_requests_total", method="OTHER", route="/health", status="405") == 5


async def test_a_model_whose_file_leaves_the_store_leaves_the_metrics(serve, store, tmp_path) -> None:
    """Its failed state would otherwise stay 1 forever (WcodecModelLoadFailed firing, the
    dashboards listing it)."""
    root = with_broken_archive(store())
    async with serve(root) as server:
        assert (await server.client.post("/models/broken/load")).status_code == 500
        assert await server.metric("wcodec_model_state", model="broken", state="failed") == 1
        (root / "broken.wcodec").unlink()
        assert (await server.client.get("/models")).json()["models"][0]["name"] != "broken"
        text = (await server.client.get("/metrics")).text
        assert 'model="broken"' not in text and f'model="{DEMO}"' in text


@pytest.mark.parametrize("cpu_dtype", ["auto", "float32"])
async def test_models_the_metrics_and_the_budget_count_the_same_bytes(serve, store, cpu_dtype) -> None:
    """/models' weight_bytes is the metrics' figure and what the budget charges: the weights as
    held once the CPU's compute setting is applied (float32: the model cast, twice its bytes; an
    AVX-512 CPU's `auto`: linear16's packed copy of the tied head, 57 MB more). /models showed,
    and the budget charged, the bf16 bytes."""
    async with serve(store(), cpu_dtype=cpu_dtype) as server:
        r = await server.client.post(f"/models/{DEMO}/load")
        assert r.status_code == 200, r.text
        held = r.json()["weight_bytes"]
        assert held == await server.metric("wcodec_model_weight_bytes", model=DEMO, weights="decoded")
        assert held == await server.metric("wcodec_model_memory_allocated_bytes", model=DEMO, device="cpu")
        listed = (await server.client.get("/models")).json()["models"][0]
        assert held == listed["weight_bytes"] == server.registry.used_bytes()
        assert held >= (2 if cpu_dtype == "float32" else 1) * r.json()["decoded_bytes"]


async def test_the_budget_counts_a_float32_cast_before_the_load(serve, store) -> None:
    """Under WCODEC_CPU_DTYPE=float32 a bf16 model takes twice its bytes: the estimate says so, and a
    budget of 1.5x its bf16 bytes refuses it (it loaded, then held 2x)."""
    async with serve(store(), cpu_dtype="float32") as server:
        decoded_bytes = (await server.client.get(f"/models/{DEMO}")).json()["decoded_bytes"]
        server.registry.settings.gpu_memory_budget = int(1.5 * decoded_bytes)
        r = await server.client.post(f"/models/{DEMO}/load")
        assert r.status_code == 507 and r.json()["error_type"] == "insufficient_memory", r.text
        server.registry.settings.gpu_memory_budget = 2 * decoded_bytes
        assert (await server.client.post(f"/models/{DEMO}/load")).status_code == 200


@pytest.mark.parametrize("engine", ["paged", "padded"])
async def test_batch_size_counts_the_rows_a_step_ran_its_prefill_too(serve, store, engine) -> None:
    """One request of 4 tokens alone: 4 steps (its prefill, 3 decodes) of one row each. The prefill
    step was observed as 0 rows (decoded rows only), so a lone client's batch read 0.75 rows a
    step on the dashboard, where TGI's tgi_batch_current_size counts the rows being prefilled."""
    async with serve(store(), preload=[DEMO], engine=engine) as server:
        await server.wait_state(DEMO, ModelState.READY)
        assert (await server.client.post("/generate", json=generate_body(4))).status_code == 200
        assert await server.metric("wcodec_generate_batch_size_count", model=DEMO) == 4
        assert await server.metric("wcodec_generate_batch_size_sum", model=DEMO) == 4
        assert await server.metric("wcodec_generate_batch_size_bucket", model=DEMO, le="1.0") == 4


async def test_a_prompt_cancelled_before_its_prefill_is_not_counted(serve, store, monkeypatch) -> None:
    """wcodec_generate_prompt_tokens_total counts the prompt tokens the model took in, as vLLM's
    prompt_tokens counts a prompt once prefilled: a request whose client left while it waited
    for a row counted its prompt at arrival, though no step ever fed it."""
    async with serve(store(), preload=[DEMO], **QUEUE_OF_ONE) as server:
        await server.wait_state(DEMO, ModelState.READY)

        codes = []

        async def send():
            with contextlib.suppress(ValidationError):        # the cancelled one: no client to answer
                codes.append((await server.client.post("/generate", json=generate_body(4))).status_code)

        def cancel_the_waiting_one():                         # as finish_all does once its client left
            server.registry.get(DEMO).engine.batcher.waiting[0].owner.cancel()

        await when_queue_full(server, monkeypatch, send, lambda: anyio.to_thread.run_sync(cancel_the_waiting_one))
        assert codes == [200]
        assert await server.metric("wcodec_generate_requests_total", model=DEMO, status="cancelled") == 1
        assert await server.metric("wcodec_generate_prompt_tokens_total", model=DEMO) \
            == await server.metric("wcodec_generate_batch_tokens_sum", model=DEMO) - 3     # one prefill, 3 decodes


async def _in_step(server, monkeypatch, nth: int, metric: str) -> float:
    """`metric` of the demo read while a /generate of 6 tokens is held in its `nth` step (the
    paged engine's forward), then the request let go and answered."""
    calls, entered, release = [], threading.Event(), threading.Event()
    real = paged.forward

    def held(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            entered.set()
            release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(paged, "forward", held)
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(server.client.post, "/generate", json=generate_body(6)))
        try:
            await anyio.to_thread.run_sync(entered.wait, 30)
            return await server.metric(metric, model=DEMO)
        finally:
            release.set()

async def test_running_requests_while_one_decodes_and_after(serve, store, monkeypatch) -> None:
    """vLLM's num_requests_running, TGI's tgi_batch_current_size: the rows in the running batch,
    1 while a request decodes, back to 0 once it ends and after an unload. There was no such gauge."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        running = await _in_step(server, monkeypatch, 2, "wcodec_generate_running_requests")   # the first decode
        assert running == 1
        assert await server.metric("wcodec_generate_running_requests", model=DEMO) == 0
        assert (await server.client.post(f"/models/{DEMO}/unload")).status_code == 200
        assert await server.metric("wcodec_generate_running_requests", model=DEMO) == 0


async def test_each_route_counts_its_requests_and_the_tokens_its_usage_reports(serve, store) -> None:
    """A TGI stream, an OpenAI chat stream, a completion of two prompts with n=2 and a /generate
    with best_of=2: four requests, each counted once with one time to first token (a stream's: its
    first token, not its end), one duration and one time per output token, as TGI counts best_of
    and OpenAI's usage n; every generated token counted, and each prompt once, as the usage
    reports them. The completion counted as 4 requests and its prompts twice, the best_of as 2; a
    request for a model not in the store adds no series."""
    chat = {"model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    metric = lambda name: server.metric(f"wcodec_generate_{name}", model=DEMO)
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        c = server.client
        tgi = [line for line in (await c.post("/generate_stream", json=generate_body(6))).text.splitlines()
               if line.startswith("data:")]
        usage = json.loads((await c.post("/v1/chat/completions", json=chat)).text.split("data: ")[-2])["usage"]
        ttft, itl, total = [await metric(f"{f}_seconds_sum") for f in
                            ("time_to_first_token", "inter_token_latency", "request_duration")]
        assert itl > 0 and ttft + itl <= total + 1e-9       # per request: first token + gaps = last token <= end
        prompt = await metric("prompt_tokens_total")
        four = (await c.post("/v1/completions", json={"model": DEMO, "prompt": ["hi", "Once upon a time"],
                                                      "max_tokens": 5, "n": 2})).json()
        assert len(four["choices"]) == 4
        assert await metric("prompt_tokens_total") - prompt == four["usage"]["prompt_tokens"]
        best = await c.post("/generate", json=generate_body(4, best_of=2, do_sample=True, details=True))
        assert best.status_code == 200 and len((details := best.json()["details"])["best_of_sequences"]) == 1, best.text
        assert (await c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})).status_code == 404
        assert await server.metric("wcodec_generate_requests_total", model=DEMO, status="ok") == 4
        for family in ("time_to_first_token", "request_duration", "time_per_output_token"):
            assert await metric(f"{family}_seconds_count") == 4, family
        assert await metric("generated_tokens_total") == len(tgi) + usage["completion_tokens"] \
            + four["usage"]["completion_tokens"] + sum(d["generated_tokens"] for d in (details, *details["best_of_sequences"]))
        assert 'model="nope"' not in (await c.get("/metrics")).text


async def test_generated_tokens_are_counted_as_they_are_made(serve, store, monkeypatch) -> None:
    """vLLM counts generation tokens every step: a long request's tokens show on the dashboard's
    tokens/s while it runs. They were counted when the request ended, so a rate over a window
    shorter than a request read 0, then a burst."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        midway = await _in_step(server, monkeypatch, 4, "wcodec_generate_generated_tokens_total")
        assert midway == 3                                   # the prefill's token and two decodes'
        assert await server.metric("wcodec_generate_generated_tokens_total", model=DEMO) == 6


async def test_a_refused_generation_counts_as_validation(serve, store) -> None:
    """TGI counts a request its validation refuses in tgi_request_failure{err="validation"}: a 422
    (400 on /v1), its body's schema or its values, counts once under the model it names, or the one
    the route would pick; it was in wcodec_http_requests_total alone. A second prompt refused after
    the first's sequences were queued is that one request, not also a cancelled one. Not counted:
    a model not in the store (no series), a body that is no JSON, a route that generates nothing."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        c = server.client
        refused = [
            await c.post("/generate", json=generate_body(4, temperature=-1)),              # the schema's
            await c.post("/generate", json={**generate_body(4, truncate=10**6), "model": DEMO}),   # a value's
            await c.post("/v1/chat/completions", json={"model": "tgi", "messages": []}),
            await c.post("/v1/completions", json={"model": DEMO, "prompt": [[1, 2], [10**7]], "n": 2}),
        ]
        assert [r.status_code for r in refused] == [422, 422, 400, 400], [r.text for r in refused]
        ignored = [
            await c.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": -1}),
            await c.post("/generate", content=b"{not json", headers={"content-type": "application/json"}),
            await c.post("/tokenize", json=generate_body(4, truncate=10**6)),
        ]
        assert [r.status_code for r in ignored] == [400, 422, 422], [r.text for r in ignored]
        counted = {s: await server.metric("wcodec_generate_requests_total", model=DEMO, status=s)
                   for s in ("ok", "error", "cancelled", "overloaded", "validation")}
        assert counted == {"ok": 0, "error": 0, "cancelled": 0, "overloaded": 0, "validation": 4}, counted
        assert await server.metric("wcodec_http_requests_total", method="POST", route="/generate",
                                   status="422") == 3
        assert 'model="nope"' not in (await c.get("/metrics")).text


async def test_a_repeated_chat_reports_its_cached_prompt_tokens(serve, store) -> None:
    """The demo's chat template opens every conversation with one system prompt: the second of two
    chats reads its whole leading blocks from the prefix cache. Its usage says how many tokens
    (prompt_tokens_details.cached_tokens, OpenAI's), the counter adds the same, and the greedy
    answer is the same."""
    chat = {"model": DEMO, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0}
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        first = (await server.client.post("/v1/chat/completions", json=chat)).json()
        cached = await server.metric("wcodec_generate_prompt_cached_tokens_total", model=DEMO)
        second = (await server.client.post("/v1/chat/completions", json=chat)).json()
        hits = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == cached == 0
        assert hits == (second["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0
        assert await server.metric("wcodec_generate_prompt_cached_tokens_total", model=DEMO) == hits
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
