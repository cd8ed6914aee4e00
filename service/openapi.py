"""The OpenAPI schema, plus the Server-Sent Event payloads (TGI's StreamResponse, OpenAI's
ChatCompletionChunk) that no JSON route returns, so /docs shows the stream routes' events, and the
body of Triton's repository routes, which read it themselves (any content type). The
OpenAI routes (/v1/*) answer a validation error with 400 (service/errors.py): FastAPI's own 422
is taken off them."""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import StreamingResponse
from pydantic.json_schema import models_json_schema

from .errors import is_openai
from .schemas.chat import ChatCompletionChunk
from .schemas.models import RepositoryRequest
from .schemas.tgi import StreamResponse

EVENT_MODELS = (StreamResponse, ChatCompletionChunk)
EXTRA_MODELS = (*EVENT_MODELS, RepositoryRequest)       # in the schema, though no route declares them
REF = "#/components/schemas/{model}"


def optional_body(model: type) -> dict:
    """`openapi_extra=` of a route that reads an optional JSON body of `model` itself."""
    return {"requestBody": {"required": False,
                            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def sse_content(model: type) -> dict:
    """`responses=` content of a route that streams `model` events."""
    return {"text/event-stream": {"schema": {"$ref": REF.format(model=model.__name__)}}}


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A stream route's answer: its events as they come (no proxy buffering)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def install(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            _, defs = models_json_schema([(m, "serialization") for m in EXTRA_MODELS], ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, item in schema["paths"].items():
                for op in item.values() if is_openai(path) else ():
                    op["responses"].pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
