"""OpenAI's routes with the official `openai` client: /v1/models, /v1/completions (streamed and
not), chat with usage in its stream, and a bad request of each error class (400, 404, 429 with
Retry-After, 500, 503), plus the raw JSON of each route against the field names of OpenAI's own
types (the `openai` package's models). Most run against one live server (tests/service/conftest.py);
the error classes that need a held engine or a loading model run in-process."""
from __future__ import annotations

import json
import time

import httpx
import httpx2
import openai
import pytest
import torch
from service_helpers import DEMO, QUEUE_OF_ONE, metric_sample, when_queue_full

from service import openai_api
from service.model import cpu_dtype, paged
from service.registry import ModelState

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live[0]}/v1", api_key="unused", max_retries=0)


def test_models_list_and_retrieve(client) -> None:
    models = client.models.list()
    assert [(m.id, m.object, m.owned_by, m.state) for m in models.data] == [(DEMO, "model", "wcodec", "ready")]
    assert models.data[0].created > 1_600_000_000
    assert client.models.retrieve(DEMO).id == DEMO
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_completions_streamed_and_not(client) -> None:
    out = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0)
    assert "Paris" in out.choices[0].text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.total_tokens == out.usage.prompt_tokens + 5
    chunks = list(client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == out.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == out.usage.model_dump()


def test_completions_batch_echo_stop_logprobs(client) -> None:
    both = client.completions.create(model=DEMO, prompt=[PROMPT, "1, 2, 3,"], max_tokens=5, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and "Paris" in both.choices[0].text
    alone = client.completions.create(model=DEMO, prompt="1, 2, 3,", max_tokens=5, temperature=0)
    assert both.choices[1].text == alone.choices[0].text
    echo = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + both.choices[0].text
    cut = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, stop=["aris"])
    assert cut.choices[0].text == both.choices[0].text.split("aris")[0] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, stop=["aris"],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    lp = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0).choices[0]
    assert "".join(lp.logprobs.tokens) == lp.text and lp.logprobs.text_offset[0] == 0
    assert all(x <= 0 for x in lp.logprobs.token_logprobs) and len(lp.logprobs.tokens) == 5


