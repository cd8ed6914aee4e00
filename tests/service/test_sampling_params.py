"""Sampling parameters through the routes, against TGI's router and OpenAI's API: one request's
parameters never fail another's generation, numbers JSON can carry but float32 cannot (1e309 is
inf) are refused, best_of's choice (TGI: the highest mean log-probability a token), a stream's
details only when asked, `truncate` bounded as TGI bounds it, and an omitted max_new_tokens cut
to the context the prompt leaves (TGI's default)."""
from __future__ import annotations

import json
import math

import anyio
import pytest
from service_helpers import CHAT_PROMPT, DEMO, assert_error, generate_body

from service import tgi
from service.engine import logits
from service.engine.sampling import Finished, TokenEvent
from service.inference import Started
from service.registry import ModelState
from service.schemas.tgi import GenerateParameters

pytestmark = pytest.mark.anyio
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def ready(server) -> None:
    await server.wait_state(DEMO, ModelState.READY)


async def together(client, *bodies: dict) -> list:
    """The bodies posted to /generate at once (each a step apart: they share the running batch)."""
    out = [None] * len(bodies)

    async def post(i: int, body: dict) -> None:
        await anyio.sleep(0.3 * i)
        out[i] = await client.post("/generate", json=body)
    async with anyio.create_task_group() as tg:
        for i, body in enumerate(bodies):
            tg.start_soon(post, i, body)
    return out


async def test_a_tiny_repetition_penalty_fails_no_one(serve, store) -> None:
    """repetition_penalty 1e-300 is 0 in float32: a seen token's logit / 0 was inf, softmax nan,
    and multinomial raised, failing the whole step: every row in the batch answered 424."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        alone = (await server.client.post("/generate", json=generate_body(24))).json()
        tiny = generate_body(4, do_sample=True, seed=1, repetition_penalty=1e-300)
        plain, odd = await together(server.client, generate_body(24), tiny)
        assert plain.status_code == 200 and plain.json()["generated_text"] == alone["generated_text"], plain.text
        assert odd.status_code == 200, odd.text
        greedy = (await server.client.post("/generate", json=generate_body(4, repetition_penalty=1e-300))).json()
        assert all(t["logprob"] is not None for t in greedy["details"]["tokens"]), greedy      # was NaN: null
        r = await server.client.post("/v1/chat/completions", json={**CHAT, "repetition_penalty": 1e-300,
                                                                   "temperature": 1, "seed": 1})
        assert r.status_code == 200, r.text


async def test_a_row_whose_sampling_fails_fails_alone(serve, store, monkeypatch) -> None:
    """Whatever a row's parameters do to its sampling, the other rows of the step go on."""
    real = logits.sample

    def failing(logits, row):
        if row.params.seed == 666:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, row)
    monkeypatch.setattr(logits, "sample", failing)
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        plain, odd = await together(server.client, generate_body(24), generate_body(4, do_sample=True, seed=666))
        assert plain.status_code == 200, plain.text
        assert_error(odd, 424, "generation")


NOT_FINITE = [("temperature", "1e309"), ("repetition_penalty", "1e309"), ("top_p", "NaN")]


async def test_numbers_float32_cannot_hold_are_refused(serve, store) -> None:
    """JSON's 1e309 parses to inf (and Python's parser takes NaN): temperature inf made every
    logit 0 and a grammar's -inf nan (a failed step); TGI's router cannot parse them at all."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        for field, number in NOT_FINITE:
            body = f'{{"inputs": "hi", "parameters": {{"max_new_tokens": 2, "{field}": {number}}}}}'
            r = await server.client.post("/generate", content=body, headers={"content-type": "application/json"})
            assert_error(r, 422, "validation")
        body = json.dumps(CHAT)[:-1] + ', "repetition_penalty": 1e309}'
        r = await server.client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


def sequence(*logprobs: float) -> Finished:
    tokens = [TokenEvent(i, "x", lp, False) for i, lp in enumerate(logprobs)]
    return Finished("x" * len(tokens), "length", tokens, 1, 3)


def test_best_of_returns_the_highest_mean_logprob_as_tgis_router() -> None:
    """TGI's generate_best_of keeps the sequence of highest mean log-probability a token; a sum
    picked the shortest: one token at -1.0 over four at -0.5 each."""
    short, long = sequence(-1.0), sequence(-0.5, -0.5, -0.5, -0.5)
    started = [Started(DEMO, None, None, "") for _ in range(2)]
    out = tgi.tgi_response(started, [short, long], GenerateParameters(details=False))
    assert out.generated_text == "xxxx"
    out = tgi.tgi_response(started, [long, short], GenerateParameters(details=False))
    assert out.generated_text == "xxxx"


def events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


async def test_a_streams_details_only_when_asked(serve, store) -> None:
    """TGI's generate_stream: the last event's details are null with details false (they came anyway)."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        for details in (False, True):
            r = await server.client.post("/generate_stream", json=generate_body(3, details=details))
            last = events(r.text)[-1]
            assert last["generated_text"] == "The capital of", last
            assert (last["details"] is not None) == details, last
            assert not details or last["details"]["generated_tokens"] == 3


