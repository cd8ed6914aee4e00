"""Triton's model repository extension (KServe v2 protocol): index, load and unload, on the
registry that /models serves. tritonclient's get_model_repository_index, load_model and
unload_model work unchanged: a body is optional and read whatever its content type (the client
sends none), a load or unload answers 200 with an empty body once done, and an error keeps this
server's status and shape, whose `error` is the message Triton's clients read."""
from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError

from ..deps import AdminDep, ModelName, RegistryDep
from ..errors import ValidationFailed, responses
from ..openapi import optional_body
from ..registry import ModelEntry, ModelState
from ..schemas.models import RepositoryModel, RepositoryRequest

router = APIRouter(prefix="/v2/repository", tags=["models"])

STATES = {ModelState.AVAILABLE: "UNAVAILABLE", ModelState.LOADING: "LOADING", ModelState.READY: "READY",
          ModelState.UNLOADING: "UNLOADING", ModelState.FAILED: "UNAVAILABLE"}
DONE = {200: {"description": "Done (an empty body, as Triton's)", "content": {}}}
BODY = optional_body(RepositoryRequest)


async def repository_request(request: Request) -> RepositoryRequest:
    raw = await request.body()
    try:
        return RepositoryRequest.model_validate(json.loads(raw) if raw.strip() else {})
    except (ValueError, RecursionError, ValidationError) as e:     # not JSON, or nested past json's stack
        raise ValidationFailed(f"the body is not a repository request: {e}") from None


RepositoryBody = Annotated[RepositoryRequest, Depends(repository_request)]


def _refuse_parameters(body: RepositoryRequest, allowed: set[str]) -> None:
    unknown = sorted(set(body.parameters) - allowed)
    if unknown:
        raise ValidationFailed(f"not supported by this server: parameters.{unknown[0]}")


def _indexed(entry: ModelEntry) -> RepositoryModel:
    reason = "" if entry.state is ModelState.READY else entry.last_error or entry.file.error or ""
    return RepositoryModel(name=entry.name, state=STATES[entry.state], reason=reason)


@router.post("/index", summary="Triton's repository index: every model of the store and its state",
             responses=responses(413, 422), openapi_extra=BODY)
async def index(registry: RegistryDep, body: RepositoryBody) -> list[RepositoryModel]:
    entries = registry.refresh()
    return [_indexed(e) for e in entries if not body.ready or e.state is ModelState.READY]


@router.post("/models/{name}/load", summary="Triton's load: answers once the model is ready",
             dependencies=[AdminDep], response_class=Response, openapi_extra=BODY,
             responses={**DONE, **responses(401, 403, 404, 413, 422, 500, 507)})
async def load(name: ModelName, registry: RegistryDep, body: RepositoryBody) -> Response:
    _refuse_parameters(body, set())
    await registry.load(name)
    return Response()


@router.post("/models/{name}/unload", summary="Triton's unload: waits for the model's requests, then frees it",
             dependencies=[AdminDep], response_class=Response, openapi_extra=BODY,
             responses={**DONE, **responses(401, 403, 404, 413, 422, 500)})
async def unload(name: ModelName, registry: RegistryDep, body: RepositoryBody) -> Response:
    _refuse_parameters(body, {"unload_dependents"})       # wcodec's models have no dependents
    await registry.unload(name)
    return Response()