def test_completions_echo_with_logprobs_scores_the_prompt(client) -> None:
    """echo with logprobs (how evaluation harnesses score a text): the prompt's tokens come first,
    the first with null, then the completion's; the tokens spell the text, offsets point into it;
    a greedy completion scored as a prompt gets the log-probabilities it was generated with; the
    stream's first chunk carries the prompt's; max_tokens 0 (with echo only) returns the prompt
    alone, scored."""
    gen = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2).choices[0]
    out = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                    echo=True).choices[0]
    lp, n = out.logprobs, len(out.logprobs.tokens) - 5
    assert out.text == PROMPT + gen.text and "".join(lp.tokens) == out.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert [out.text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    assert lp.tokens[n:] == gen.logprobs.tokens and lp.token_logprobs[n:] == gen.logprobs.token_logprobs
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    scored = client.completions.create(model=DEMO, prompt=PROMPT + gen.text, max_tokens=1, temperature=0,
                                       logprobs=0, echo=True).choices[0].logprobs
    assert scored.tokens[n:n + 5] == gen.logprobs.tokens
    # Where linear16 runs (an AVX-512 CPU) a row's sums do not depend on its call; elsewhere the decode
    # steps' bf16 matmuls (under 6 rows a call) and the scoring prefill's float32 ones (cpu_dtype's
    # "mixed") leave the logits a bf16 place apart (0.125 at 16-32): on an AVX2 EPYC up to 0.14 apart.
    near = 0.1 if cpu_dtype.linear16_kernel(torch.bfloat16) else 0.3
    assert all(abs(a - b) < near for a, b in zip(scored.token_logprobs[n:n + 5], gen.logprobs.token_logprobs))
    chunks = list(client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.tokens == lp.tokens[:n]
    assert first.logprobs.token_logprobs == lp.token_logprobs[:n]
    assert [t for c in chunks[1:] for t in c.choices[0].logprobs.tokens] == lp.tokens[n:]
    assert [o for c in chunks[1:] for o in c.choices[0].logprobs.text_offset] == lp.text_offset[n:]
    bare = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    assert bare.choices[0].text == PROMPT and bare.choices[0].finish_reason == "length"
    assert bare.usage.completion_tokens == 0 and bare.choices[0].logprobs.tokens == lp.tokens[:n]
    assert all(abs(a - b) < 0.05 for a, b in zip(bare.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs[1:n]))
    streamed = list(client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=0, logprobs=2, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT and streamed[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:                  # 0 alone would return nothing
        client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_completions_take_token_ids_and_score_them_as_harnesses_do(client, live) -> None:
    """A prompt as token ids (one list, or a list of lists) is not tokenized again: it completes
    as its text does, its echo is its decode, and scoring a context + continuation the way
    lm-eval's completions model does (echo, logprobs 1, max_tokens 1; the continuation's scores
    at [len(context):-1], greedy where each is its position's top) finds a greedy continuation
    (" Paris.", which tokenizes as it was generated) greedy. An id outside the vocabulary is a 400
    naming `prompt`."""
    ids = [t["id"] for t in httpx.post(f"{live[0]}/tokenize", json={"inputs": PROMPT}).json()]
    text = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0).choices[0]
    by_ids = client.completions.create(model=DEMO, prompt=ids, max_tokens=5, temperature=0, echo=True).choices[0]
    assert by_ids.text == PROMPT + text.text
    gen = client.completions.create(model=DEMO, prompt=ids, max_tokens=2, temperature=0, logprobs=1).choices[0]
    continuation = [t["id"] for t in httpx.post(f"{live[0]}/tokenize", json={"inputs": PROMPT + gen.text}).json()]
    assert continuation[:len(ids)] == ids
    out = client.completions.create(model=DEMO, prompt=[continuation, ids], max_tokens=1, temperature=0,
                                    logprobs=1, echo=True)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(continuation) + 1 and len(out.choices[1].logprobs.tokens) == len(ids) + 1
    scores, tops = lp.token_logprobs[len(ids):-1], lp.top_logprobs[len(ids):-1]
    assert lp.tokens[len(ids):-1] == gen.logprobs.tokens == [" Paris", "."]        # it tokenizes as generated
    assert all(abs(a - b) < 0.05 for a, b in zip(scores, gen.logprobs.token_logprobs))
    assert all(max(top.values()) == pytest.approx(x, abs=1e-6) for x, top in zip(scores, tops))   # is_greedy
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEMO, prompt=[ids[0], 10**6], max_tokens=1)
    assert e.value.body["param"] == "prompt" and "vocabulary" in e.value.message


def test_chat_response_format_constrains_the_content(client) -> None:
    """response_format json_schema and json_object, and TGI's forms (json or json_object with a
    schema in `value`, regex): the content parses and follows the schema or matches the regex; a
    format that cannot be compiled is a 400 naming response_format."""
    import json as _json
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 24}}, "required": ["capital"]}
    out = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert "Paris" in _json.loads(out.choices[0].message.content)["capital"]
    out = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(_json.loads(out.choices[0].message.content), dict)
    for tgi in ({"type": "json_object", "value": schema}, {"type": "json", "value": schema}):   # TGI's forms
        out = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=40, temperature=0,
                                             response_format=tgi)
        assert "Paris" in _json.loads(out.choices[0].message.content)["capital"]
    out = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=10, temperature=0,
                                         response_format={"type": "regex", "value": "(Paris|Rome)"})
    assert out.choices[0].message.content == "Paris"
    for bad in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                {"type": "regex"}, {"type": "regex", "value": "(unclosed"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=DEMO, messages=QUESTION, response_format=bad)
        assert e.value.body["param"] == "response_format"


