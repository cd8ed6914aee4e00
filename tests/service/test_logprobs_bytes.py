"""OpenAI's logprobs of tokens that hold a piece of a character (the demo's byte-level BPE spells
'日' as 'æĹ' + '¥', b'\\xe6\\x97' + b'\\xa5'): each token's `bytes` are its own, so that the content
tokens' bytes, joined, are the content's UTF-8; a token that is not UTF-8 on its own is written
'bytes:\\xNN...' (OpenAI's form) in `token`, `tokens` and the keys of completions' top_logprobs,
where two tokens no longer share one key ('\\ufffd' before), in a stream too. The keys' rules on a
stand-in model."""
from __future__ import annotations

import math
from types import SimpleNamespace

import openai
import pytest
from service_helpers import DEMO

from service import completions
from service.openai_api import token_string

TARGET = "café costs 5€ 🍕 日本語"                 # é and € whole tokens, 🍕 and 日本語 in pieces
PIZZAS = "🍕🍕🍕🍕🍕🍕"                             # the demo goes on with 🍕, three tokens each


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live[0]}/v1", api_key="unused", max_retries=0)


def raw(token: str) -> bytes:
    """The bytes a `token` string stands for (OpenAI's 'bytes:' form undone)."""
    if not token.startswith("bytes:"):
        return token.encode()
    return token[len("bytes:"):].encode("latin-1").decode("unicode_escape").encode("latin-1")


def assert_own_bytes(entries) -> None:
    """Each entry's bytes are non-empty and its `token` is their text, or their 'bytes:' form."""
    for t in entries:
        assert t.bytes and t.token == token_string(bytes(t.bytes)) and raw(t.token) == bytes(t.bytes), t


def test_chat_tokens_bytes_spell_the_content(client) -> None:
    out = client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Say it."}], max_tokens=40,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         response_format={"type": "regex", "value": TARGET})
    choice = out.choices[0]
    content = choice.logprobs.content
    assert choice.message.content == TARGET and choice.finish_reason == "stop"
    assert b"".join(bytes(t.bytes) for t in content) == TARGET.encode()
    assert len(content) == out.usage.completion_tokens - 1                      # all but the end of text
    assert_own_bytes(content)
    assert sum(t.token.startswith("bytes:") for t in content) >= 3               # 🍕 and 日本語's pieces
    for t in content:
        assert_own_bytes(t.top_logprobs)
        assert (t.top_logprobs[0].token, t.top_logprobs[0].bytes) == (t.token, t.bytes)
        alternatives = t.top_logprobs                   # fewer than 3 where the grammar allows fewer
        assert 1 <= len({bytes(a.bytes) for a in alternatives}) == len(alternatives) <= 3
        assert all(isinstance(a.logprob, float) and math.isfinite(a.logprob) for a in alternatives), alternatives
    assert any(len(t.top_logprobs) < 3 for t in content)      # where it did, a null logprob (its -inf) before
    chunks = list(client.chat.completions.create(model=DEMO, messages=[{"role": "user", "content": "Say it."}],
                                                 max_tokens=40, temperature=0, logprobs=True, stream=True,
                                                 response_format={"type": "regex", "value": TARGET}))
    assert [(t.token, t.bytes) for c in chunks for t in c.choices[0].logprobs.content] == \
        [(t.token, t.bytes) for t in content]
    for c in chunks:
        assert b"".join(bytes(t.bytes) for t in c.choices[0].logprobs.content) == c.choices[0].delta.content.encode()


def test_completions_keep_every_piece_of_a_character(client) -> None:
    """Each position's logprobs most likely tokens are as many keys (pieces of different characters
    were one '\\ufffd' before); the tokens, their 'bytes:' form undone, spell the text; the echoed
    prompt's too."""
    lp = client.completions.create(model=DEMO, prompt=PIZZAS, max_tokens=9, temperature=0, logprobs=5).choices[0]
    assert lp.text == "🍕" * 3 and b"".join(raw(t) for t in lp.logprobs.tokens) == lp.text.encode()
    assert all(t.startswith("bytes:") for t in lp.logprobs.tokens)
    assert lp.logprobs.text_offset == [0, 0, 0, 1, 1, 1, 2, 2, 2]              # in characters, each at its start
    for token, logprob, top in zip(lp.logprobs.tokens, lp.logprobs.token_logprobs, lp.logprobs.top_logprobs):
        assert top[token] == logprob == max(top.values()) and len(top) == 5
    echo = client.completions.create(model=DEMO, prompt=PIZZAS, max_tokens=0, logprobs=5, echo=True).choices[0]
    tokens, tops = echo.logprobs.tokens, echo.logprobs.top_logprobs
    assert b"".join(raw(t) for t in tokens) == PIZZAS.encode() and tops[0] is None
    assert all(top[t] == lp_ and 5 <= len(top) <= 6
               for t, lp_, top in zip(tokens[1:], echo.logprobs.token_logprobs[1:], tops[1:]))


def test_token_strings_and_distinct_keys() -> None:
    """OpenAI's 'bytes:' form (printable ASCII as is, the backslash escaped); a token whose key
    another token has keeps its own entry as 'token_id:<id>', the chosen token keeping its key."""
    assert token_string("é".encode()) == "é" and token_string(b" \xf0\x9f") == "bytes: \\xf0\\x9f"
    assert token_string(b"a\\\xe2") == "bytes:a\\x5c\\xe2" and raw(token_string(b"a\\\xe2")) == b"a\\\xe2"
    served = SimpleNamespace(token_bytes={1: b"\xe2", 2: b"x", 3: b"x", 4: b"\xe2", 5: b"\xe3"}.__getitem__)
    top = ((2, -0.5), (1, -1.0), (3, -2.0), (5, -3.0))
    name = completions.namer(served, SimpleNamespace(return_tokens_as_token_ids=None))
    assert completions._alternatives(name, 3, -2.0, top) == \
        {"token_id:2": -0.5, "bytes:\\xe2": -1.0, "x": -2.0, "bytes:\\xe3": -3.0}
    assert completions._alternatives(name, 4, -4.0, top) == \
        {"x": -0.5, "token_id:1": -1.0, "token_id:3": -2.0, "bytes:\\xe3": -3.0, "bytes:\\xe2": -4.0}
