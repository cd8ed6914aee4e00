"""How OpenAI's routes sample, as vLLM's OpenAI server does: a field the request leaves out takes
the model's generation_config value, else vLLM's neutral one (temperature 1: OpenAI, vLLM and TGI
sample by default); a request's own value always wins; temperature 0 is greedy."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from service_helpers import DEMO

from service.registry import ModelState

pytestmark = pytest.mark.anyio
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def _texts(client, route: str, body: dict, seeds) -> list[str]:
    out = []
    for seed in seeds:
        r = await client.post(f"/v1/{route}", json={**body, "seed": seed})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append(choice["text"] if route == "completions" else choice["message"]["content"])
    return out


async def test_an_omitted_temperature_samples_at_one(serve, store) -> None:
    """The demo's generation_config (made from its GGUF's metadata) sets no sampling key: an
    omitted temperature is 1, so that seeds give different answers, each the one an explicit
    temperature 1 gives with that seed (it was greedy: every seed the same answer)."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        for route, body in (("completions", {"prompt": PROMPT, "max_tokens": 6}),
                            ("chat/completions", {"messages": QUESTION, "max_tokens": 6})):
            omitted = await _texts(server.client, route, body, range(4))
            assert len(set(omitted)) > 1, (route, omitted)
            assert omitted[:2] == await _texts(server.client, route, {**body, "temperature": 1.0}, range(2)), route
            greedy = await _texts(server.client, route, {**body, "temperature": 0, "top_p": 0.5}, range(3))
            assert len(set(greedy)) == 1, (route, greedy)
        assert server.registry.get(DEMO).served.sampling_defaults == {}


@pytest.fixture
def tiny_store(tmp_path: Path, tiny_archive_with_defaults: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    os.link(tiny_archive_with_defaults, root / "tiny.wcodec")
    return root


async def test_the_models_generation_config_fills_what_the_request_leaves_out(serve, tiny_store) -> None:
    """The tiny model's generation_config: temperature 0.6, top_p 0.9, top_k 1, max_new_tokens 3.
    Left out, they apply (top_k 1: any seed gives the argmax; 3 tokens); the request's own values
    win (top_k -1, all: seeds differ, each as with the model's temperature and top_p sent
    explicitly; max_tokens 5)."""
    async with serve(tiny_store, preload=["tiny"]) as server:
        await server.wait_state("tiny", ModelState.READY)
        body = {"model": "tiny", "prompt": "What is"}
        r = (await server.client.post("/v1/completions", json=body)).json()
        assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length", r
        greedy = await _texts(server.client, "completions", {**body, "temperature": 0}, [0])
        assert await _texts(server.client, "completions", body, range(3)) == greedy * 3
        everything = {**body, "top_k": -1, "max_tokens": 5}
        sampled = await _texts(server.client, "completions", everything, range(4))
        assert len(set(sampled)) > 1, sampled
        assert sampled == await _texts(server.client, "completions", {**everything, "temperature": 0.6,
                                                                       "top_p": 0.9}, range(4))
        r = (await server.client.post("/v1/completions", json=everything)).json()
        assert r["usage"]["completion_tokens"] == 5, r


async def test_logprobs_are_the_models_before_the_bias_and_penalties(serve, store) -> None:
    """vLLM's default logprobs_mode (raw_logprobs): the model's log-softmax before any processing.
    A token forced by logit_bias 100 is reported with the log-probability the model gives it (the
    same as the prompt's scores give it there), not ~0 (the biased distribution's, before)."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        c = server.client
        ids = [t["id"] for t in (await c.post("/tokenize", json={"inputs": PROMPT})).json()]
        forced = (await c.post("/tokenize", json={"inputs": " London"})).json()[0]["id"]
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1, "logit_bias": {str(forced): 100},
                "presence_penalty": 2}
        out = (await c.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
        scored = (await c.post("/v1/completions", json={"prompt": ids + [forced] * 3, "max_tokens": 0, "echo": True,
                                                        "logprobs": 1})).json()["choices"][0]["logprobs"]
        assert len(set(out["tokens"])) == 1 and out["token_logprobs"][0] < -1, out
        assert out["token_logprobs"] == pytest.approx(scored["token_logprobs"][len(ids):], abs=0.3), (out, scored)
        for top, (token, logprob) in zip(out["top_logprobs"], zip(out["tokens"], out["token_logprobs"])):
            assert top[token] == logprob and max(top.values()) > logprob, top      # the model's top one is not it


async def test_min_p_keeps_the_tokens_near_the_top_ones(serve, store) -> None:
    """vLLM's min_p (refused with a 400 before): min_p 1 keeps only the most likely token, so a
    hot sample is the greedy answer whatever the seed; a value outside [0, 1] is a 400 naming it."""
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        body = {"prompt": PROMPT, "max_tokens": 6}
        greedy = await _texts(server.client, "completions", {**body, "temperature": 0}, [0])
        assert await _texts(server.client, "completions", {**body, "temperature": 1.5, "min_p": 1.0},
                            range(3)) == greedy * 3
        r = await server.client.post("/v1/completions", json={**body, "min_p": 1.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