def test_chat_stream_ends_with_usage(client) -> None:
    out = client.chat.completions.create(model=DEMO, messages=QUESTION, max_completion_tokens=12, temperature=0)
    assert out.choices[0].message.content.startswith("The capital of France is Paris")
    chunks = list(client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == out.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == out.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    unstreamed = {"model": DEMO, "max_tokens": 2, "stream_options": {"include_usage": True}}
    for create in (lambda: client.chat.completions.create(messages=QUESTION, **unstreamed),
                   lambda: client.completions.create(prompt="Hi", **unstreamed)):
        with pytest.raises(openai.BadRequestError) as e:                 # OpenAI's and vLLM's 400, ignored before
            create()
        assert e.value.body["param"] == "stream_options" and "stream" in e.value.body["message"]
    cut = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=12, temperature=0, stop="Paris")
    assert cut.choices[0].message.content == "The capital of France is " and cut.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_stop(client) -> None:
    """vLLM's include_stop_str_in_output: the text ends after the stop sequence instead of before
    it (it was ignored: the stop was cut all the same), streamed or not; the logprobs' tokens are
    then every generated token, their offsets inside the text. Without it, a stop of two tokens
    (" Paris" + ".") leaves the one that starts in the text and drops the one wholly in the stop."""
    body = {"model": DEMO, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "stop": "Paris."}
    cut = client.completions.create(**body).choices[0]
    assert cut.text == " " and cut.logprobs.tokens == [" Paris"] and cut.logprobs.text_offset == [0]
    kept = client.completions.create(**body, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == " Paris." and kept.finish_reason == "stop"
    assert kept.logprobs.tokens == [" Paris", "."] and kept.logprobs.text_offset == [0, 6]
    streamed = list(client.completions.create(**body, stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in streamed) == kept.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == kept.logprobs.tokens
    chat = {"model": DEMO, "messages": QUESTION, "max_tokens": 12, "temperature": 0, "stop": "Paris",
            "extra_body": {"include_stop_str_in_output": True}}
    assert client.chat.completions.create(**chat).choices[0].message.content == "The capital of France is Paris"
    chunks = client.chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content for c in chunks) == "The capital of France is Paris"


def test_chat_logprobs_are_the_contents_tokens(client) -> None:
    """logprobs=true: each token of the message's content with its log-probability, the same as
    the completions route gives for the same text, and as the stream's chunks carry them."""
    out = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True,
                                         top_logprobs=0).choices[0]
    content = out.logprobs.content
    assert "".join(t.token for t in content) == out.message.content
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) and t.top_logprobs == [] for t in content)
    assert out.message.content.startswith("The capital of France is Paris") and len(content) >= 6
    chunks = list(client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=12, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    assert all("".join(t.token for t in c.choices[0].logprobs.content) == c.choices[0].delta.content for c in chunks)
    cut = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True,
                                         stop="Paris")
    assert cut.choices[0].message.content == "The capital of France is "         # " Paris" starts in it: given
    assert "".join(t.token for t in cut.choices[0].logprobs.content) == "The capital of France is Paris"
    plain = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=3).choices[0]
    assert plain.logprobs is None


