"""A generation request refused as invalid (422; 400 on OpenAI's routes), its body's schema or its
values, counts in wcodec_generate_requests_total{status="validation"}, as TGI's router counts
tgi_request_failure{err="validation"}: under the model it names (or the default, or the only ready
one, as the route would pick). One whose model is not in the store or cannot be told (a body that
is no JSON object, several models ready) counts in wcodec_http_requests_total alone, so that no
client can add series. errors.py calls `count_invalid` as it answers the 422."""
from __future__ import annotations

from starlette.requests import Request

from .errors import ServiceError, is_openai
from .openai_api import named

GENERATION_ROUTES = frozenset({"/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions"})


async def count_invalid(request: Request) -> None:
    route = getattr(request.scope.get("route"), "path", None)
    registry = getattr(request.app.state, "registry", None)
    if route not in GENERATION_ROUTES or registry is None:
        return
    try:
        body = await request.json()              # read and kept by the route before it refused it
    except (ValueError, RecursionError):         # not JSON (nor UTF-8), or nested past json's stack
        return
    name = body.get("model") if isinstance(body, dict) else 0
    if not isinstance(name, str | None):         # no object, or no name in it
        return
    name = named(name) if is_openai(route) else name or None         # as the routes take them
    try:
        name = registry.resolve(name)
    except ServiceError:                         # several ready, or none
        return
    if registry.has(name):
        registry.metrics.requests.labels(name, "validation").inc()
