"""Against a real uvicorn server on localhost (the `live` fixture): TGI's own client (huggingface_hub's
InferenceClient.text_generation, which calls TGI's `/` route) and its OpenAI chat client work
unchanged, and a client that leaves mid-stream cancels its generation."""
from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from service_helpers import CHAT_PROMPT, DEMO

from service import tgi


@pytest.fixture(autouse=True)
def loopback_clients_allowed(monkeypatch):
    """huggingface_hub blocks every request, loopback too, when HF_HUB_OFFLINE was set at its
    import; these clients only talk to the server under test on 127.0.0.1."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


hub = pytest.importorskip("huggingface_hub")


def test_inference_client_text_generation(live) -> None:
    client = hub.InferenceClient(base_url=live[0])
    assert client.text_generation(CHAT_PROMPT, max_new_tokens=12).startswith("The capital of France is Paris")
    out = client.text_generation(CHAT_PROMPT, max_new_tokens=12, details=True)
    assert out.details.finish_reason == "eos_token" and out.details.generated_tokens == len(out.details.tokens)
    streamed = list(client.text_generation(CHAT_PROMPT, max_new_tokens=12, stream=True, details=True))
    assert streamed[-1].generated_text == out.generated_text and streamed[-1].details.finish_reason == "eos_token"


def test_a_stream_that_fails_midway_ends_with_tgis_error_event(live, monkeypatch, caplog) -> None:
    """A stream that fails after its first events for a reason that is not a service error (a bug
    building the last event) ends as TGI's ends a stream without its last token: an error event
    {"error", "error_type": "incomplete_generation"}, which TGI's client raises, logged; the
    connection was dropped mid-body, the client left with a broken read."""
    def broken(**fields):
        raise RuntimeError("no details")
    monkeypatch.setattr(tgi, "StreamDetails", broken)
    client = hub.InferenceClient(base_url=live[0])
    with caplog.at_level(logging.ERROR, logger="service.tgi"), \
            pytest.raises(hub.errors.IncompleteGenerationError, match="RuntimeError: no details"):
        list(client.text_generation(CHAT_PROMPT, max_new_tokens=4, stream=True, details=True))
    assert any(r.exc_info and "no details" in str(r.exc_info[1]) for r in caplog.records)
    for route, body in (("/generate_stream", {}), ("/", {"stream": True})):
        body = {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": 4}, **body}
        events = httpx.post(f"{live[0]}{route}", json=body, timeout=60).text.split("\n\n")
        assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), events
        *tokens, last = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert [t["index"] for t in tokens] == [1, 2, 3] and all(t["generated_text"] is None for t in tokens)
        assert last == {"error": "Incomplete generation: internal error: RuntimeError: no details",
                        "error_type": "incomplete_generation"}


def test_inference_client_top_n_tokens(live) -> None:
    """top_n_tokens, as TGI's: each generated token's n most likely tokens with their
    log-probabilities, most likely first, in details.top_tokens and in each stream event; greedy,
    the first of them is the chosen token itself."""
    def fields(t, *names) -> tuple:       # huggingface_hub leaves details.top_tokens' lists as dicts
        return tuple(t[n] if isinstance(t, dict) else getattr(t, n) for n in names)
    client = hub.InferenceClient(base_url=live[0])
    out = client.text_generation(CHAT_PROMPT, max_new_tokens=6, details=True, top_n_tokens=3)
    assert out.generated_text.startswith("The capital of France")
    tokens, top = out.details.tokens, out.details.top_tokens
    assert len(top) == len(tokens) == 6 and all(len(t) == 3 for t in top)
    for token, alternatives in zip(tokens, top):
        logprobs = [fields(a, "logprob")[0] for a in alternatives]
        assert logprobs == sorted(logprobs, reverse=True) and all(lp <= 0 for lp in logprobs)
        assert fields(alternatives[0], "id", "logprob", "text") == (token.id, token.logprob, token.text)
        assert len({fields(a, "id") for a in alternatives}) == 3
    streamed = list(client.text_generation(CHAT_PROMPT, max_new_tokens=6, stream=True, details=True, top_n_tokens=3))
    assert [[fields(a, "id", "logprob") for a in e.top_tokens] for e in streamed] == \
        [[fields(a, "id", "logprob") for a in t] for t in top]
    assert client.text_generation(CHAT_PROMPT, max_new_tokens=2, details=True).details.top_tokens in (None, [])


def test_inference_client_decoder_input_details(live) -> None:
    """decoder_input_details, as TGI's: details.prefill holds the prompt's tokens (those /tokenize
    gives) with their log-probabilities, the first null. Scored as a prompt, a greedy completion's
    tokens get the log-probabilities they were generated with (one forward over the text against
    the decode steps': bf16 rounding apart)."""
    client = hub.InferenceClient(base_url=live[0])
    out = client.text_generation(CHAT_PROMPT, max_new_tokens=6, details=True, decoder_input_details=True)
    prefill = out.details.prefill
    ids = [t["id"] for t in httpx.post(f"{live[0]}/tokenize", json={"inputs": CHAT_PROMPT}).json()]
    assert [t.id for t in prefill] == ids and prefill[0].logprob is None
    assert all(t.logprob <= 0 for t in prefill[1:]) and "".join(t.text for t in prefill) == CHAT_PROMPT
    scored = client.text_generation(CHAT_PROMPT + out.generated_text, max_new_tokens=1, details=True,
                                    decoder_input_details=True).details.prefill
    generated = [t for t in out.details.tokens]
    assert [t.id for t in scored[len(ids):]] == [t.id for t in generated]
    for s, g in zip(scored[len(ids):], generated):
        assert abs(s.logprob - g.logprob) < 0.1, (s, g)
    assert client.text_generation(CHAT_PROMPT, max_new_tokens=2, details=True).details.prefill == []


def test_inference_client_watermark(live) -> None:
    """watermark, as TGI's: a sampled text carries it. The detector counts the tokens in the green
    list of the token before each (the prompt's last first): with it, z = (green - n/2) / sqrt(n/4)
    is far above chance; the same seeded request without it is near chance."""
    import torch

    from service.engine.logits import greenlist

    client = hub.InferenceClient(base_url=live[0])
    prompt = "<|im_start|>user\nWrite a long story about a dragon and a knight.<|im_end|>\n<|im_start|>assistant\n"
    last = [t["id"] for t in httpx.post(f"{live[0]}/tokenize", json={"inputs": prompt}).json()][-1]

    def z(watermark: bool) -> float:
        out = client.text_generation(prompt, max_new_tokens=96, details=True, do_sample=True, seed=7,
                                     temperature=1.0, watermark=watermark)
        ids = [last] + [t.id for t in out.details.tokens]
        vocab = 49152                                                    # the demo's config.vocab_size
        green = sum(b in set(greenlist(a, vocab, torch.device("cpu")).tolist()) for a, b in zip(ids, ids[1:]))
        n = len(ids) - 1
        return (green - n / 2) / (n / 4) ** 0.5
    marked, plain = z(True), z(False)
    assert marked > 4 and abs(plain) < 3.5, (marked, plain)


def test_inference_client_grammar(live) -> None:
    """grammar, as TGI's: a JSON schema's text parses and follows it; a regex's matches it."""
    import json
    import re
    client = hub.InferenceClient(base_url=live[0])
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 24}}, "required": ["capital"]}
    out = client.text_generation(CHAT_PROMPT, max_new_tokens=40, grammar={"type": "json", "value": schema})
    assert list(json.loads(out)) == ["capital"] and "Paris" in json.loads(out)["capital"]
    out = client.text_generation(CHAT_PROMPT, max_new_tokens=10, grammar={"type": "regex", "value": "(Paris|Lyon)!"})
    assert re.fullmatch("(Paris|Lyon)!", out)