def test_top_logprobs_list_the_most_likely_tokens(client) -> None:
    """chat's top_logprobs and completions' logprobs = n: at each position the n most likely tokens,
    most likely first (greedy: the chosen token first), the same in a stream; completions' dict
    adds the chosen token where it is not among them (OpenAI's up to n + 1)."""
    out = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=4).choices[0]
    content = out.logprobs.content
    assert "".join(t.token for t in content) == out.message.content and len(content) >= 6
    for t in content:
        top = t.top_logprobs
        assert len(top) == 4 and len({a.token for a in top}) == 4
        assert [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)
        assert (top[0].token, top[0].logprob, top[0].bytes) == (t.token, t.logprob, t.bytes)
        assert all(a.bytes == list(a.token.encode()) for a in top)
    chunks = list(client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=4, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.content]
    assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in streamed] == \
        [[(a.token, a.logprob) for a in t.top_logprobs] for t in content]
    lp = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3).choices[0]
    assert "".join(lp.logprobs.tokens) == lp.text
    for token, logprob, top in zip(lp.logprobs.tokens, lp.logprobs.token_logprobs, lp.logprobs.top_logprobs):
        assert top[token] == logprob == max(top.values()) and 2 <= len(top) <= 4
    sampled = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=8, temperature=2.0, seed=3,
                                        logprobs=1).choices[0].logprobs
    assert all(top[token] == logprob and len(top) in (1, 2)
               for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs))


def test_return_tokens_as_token_ids_names_each_token_by_its_id(client, live) -> None:
    """vLLM's return_tokens_as_token_ids (it was ignored: the tokens came as text): completions'
    `tokens` and `top_logprobs` keys, the echoed prompt's too, and chat's `token`s are
    'token_id:<id>', the ids /generate gives and /tokenize makes of the prompt; chat's `bytes`
    stay the token's own."""
    plain = httpx.post(f"{live[0]}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}).json()
    ids = [f"token_id:{t['id']}" for t in plain["details"]["tokens"]]
    prompt = [f"token_id:{t['id']}" for t in httpx.post(f"{live[0]}/tokenize", json={"inputs": PROMPT}).json()]
    lp = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                   extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert lp.tokens == prompt + ids and all(t in top for t, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert all(k.startswith("token_id:") for top in lp.top_logprobs[1:] for k in top)
    streamed = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                         stream=True, extra_body={"return_tokens_as_token_ids": True})
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == ids
    chat = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    content = chat.logprobs.content
    assert all(t.token.startswith("token_id:") and t.top_logprobs[0].token == t.token for t in content)
    assert b"".join(bytes(t.bytes) for t in content) == chat.message.content.encode()


def test_logit_bias_bans_and_forces_tokens_and_penalties_curb_repeats(client, live) -> None:
    """logit_bias -100 bans the token greedy decoding picked first, +100 makes every token the
    biased one; presence and frequency penalties make a repeating continuation repeat less; bad
    keys, biases out of [-100, 100] and ids outside the vocabulary are a 400 naming logit_bias."""
    def tokens(**extra) -> list[str]:
        out = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, **extra)
        return out.choices[0].logprobs.tokens
    plain = httpx.post(f"{live[0]}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 5}}).json()
    ids = [(t["id"], t["text"]) for t in plain["details"]["tokens"]]
    assert tokens() == [text for _, text in ids]
    assert tokens(logit_bias={str(ids[0][0]): -100})[0] != ids[0][1]
    assert tokens(logit_bias={str(ids[2][0]): 100}) == [ids[2][1]] * 5
    counting = {"model": DEMO, "prompt": "1, 2, 3, 4,", "max_tokens": 24, "temperature": 0}
    repeats = lambda text: max(text.count(","), 1)                       # noqa: E731
    base = client.completions.create(**counting).choices[0].text
    curbed = client.completions.create(**counting, presence_penalty=2, frequency_penalty=2).choices[0].text
    assert curbed != base and repeats(curbed) < repeats(base), (base, curbed)
    for bias in ({"x": 1}, {"5": 101}, {"-5": 1}, {"99999999": 5}, {"\u0663": 1}):       # an Arabic-Indic 3
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=2, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias", bias


def test_a_logit_bias_key_of_thousands_of_digits_is_a_400(client) -> None:
    """int() refuses a string of over 4300 digits: such a key passed the schema and was a 500 as the
    sampling parameters were made; a key is a token id of at most 19 digits (an int64) now."""
    for create in (lambda bias: client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=2,
                                                               logit_bias=bias),
                   lambda bias: client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=2, logit_bias=bias)):
        for bias in ({"9" * 5000: 1}, {"1" * 20: 1}):
            with pytest.raises(openai.BadRequestError) as e:
                create(bias)
            assert e.value.body["param"] == "logit_bias", e.value.body


