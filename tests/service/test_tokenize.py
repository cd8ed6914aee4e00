"""TGI's /tokenize: the tokens /generate feeds the model, each with the characters it covers;
`truncate` keeps the last ones; /chat_tokenize: the chat template's text and the tokens chat
feeds; errors in TGI's shape (an unknown model 404, an empty input 422, a model not ready 503
with Retry-After)."""
from __future__ import annotations

import pytest
from service_helpers import DEMO, assert_error

from service.registry import ModelState
from service.schemas.tgi import CHAT_EXAMPLE

pytestmark = pytest.mark.anyio
TEXT = CHAT_EXAMPLE + "Héllo wörld  , ok ."


def _python_tokenizer(text, add_special_tokens=True, return_offsets_mapping=False):
    """What transformers' Python (slow) tokenizers do when asked for offsets."""
    raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")


async def test_tokens_are_those_generate_feeds_with_their_characters(serve, store, monkeypatch) -> None:
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        r = await server.client.post("/tokenize", json={"inputs": TEXT})
        assert r.status_code == 200, r.text
        tokens = r.json()
        tokenizer = server.registry.get(DEMO).served.tokenizer
        assert [t["id"] for t in tokens] == tokenizer(TEXT)["input_ids"]
        assert all(set(t) == {"id", "text", "start", "stop"} and t["text"] == TEXT[t["start"]:t["stop"]] for t in tokens)
        assert [t["start"] for t in tokens] == sorted(t["start"] for t in tokens) and tokens[-1]["stop"] == len(TEXT)
        assert tokens[0]["text"] == "<|im_start|>" and tokens[0]["id"] == tokenizer.encode("<|im_start|>", False)[0]
        assert tokenizer.decode([t["id"] for t in tokens]) == TEXT
        r = await server.client.post("/tokenize", json={"inputs": TEXT, "parameters": {"truncate": 3}, "model": DEMO})
        assert r.status_code == 200 and r.json() == tokens[-3:], r.text
        monkeypatch.setattr(server.registry.get(DEMO).served, "tokenizer", _python_tokenizer)
        body = assert_error(await server.client.post("/tokenize", json={"inputs": TEXT}), 422, "validation")
        assert "Python tokenizer" in body["error"] and server.registry.get(DEMO).in_flight == 0


async def test_chat_tokenize_gives_the_template_and_what_chat_feeds(serve, store) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    async with serve(store(), preload=[DEMO]) as server:
        await server.wait_state(DEMO, ModelState.READY)
        r = await server.client.post("/chat_tokenize", json={"messages": messages, "model": DEMO})
        assert r.status_code == 200 and set(r.json()) == {"tokenize_response", "templated_text"}, r.text
        text, tokens = r.json()["templated_text"], r.json()["tokenize_response"]
        tokenizer = server.registry.get(DEMO).served.tokenizer
        assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert [t["id"] for t in tokens] == tokenizer.encode(text, add_special_tokens=False)
        assert all(t["text"] == text[t["start"]:t["stop"]] for t in tokens)
        chat = await server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert chat.json()["usage"]["prompt_tokens"] == len(tokens), chat.text
        assert_error(await server.client.post("/chat_tokenize", json={"messages": []}), 422, "validation")
        assert_error(await server.client.post("/chat_tokenize", json={"messages": messages, "model": "nope"}),
                     404, "not_found")


async def test_errors_are_tgis(serve, store) -> None:
    async with serve(store()) as server:
        r = await server.client.post("/tokenize", json={"inputs": "hi"})
        assert_error(r, 503, "model_not_ready")
        assert int(r.headers["retry-after"]) > 0
        assert_error(await server.client.post("/tokenize", json={"inputs": "hi", "model": "nope"}), 404, "not_found")
        assert_error(await server.client.post("/tokenize", json={"inputs": ""}), 422, "validation")
        assert_error(await server.client.post("/tokenize", json={"inputs": "hi", "parameters": {"truncate": 0}}),
                     422, "validation")
