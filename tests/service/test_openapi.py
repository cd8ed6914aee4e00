"""The OpenAPI schema (/docs) is complete: every route, its request and response models, its
error responses, and the stream routes' event payloads."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.anyio

ROUTES = {
    ("get", "/health"): set(), ("get", "/health/ready"): {"503"}, ("get", "/health/startup"): set(), ("get", "/info"): {"404", "422", "503"},
    ("get", "/metrics"): set(), ("get", "/models"): set(), ("get", "/models/{name}"): {"404", "422"},
    ("post", "/models/{name}/load"): {"202", "401", "403", "404", "422", "500", "507"},
    ("post", "/models/{name}/unload"): {"401", "403", "404", "422"},
    ("get", "/v2/health/live"): set(), ("get", "/v2/health/ready"): {"503"},
    ("get", "/v2/models/{name}/ready"): {"404", "422", "503"},
    ("post", "/v2/repository/index"): {"413", "422"},
    ("post", "/v2/repository/models/{name}/load"): {"401", "403", "404", "413", "422", "500", "507"},
    ("post", "/v2/repository/models/{name}/unload"): {"401", "403", "404", "413", "422"},
    ("post", "/generate"): {"404", "413", "422", "424", "429", "503"},
    ("post", "/generate_stream"): {"404", "413", "422", "424", "429", "503"},
    ("post", "/"): {"404", "413", "422", "424", "429", "503"},
    ("post", "/tokenize"): {"404", "413", "422", "503"}, ("post", "/chat_tokenize"): {"404", "413", "422", "503"},
}
OPENAI_ROUTES = {      # OpenAI's status codes and error shape
    ("post", "/v1/chat/completions"): {"400", "404", "413", "429", "500", "503"},
    ("post", "/v1/completions"): {"400", "404", "413", "429", "500", "503"},
    ("get", "/v1/models"): set(), ("get", "/v1/models/{model_id}"): {"404"},
}


def _refs(node) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


async def test_schema_is_complete(serve, tmp_path) -> None:
    async with serve(tmp_path) as server:
        schema = (await server.client.get("/openapi.json")).json()
        docs = await server.client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    ops = {(m, p): op for p, item in schema["paths"].items() for m, op in item.items()}
    assert set(ops) == set(ROUTES) | set(OPENAI_ROUTES)
    for routes, shape in ((ROUTES, "/ErrorResponse"), (OPENAI_ROUTES, "/OpenAIErrorResponse")):
        for key, codes in routes.items():
            assert codes | {"200"} <= set(ops[key]["responses"]), key
            for code in codes - {"202"}:
                ref = ops[key]["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith(shape), (key, code)
    assert not any("422" in ops[key]["responses"] for key in OPENAI_ROUTES)      # a 400 there
    components = schema["components"]["schemas"]
    for name in ("GenerateRequest", "GenerateParameters", "GenerateResponse", "Details", "Token", "StreamResponse",
                 "StreamDetails", "CompatGenerateRequest", "SimpleToken", "ChatTokenizeResponse", "ErrorResponse", "ModelInfo", "ModelList",
                 "LoadProgress", "Info", "ChatRequest", "ChatCompletion", "ChatCompletionChunk", "CompletionRequest",
                 "Completion", "ModelCardList", "OpenAIErrorResponse",
                 "RepositoryModel", "RepositoryRequest"):
        assert name in components, name
    dangling = {r for r in _refs(schema) if r.rsplit("/", 1)[-1] not in components}
    assert not dangling, dangling
    for key, event in ((("post", "/generate_stream"), "/StreamResponse"), (("post", "/v1/completions"), "/Completion"),
                       (("post", "/v1/chat/completions"), "/ChatCompletionChunk")):
        assert ops[key]["responses"]["200"]["content"]["text/event-stream"]["schema"]["$ref"].endswith(event), key
    assert ops[("post", "/generate")]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/GenerateRequest")
    assert "bearer" in json.dumps(schema["components"].get("securitySchemes", {})).lower()


async def test_a_route_declares_413_where_it_answers_it(serve, store) -> None:
    """A body over WCODEC_PAYLOAD_LIMIT is refused as the route reads it: every POST route that
    reads a body answers 413, and its document says so (none did); /models' load and unload read
    none (here they answer 404: no model "nope")."""
    async with serve(store(), payload_limit=100) as server:
        schema = (await server.client.get("/openapi.json")).json()
        big = json.dumps({"inputs": "a " * 100})
        posts = {p: item["post"]["responses"] for p, item in schema["paths"].items() if "post" in item}
        assert len(posts) == 12
        for path, declared in posts.items():
            r = await server.client.post(path.replace("{name}", "nope"), content=big,
                                         headers={"content-type": "application/json"})
            assert (r.status_code == 413) == ("413" in declared), (path, r.status_code)
        assert sum("413" in declared for declared in posts.values()) == 10