def test_n_choices_each_their_own_generation(client) -> None:
    """n: that many choices a prompt, each its own engine request (choice j sampling with seed + j,
    so choice 0 is the n=1 sample and the set repeats); greedy choices are alike; usage counts a
    prompt's tokens once; a stream sends each choice's chunks under its index; completions give
    prompt i's choices at i * n .. i * n + n - 1."""
    def chat(**extra):
        return client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=8, **extra)
    one, three = chat(temperature=0), chat(n=3, temperature=0)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens and three.usage.completion_tokens == 24
    sampled = chat(n=3, temperature=1.5, seed=5)
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1 and texts == [c.message.content for c in chat(n=3, temperature=1.5, seed=5).choices]
    assert texts[:2] == [chat(temperature=1.5, seed=seed).choices[0].message.content for seed in (5, 6)]
    streamed: dict[int, str] = {}
    chunks = list(chat(n=3, temperature=1.5, seed=5, stream=True, stream_options={"include_usage": True}))
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.delta.content
    assert [streamed[i] for i in range(3)] == texts
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == sampled.usage.model_dump()
    both = client.completions.create(model=DEMO, prompt=[PROMPT, "1, 2, 3,"], max_tokens=4, temperature=0, n=2)
    alone = [client.completions.create(model=DEMO, prompt=p, max_tokens=4, temperature=0) for p in (PROMPT, "1, 2, 3,")]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_completions_best_of_returns_the_n_best_candidates(client) -> None:
    """best_of: that many candidates a prompt (choice j of them with seed + j, as n's), the n whose
    tokens' mean log-probability is highest returned best first; usage counts every candidate;
    best_of under n or with a stream is a 400 naming it."""
    body = {"model": DEMO, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.5, "seed": 7, "logprobs": 0}
    candidates = client.completions.create(**body, n=3)
    mean = lambda c: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)     # noqa: E731
    ranked = sorted(candidates.choices, key=lambda c: -mean(c))
    best = client.completions.create(**body, n=2, best_of=3)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [c.index for c in best.choices] == [0, 1]
    assert best.usage.model_dump() == candidates.usage.model_dump()
    for bad in ({"n": 2, "best_of": 1}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**body, **bad})
        assert e.value.body["param"] == "best_of", bad


def test_chat_seed_repeats_a_sample(client) -> None:
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=8, temperature=1.5,
                                              seed=seed).choices[0].message.content
    texts = {seed: sample(seed) for seed in range(4)}
    assert sample(0) == texts[0] and len(set(texts.values())) > 1


def test_temperature_zero_is_greedy_whatever_top_p_and_top_k_say(client) -> None:
    """Clients (harnesses, LangChain) send temperature 0 beside their default top_p: greedy, as
    OpenAI and vLLM. vLLM's top_k=1 samples the argmax too."""
    greedy = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    for extra in ({"top_p": 0.95, "n": 3}, {"top_p": 0.5, "seed": 1, "extra_body": {"top_k": 40}},
                  {"temperature": 1.5, "seed": 2, "extra_body": {"top_k": 1}}):
        kwargs = {"temperature": 0, **extra}
        out = client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=8, **kwargs)
        assert [c.text for c in out.choices] == [greedy] * len(out.choices), extra
    assert client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"repetition_penalty": 1.0}).choices[0].text == greedy