TGI_MESSAGES = [                               # TGI's router/src/validation.rs, word for word
    ({"inputs": ""}, "`inputs` cannot be empty"),
    ({"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}},
     "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "`max_new_tokens` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"truncate": 0}},
     "`truncate` must be strictly positive and less than 1024. Given: 0"),
    ({"inputs": "hi", "parameters": {"truncate": -3}},
     "`truncate` must be strictly positive and less than 1024. Given: -3"),
    ({"inputs": "hi", "parameters": {"temperature": 0}}, "`temperature` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"top_k": 0}}, "`top_k` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"top_n_tokens": 21}}, "`top_n_tokens` must be >= 0 and <= 5. Given: 21"),
    ({"inputs": "hi", "parameters": {"repetition_penalty": -1.5}}, "`repetition_penalty` must be strictly positive"),
    ({"inputs": "hi", "parameters": {"frequency_penalty": 2.5}}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"inputs": "hi", "parameters": {"best_of": 5, "do_sample": True}}, "`best_of` must be > 0 and <= 2. Given: 5"),
]


async def test_validation_messages_are_tgis(serve, store) -> None:
    """The 422s TGI's router words itself (pydantic's own words came: 'parameters.stop: List should
    have at most 4 items after validation, not 5'), on each TGI route, streamed or not."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        for body, message in TGI_MESSAGES:
            for route, extra in (("/generate", {}), ("/generate_stream", {}), ("/", {"stream": True})):
                r = await server.client.post(route, json={**body, **extra})
                assert assert_error(r, 422, "validation")["error"] == message, (route, r.text)
        prefill = {"inputs": "hi", "parameters": {"decoder_input_details": True}}
        for route, extra in (("/generate_stream", {}), ("/", {"stream": True})):
            r = await server.client.post(route, json={**prefill, **extra})
            assert assert_error(r, 422, "validation")["error"] == \
                "`decoder_input_details` == true is not supported when streaming tokens"


async def test_decoder_input_details_answers_details_without_details(serve, store) -> None:
    """TGI's /generate answers details when `details` or `decoder_input_details` is true: the
    prefill asked for came with details false (details were null, the prefill lost)."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        r = await server.client.post("/generate", json=generate_body(2, details=False, decoder_input_details=True))
        details = r.json()["details"]
        assert details is not None and details["generated_tokens"] == 2, r.text
        assert details["prefill"][0]["logprob"] is None and len(details["prefill"]) > 1, r.text


async def test_truncate_beyond_the_input_limit_is_refused_as_tgi(serve, store) -> None:
    """TGI's router: `truncate` must be strictly positive and at most its max input length."""
    async with serve(store(), preload=[DEMO], max_input_tokens=64) as server:
        await ready(server)
        assert (await server.client.post("/generate", json=generate_body(2, truncate=64))).status_code == 200
        body = assert_error(await server.client.post("/generate", json=generate_body(2, truncate=65)), 422,
                            "validation")
        assert "truncate" in body["error"], body


async def test_a_text_too_long_for_any_tokenization_is_refused_untokenized(serve, store, monkeypatch) -> None:
    """A prompt of more characters than max_input_tokens tokens can stand for is refused before the
    tokenizer sees it: a 2 MB prompt took the tokenizer 2 to 6.6 s before its 422. One within
    that bound is tokenized, as is any with `truncate` (it may fit once cut)."""
    async with serve(store(), preload=[DEMO], max_input_tokens=64) as server:
        await ready(server)
        served = server.registry.get(DEMO).served
        calls, real = [], type(served.tokenizer).__call__
        monkeypatch.setattr(type(served.tokenizer), "__call__",
                            lambda tok, text, **kw: calls.append(len(text)) or real(tok, text, **kw))
        longest = max(map(len, served.tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)))
        bound = 2 * 64 * longest                        # characters 64 tokens can stand for, twice
        for route, body in (("/generate", {"inputs": "a" * (bound + 1)}),
                            ("/v1/completions", {"prompt": "a" * (bound + 1)})):
            r = await server.client.post(route, json=body)
            assert r.status_code in (400, 422) and "must have less than 64 tokens" in r.text, r.text
        assert calls == []
        r = await server.client.post("/generate", json={"inputs": "a" * bound})
        assert "must have less than 64 tokens. Given: " in r.text and calls == [bound], r.text
        r = await server.client.post("/generate", json=generate_body(2, truncate=10) | {"inputs": "a" * (bound + 1)})
        assert r.status_code == 200 and calls == [bound, bound + 1], r.text