def test_inference_client_best_of(live) -> None:
    """best_of, as TGI's: that many sampled sequences, the one of highest mean log-probability a
    token returned, the others in details.best_of_sequences, each with its own seed."""
    client = hub.InferenceClient(base_url=live[0])
    out = client.text_generation(CHAT_PROMPT, max_new_tokens=8, details=True, best_of=3, do_sample=True,
                                 temperature=1.5)
    others = out.details.best_of_sequences
    assert len(others) == 2 and len({out.details.seed, *(o.seed for o in others)}) == 3
    mean = lambda tokens: sum(t.logprob for t in tokens) / len(tokens)        # noqa: E731
    assert all(mean(out.details.tokens) >= mean(o.tokens) for o in others)
    assert all(o.generated_tokens == len(o.tokens) >= 1 for o in others)
    assert httpx.get(f"{live[0]}/info").json()["max_best_of"] == 3          # WCODEC_MAX_BEST_OF, as `live` sets it


def test_inference_client_typical_p_and_frequency_penalty(live) -> None:
    """typical_p samples (a seed repeats it, the details report the seed); TGI's frequency_penalty
    shapes the distribution that the tokens' log-probabilities report (its share-based penalty is
    mild: here the same greedy tokens)."""
    client = hub.InferenceClient(base_url=live[0])
    typical = lambda seed: client.text_generation(CHAT_PROMPT, max_new_tokens=8, details=True,  # noqa: E731
                                                  typical_p=0.5, seed=seed)
    first = typical(7)
    assert first.details.seed == 7 and first.generated_text == typical(7).generated_text
    counting = "1, 2, 3, 4, 5, 6, 7, 8,"
    plain = client.text_generation(counting, max_new_tokens=4, details=True)
    curbed = client.text_generation(counting, max_new_tokens=4, details=True, frequency_penalty=2.0)
    assert plain.generated_text.startswith(" 9") and not plain.details.seed and not curbed.details.seed
    assert max(abs(a.logprob - b.logprob) for a, b in zip(plain.details.tokens, curbed.details.tokens)) > 0.05