def test_vllms_beam_search_is_refused_not_ignored(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=2, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search" and e.value.body["code"] == "unsupported_parameter"


def test_ignore_eos_generates_past_the_eos_as_vllms_benchmarks_ask(client) -> None:
    """vLLM's ignore_eos (refused with a 400 before): the greedy answer ends at its EOS; with it the
    choice goes on to max_tokens, its first tokens the same answer."""
    plain = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=30, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 30
    long = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 30
    assert long.choices[0].message.content.startswith(plain.choices[0].message.content)


def test_min_tokens_masks_the_eos_and_the_stops_until_reached(client) -> None:
    """vLLM's min_tokens (refused before): no EOS and no stop string ends the choice before that
    many tokens; the greedy tokens before it are the plain answer's; more than max_tokens is a 400."""
    plain = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=30, temperature=0)
    n = plain.usage.completion_tokens
    held = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=30, temperature=0,
                                          extra_body={"min_tokens": n + 4})
    assert held.usage.completion_tokens >= n + 4
    assert held.choices[0].message.content.startswith(plain.choices[0].message.content)
    stopped = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=30, temperature=0,
                                             stop=["France"], extra_body={"min_tokens": n})
    assert stopped.usage.completion_tokens >= n and "France" in stopped.choices[0].message.content
    streamed = client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=30, temperature=0,
                                              stop=["France"], extra_body={"min_tokens": n}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        stopped.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=2, extra_body={"min_tokens": 3})
    assert e.value.body["param"] == "min_tokens", e.value.body


def test_min_tokens_over_what_the_context_leaves_is_a_400(client) -> None:
    """With no max_tokens, a min_tokens over what the context leaves the prompt was taken, its EOS
    masked to the end of the context (minutes of tokens on a CPU, the client's wait a hang); vLLM,
    whose max_tokens is then that room, refuses it (min_tokens <= max_tokens), as this server now."""
    quick = client.with_options(timeout=30)
    for huge in (10**9, 2**63):
        with pytest.raises(openai.BadRequestError) as e:
            quick.chat.completions.create(model=DEMO, messages=QUESTION, extra_body={"min_tokens": huge})
        assert e.value.body["param"] == "min_tokens", e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            quick.completions.create(model=DEMO, prompt=PROMPT, stream=True, extra_body={"min_tokens": huge})
        assert e.value.body["param"] == "min_tokens", e.value.body


def test_a_stream_that_fails_midway_ends_with_an_error_event(client, live, monkeypatch) -> None:
    """A stream that fails after its first chunks, for a reason that is not a service error (a bug
    in building a chunk), ends as vLLM's does: an error event in OpenAI's shape, which the client
    raises, then [DONE]; the connection was dropped before, the client left with a broken read."""
    def broken(fin):
        raise RuntimeError("no finish reason")
    monkeypatch.setattr(openai_api, "finish_reason", broken)
    with pytest.raises(openai.APIError) as e:
        list(client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=3, stream=True))
    assert "RuntimeError: no finish reason" in e.value.message and e.value.body["code"] == "internal_error"
    raw = httpx.post(f"{live[0]}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}).text
    assert raw.endswith("data: [DONE]\n\n") and '"type": "server_error"' in raw, raw


def test_more_sequences_than_a_model_queues_is_a_400_not_a_429(client, live) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEMO, prompt=["Hello"] * 13, n=5, max_tokens=1)        # 65 > 64
    assert e.value.body["param"] == "n" and "WCODEC_MAX_QUEUE" in e.value.message
    assert len(client.completions.create(model=DEMO, prompt=["Hello"] * 16, n=4, max_tokens=1).choices) == 64