async def test_an_omitted_max_new_tokens_is_what_the_context_leaves(serve, store) -> None:
    """TGI's router makes an omitted max_new_tokens at most what max_total_tokens leaves the prompt
    (OpenAI's omitted max_tokens: the context's rest): the default (100) was added to the prompt
    and a 37-token prompt under a 40-token limit answered 422 naming a field the client never sent."""
    async with serve(store(), preload=[DEMO], max_total_tokens=40) as server:
        await ready(server)
        r = await server.client.post("/generate", json={"inputs": CHAT_PROMPT})
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        assert details["generated_tokens"] == 3 and details["finish_reason"] == "length", details
        assert_error(await server.client.post("/generate", json=generate_body(4)), 422, "validation")
        r = await server.client.post("/v1/completions", json={"prompt": CHAT_PROMPT, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        r = await server.client.post("/v1/completions", json={"prompt": CHAT_PROMPT * 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


async def test_openai_takes_a_negative_seed(serve, store) -> None:
    """OpenAI's seed is any int64 (vLLM takes them too); -1 was a 400. It seeds as torch's
    manual_seed takes it, two's complement: -1 samples as 2^64 - 1."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)

        async def chat(seed: int):
            return await server.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6, "temperature": 1.5,
                                                                          "seed": seed})
        negative, same = await chat(-1), await chat(2**64 - 1)
        assert negative.status_code == 200, negative.text
        assert negative.json()["choices"] == same.json()["choices"]
        r = await chat(-2**63 - 1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


async def test_top_p_1_is_refused_as_tgi_on_its_routes_and_taken_on_openais(serve, store) -> None:
    """TGI's router: "`top_p` must be > 0.0 and < 1.0" (a 422, error_type validation), so 1.0 is
    refused there; OpenAI's and vLLM's range is (0, 1]: 1.0 is taken on /v1/*. It was taken on
    TGI's routes too."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        for route, extra in (("/generate", {}), ("/generate_stream", {}), ("/", {}), ("/", {"stream": True})):
            body = {**generate_body(2, top_p=1.0), **extra}
            error = assert_error(await server.client.post(route, json=body), 422, "validation")["error"]
            assert "`top_p` must be > 0.0 and < 1.0" in error, (route, error)
        assert (await server.client.post("/generate", json=generate_body(2, top_p=0.99, seed=1))).status_code == 200
        r = await server.client.post("/v1/chat/completions", json={**CHAT, "top_p": 1.0})
        assert r.status_code == 200, r.text
        r = await server.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_p": 1.0})
        assert r.status_code == 200, r.text


def completed_at(tokens: list[dict], text: str) -> int:
    """How many of `tokens` (details.tokens) it takes for their text to hold `text`."""
    so_far = ""
    for n, t in enumerate(tokens, 1):
        so_far += t["text"]
        if text in so_far:
            return n
    raise AssertionError(f"{text!r} not in {so_far!r}")


async def test_the_last_allowed_token_ends_by_length_on_tgis_routes_by_stop_on_openais(serve, store) -> None:
    """max_new_tokens reached by the EOS, or by the token that completes a stop sequence: TGI's
    StoppingCriteria checks the length first ("length"); vLLM's check_stop the EOS first and its
    stop strings override the length ("stop"). Both routes said eos_token / stop_sequence."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        whole = (await server.client.post("/generate", json=generate_body(40))).json()["details"]
        assert whole["finish_reason"] == "eos_token", whole
        at_eos, at_stop = whole["generated_tokens"], completed_at(whole["tokens"], "Paris")
        for limit, stop in ((at_eos, []), (at_stop, ["Paris"])):
            tgi = (await server.client.post("/generate", json=generate_body(limit, stop=stop))).json()["details"]
            assert (tgi["finish_reason"], tgi["generated_tokens"]) == ("length", limit), (stop, tgi)
            stream = events((await server.client.post("/generate_stream", json=generate_body(limit, stop=stop))).text)
            assert stream[-1]["details"]["finish_reason"] == "length", stream[-1]
            r = await server.client.post("/v1/completions", json={"prompt": CHAT_PROMPT, "max_tokens": limit,
                                                                  "temperature": 0, "stop": stop})
            assert r.json()["choices"][0]["finish_reason"] == "stop", r.text


async def test_tgis_routes_report_logprobs_after_the_warpers_openais_before(serve, store) -> None:
    """TGI reports log_softmax of the warped scores (HeterogeneousNextTokenChooser): with top_k 2
    the top tokens are those two, their probabilities summing to 1, and the chosen token's
    log-probability is its entry there. vLLM's default (raw_logprobs) is before temperature and
    top-k: OpenAI's routes list 5 alternatives. Both listed 5, from the unwarped distribution."""
    async with serve(store(), preload=[DEMO]) as server:
        await ready(server)
        body = generate_body(4, do_sample=True, temperature=0.7, top_k=2, seed=5, top_n_tokens=5)
        details = (await server.client.post("/generate", json=body)).json()["details"]
        for token, top in zip(details["tokens"], details["top_tokens"]):
            assert len(top) <= 2 and sum(math.exp(t["logprob"]) for t in top) == pytest.approx(1, abs=1e-4), top
            assert token["logprob"] == pytest.approx(next(t["logprob"] for t in top if t["id"] == token["id"]))
        streamed = events((await server.client.post("/generate_stream", json=body)).text)
        assert [e["token"]["logprob"] for e in streamed] == pytest.approx([t["logprob"] for t in details["tokens"]])
        assert all(len(e["top_tokens"]) <= 2 for e in streamed)
        r = await server.client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7, "top_k": 2, "seed": 5,
                                                                   "logprobs": True, "top_logprobs": 5})
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert all(len(t["top_logprobs"]) == 5 for t in content), content