def test_inference_client_chat_completion(live) -> None:
    client = hub.InferenceClient(base_url=live[0])
    out = client.chat_completion([{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
                                 temperature=0)
    assert out.choices[0].message.content.startswith("The capital of France is Paris")


def _metric(url: str, sample: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize(("route", "extra"), [("/generate_stream", {}), ("/", {"stream": True})])
def test_client_gone_mid_stream_cancels_and_releases(live, route, extra) -> None:
    """A client that leaves a TGI stream after its first event: the generation is cancelled, its
    row leaves the engine's batch and its KV blocks go back, as TGI's router drops a stream whose
    receiver is gone. The live server is the module's: the counters are read before and after, so
    the other tests' requests do not count.
    The client leaves when the `with` ends, after the check that its row was generating: the line
    iterator is held till then. Dropped (`next(l for l in r.iter_lines() ...)`), CPython closed it
    at once and httpcore the connection with it, so the client had left before the check, which
    failed when a busy machine let the server cancel the row first."""
    url, app = live
    cancelled = f'wcodec_generate_requests_total{{model="{DEMO}",status="cancelled"}}'
    generated = f'wcodec_generate_generated_tokens_total{{model="{DEMO}"}}'
    before = _metric(url, cancelled), _metric(url, generated)
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 400}, **extra}
    entry = app.state.registry.get(DEMO)
    scheduler = entry.engine.batcher
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=60) as r:
        lines = r.iter_lines()                                          # held: the connection stays open
        first = next(line for line in lines if line.startswith("data:"))
        assert scheduler.active and scheduler.blocks.used > 0, (r.status_code, first)   # it was generating
    deadline = time.monotonic() + 30
    while (entry.in_flight or scheduler.active or scheduler.blocks.used) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert entry.in_flight == 0 and scheduler.active == [] and scheduler.blocks.used == 0
    assert _metric(url, cancelled) - before[0] == 1
    assert _metric(url, generated) - before[1] < 300                 # of the 400 asked for