def test_a_lone_surrogate_is_a_400_naming_the_field(live) -> None:
    raw = '{"model": "%s", "prompt": "hi \\ud800", "max_tokens": 2}' % DEMO
    r = httpx.post(f"{live[0]}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "surrogate" in r.text, r.text
    chat = '{"messages": [{"role": "user", "content": "hi \\udfff"}], "max_tokens": 2}'
    r = httpx.post(f"{live[0]}/v1/chat/completions", content=chat, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.text, r.text


def _sample(url: str, name: str, **labels: str) -> float:
    return metric_sample(httpx.get(f"{url}/metrics").text, name, **labels)


@pytest.mark.parametrize(("route", "body"), [
    ("/generate", {"inputs": "1, 2, 3, 4, 5, 6,", "parameters": {"max_new_tokens": 1500}}),
    ("/v1/completions", {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 1500, "temperature": 0})])
def test_a_client_that_hangs_up_cancels_its_generation(live, route, body) -> None:
    """A not-streamed request whose client leaves is cancelled at once, its row and KV blocks
    freed, as vLLM and TGI do (it ran on to max_new_tokens, a minute on this CPU, before)."""
    url = live[0]
    cancelled = lambda: _sample(url, "wcodec_generate_requests_total", model=DEMO, status="cancelled")
    before = cancelled()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}{route}", json=body, timeout=1.5)
    deadline = time.monotonic() + 15
    while cancelled() == before:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.1)
    assert _sample(url, "wcodec_kv_cache_blocks_used", model=DEMO) == 0


@pytest.mark.parametrize(("route", "bias", "tokens"), [("chat", {"5": 100}, 4),          # <file_sep>, special
                                                   ("completions", {"10813": 100}, 3)])   # an unfinished character
def test_the_streamed_text_is_the_text_not_streamed(client, route, bias, tokens) -> None:
    """Special added tokens are left out of both (the stream sent "<file_sep>" four times where the
    answer was empty), and a character the last tokens leave unfinished ends both (U+FFFD; the
    stream dropped it)."""
    if route == "chat":
        make = lambda **kw: client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=tokens,
                                                           temperature=0, logit_bias=bias, **kw)
        whole = make().choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in make(stream=True) if c.choices)
    else:
        make = lambda **kw: client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                                      logit_bias=bias, **kw)
        whole = make().choices[0].text
        streamed = "".join(c.choices[0].text for c in make(stream=True) if c.choices)
    assert streamed == whole
    assert ("<file_sep>" not in whole) if route == "chat" else whole.endswith("\ufffd")


