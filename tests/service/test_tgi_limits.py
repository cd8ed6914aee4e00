"""TGI's launcher limits as settings: WCODEC_MAX_BEST_OF, WCODEC_MAX_STOP_SEQUENCES and
WCODEC_MAX_TOP_N_TOKENS, at TGI's defaults (--max-best-of 2, --max-stop-sequences 4,
--max-top-n-tokens 5). The TGI routes refuse more in TGI's router's words with the configured
bound (router/src/validation.rs), /info reports them, and /info has every field of TGI's Info
(router/src/lib.rs). OpenAI's routes keep OpenAI's own bounds."""
from __future__ import annotations

import pytest
from pydantic import ValidationError
from service_helpers import DEMO, assert_error, generate_body

from service import inference
from service.registry import ModelState
from service.schemas.chat import ChatRequest
from service.schemas.completions import MAX_PROMPTS
from service.settings import Settings

pytestmark = pytest.mark.anyio
LIMITS = ("WCODEC_MAX_BEST_OF", "WCODEC_MAX_STOP_SEQUENCES", "WCODEC_MAX_TOP_N_TOKENS")
TGI_INFO = {"model_id", "model_sha", "model_dtype", "model_device_type", "model_pipeline_tag",
            "max_concurrent_requests", "max_best_of", "max_stop_sequences", "max_input_tokens", "max_total_tokens",
            "validation_workers", "max_client_batch_size", "router", "version", "sha", "docker_label"}
TGI_ROUTES = (("/generate", {}), ("/generate_stream", {}), ("/", {"stream": True}))


def limits(info: dict) -> tuple[int, int, int]:
    return info["max_best_of"], info["max_stop_sequences"], info["max_top_n_tokens"]


async def refuses(client, parameters: dict, message: str) -> None:
    """Every TGI route answers `parameters` with TGI's 422 in `message`'s words."""
    for route, extra in TGI_ROUTES:
        r = await client.post(route, json={"inputs": "hi", "parameters": parameters, **extra})
        assert assert_error(r, 422, "validation")["error"] == message, (route, r.text)


def test_the_limits_are_environment_variables_at_tgis_defaults(monkeypatch) -> None:
    for name in LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert (Settings().max_best_of, Settings().max_stop_sequences, Settings().max_top_n_tokens) == (2, 4, 5)
    for name, value in zip(LIMITS, ("4", "1", "8")):
        monkeypatch.setenv(name, value)
    assert (Settings().max_best_of, Settings().max_stop_sequences, Settings().max_top_n_tokens) == (4, 1, 8)
    monkeypatch.setenv("WCODEC_MAX_BEST_OF", "0")        # best_of 1 is always a request's right
    with pytest.raises(ValidationError, match="max_best_of"):
        Settings()


def test_openais_top_logprobs_keeps_openais_bound_not_tgis() -> None:
    """Chat's top_logprobs is OpenAI's 0 to 20 (vLLM's max_logprobs default), whatever
    WCODEC_MAX_TOP_N_TOKENS says: it shared TGI's constant."""
    messages = [{"role": "user", "content": "hi"}]
    assert ChatRequest(messages=messages, logprobs=True, top_logprobs=20).top_logprobs == 20
    with pytest.raises(ValidationError):
        ChatRequest(messages=messages, logprobs=True, top_logprobs=21)


async def test_tgis_default_limits_are_refused_in_its_words_and_info_reports_them(serve, store) -> None:
    """best_of 3 was taken (the bound was 4), top_n_tokens up to 20; /info said 4 and had no
    max_top_n_tokens. The limits are checked before a model is picked: none is loaded here."""
    async with serve(store()) as server:
        await refuses(server.client, {"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3")
        await refuses(server.client, {"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6")
        await refuses(server.client, {"top_n_tokens": -1}, "`top_n_tokens` must be >= 0 and <= 5. Given: -1")
        await refuses(server.client, {"stop": list("abcde")}, "`stop` supports up to 4 stop sequences. Given: 5")
        assert limits((await server.client.get("/info", params={"model": DEMO})).json()) == (2, 4, 5)


async def test_info_has_every_field_of_tgis_info_with_honest_values(serve, store) -> None:
    """Every field of TGI's Info; max_client_batch_size (TGI's bound on the prompts of one
    /v1/completions request) said 1 where that route takes 32; validation_workers is the
    tokenizing thread pool's size; what this server has no value for is null."""
    async with serve(store()) as server:
        info = (await server.client.get("/info", params={"model": DEMO})).json()
        assert TGI_INFO <= set(info), TGI_INFO - set(info)
        assert info["max_client_batch_size"] == MAX_PROMPTS == 32, info
        assert info["validation_workers"] == inference.VALIDATION._max_workers == 1, info
        assert info["model_sha"] is info["sha"] is info["docker_label"] is None, info
        assert info["model_dtype"] is None and info["model_pipeline_tag"] == "text-generation", info


async def test_max_best_of_1_disables_best_of_as_tgis_router(serve, store) -> None:
    async with serve(store(), max_best_of=1) as server:
        await refuses(server.client, {"best_of": 2, "do_sample": True},
                      "`best_of` != 1 is not allowed for this endpoint")


async def test_configured_limits_are_applied_and_reported(serve, store) -> None:
    """WCODEC_MAX_BEST_OF=4 takes best_of 3 (and WCODEC_MAX_TOP_N_TOKENS=8 top_n_tokens 8); each
    bound beyond is refused naming the configured value; /info reports them."""
    async with serve(store(), preload=[DEMO], max_best_of=4, max_stop_sequences=1, max_top_n_tokens=8) as server:
        await server.wait_state(DEMO, ModelState.READY)
        r = await server.client.post("/generate", json=generate_body(2, best_of=3, do_sample=True))
        assert r.status_code == 200 and len(r.json()["details"]["best_of_sequences"]) == 2, r.text
        r = await server.client.post("/generate", json=generate_body(2, top_n_tokens=8))
        assert r.status_code == 200 and [len(t) for t in r.json()["details"]["top_tokens"]] == [8, 8], r.text
        await refuses(server.client, {"best_of": 5, "do_sample": True}, "`best_of` must be > 0 and <= 4. Given: 5")
        await refuses(server.client, {"stop": ["a", "b"]}, "`stop` supports up to 1 stop sequences. Given: 2")
        await refuses(server.client, {"top_n_tokens": 9}, "`top_n_tokens` must be >= 0 and <= 8. Given: 9")
        assert limits((await server.client.get("/info")).json()) == (4, 1, 8)