UNSUPPORTED = [("tools", {"tools": [
    {"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("response_format", {"response_format": {"type": "xml"}}),
    ("top_logprobs", {"top_logprobs": 2})]                        # without logprobs: true


@pytest.mark.parametrize(("param", "extra"), UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_chat_refuses_what_it_cannot_do(client, param, extra) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=2, **extra)
    assert e.value.body["param"] == param and e.value.body["code"] == "unsupported_parameter"
    assert param in e.value.message


def test_bad_requests_and_unknown_models(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=-5)
    assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == "invalid_request_error"
    for kwargs in ({"max_tokens": -5}, {"n": 17}, {"logprobs": 6}, {"best_of": 17}, {"prompt": [PROMPT] * 33}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{"model": DEMO, "prompt": PROMPT, **kwargs})
    with pytest.raises(openai.BadRequestError, match="must be <="):
        client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=4000)
    with pytest.raises(openai.BadRequestError) as e:                  # the field the request used (max_tokens before)
        client.chat.completions.create(model=DEMO, messages=QUESTION, max_completion_tokens=4000)
    assert e.value.body["param"] == "max_completion_tokens" and "max_completion_tokens" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="../etc/passwd", prompt=PROMPT)


def _fields(model) -> set[str]:
    return set(model.model_fields)


def _required(model) -> set[str]:
    return {name for name, f in model.model_fields.items() if f.is_required()}


def _same_fields(body: dict, model) -> None:
    """Every key of `body` is one of the OpenAI type's fields, and every field it requires is there."""
    assert _required(model) <= set(body) <= _fields(model) | {"state"}, (model.__name__, sorted(body))


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_raw_json_shapes_use_openais_field_names(live) -> None:
    from openai.types import Completion, CompletionChoice, CompletionUsage, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
    from openai.types.chat import ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
    from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
    from openai.types.completion_choice import Logprobs

    with httpx.Client(base_url=live[0], timeout=60) as http:
        models = http.get("/v1/models").json()
        assert set(models) == {"object", "data"} and models["object"] == "list"
        _same_fields(models["data"][0], Model)
        _same_fields(http.get(f"/v1/models/{DEMO}").json(), Model)
        body = {"model": DEMO, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 0}
        out = http.post("/v1/completions", json=body).json()
        _same_fields(out, Completion)
        _same_fields(out["choices"][0], CompletionChoice)
        _same_fields(out["choices"][0]["logprobs"], Logprobs)
        _same_fields(out["usage"], CompletionUsage)
        for chunk in _events(http.post("/v1/completions", json={**body, "stream": True}).text):
            _same_fields(chunk, Completion)
        chat = {"model": DEMO, "messages": QUESTION, "max_tokens": 3, "temperature": 0}
        out = http.post("/v1/chat/completions", json=chat).json()
        _same_fields(out, ChatCompletion)
        _same_fields(out["choices"][0], Choice)
        _same_fields(out["choices"][0]["message"], ChatCompletionMessage)
        out = http.post("/v1/chat/completions", json={**chat, "logprobs": True}).json()
        _same_fields(out["choices"][0]["logprobs"], ChoiceLogprobs)
        _same_fields(out["choices"][0]["logprobs"]["content"][0], ChatCompletionTokenLogprob)
        chunks = _events(http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
        for chunk in chunks:
            _same_fields(chunk, ChatCompletionChunk)
            _same_fields(chunk["choices"][0], ChunkChoice)
        for r in (http.post("/v1/chat/completions", json={**chat, "max_tokens": -5}), http.get("/v1/models/nope"),
                  http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})):
            assert r.status_code in (400, 404) and set(r.json()) == {"error"}, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


# --- the error classes that need a server in a given state: in-process -------------------------


def _async_client(server) -> openai.AsyncOpenAI:
    """The client on the app in-process (the `openai` package's own httpx, httpx2, has an ASGI transport)."""
    http = openai.DefaultAsyncHttpxClient(transport=httpx2.ASGITransport(app=server.app))
    return openai.AsyncOpenAI(base_url="http://wcodec.test/v1", api_key="unused", max_retries=0, http_client=http)


@pytest.mark.anyio
async def test_503_while_the_model_loads_and_500_when_generation_fails(serve, store, monkeypatch) -> None:
    async with serve(store(), retry_after_s=3) as server:
        client = _async_client(server)
        assert (await server.client.post(f"/models/{DEMO}/load", params={"wait": "false"})).status_code == 202
        with pytest.raises(openai.InternalServerError) as e:
            await client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "3"
        assert e.value.body["code"] == "model_not_ready" and "loading" in e.value.message
        await server.wait_state(DEMO, ModelState.READY)
        monkeypatch.setattr(paged, "forward", lambda *a, **k: 1 / 0)
        with pytest.raises(openai.InternalServerError) as e:
            await client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=2)
        assert e.value.status_code == 500 and e.value.body["code"] == "generation_failed"
        assert server.registry.get(DEMO).in_flight == 0


@pytest.mark.anyio
async def test_429_with_retry_after_when_the_queue_is_full(serve, store, monkeypatch) -> None:
    async with serve(store(), preload=[DEMO], **QUEUE_OF_ONE) as server:
        await server.wait_state(DEMO, ModelState.READY)
        client = _async_client(server)

        async def complete():
            return await client.completions.create(model=DEMO, prompt=PROMPT, max_tokens=2)

        async def refused():
            with pytest.raises(openai.RateLimitError) as e:
                await complete()
            return e.value

        error = await when_queue_full(server, monkeypatch, complete, refused)
        assert error.response.headers["retry-after"] == "1" and error.body["code"] == "queue_full"
