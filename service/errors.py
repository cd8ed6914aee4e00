"""Every service error and its HTTP mapping, in one place.

Errors answer in TGI's shape `{"error": str, "error_type": str}`, except on the OpenAI routes
(`/v1/*`), which answer in OpenAI's `{"error": {"message", "type", "param", "code"}}` with OpenAI's
status codes (a validation error is a 400 there, a failed generation a 500). Handlers and the
registry raise the specific `ServiceError` below; `install(app)` turns them (and FastAPI's own
validation and routing errors) into responses; `responses(...)` and `openai_responses(...)` declare
them on routes for the OpenAPI schema.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIError


class ServiceError(Exception):
    status_code = 500
    error_type = "internal"
    description = "Internal error"
    openai = (500, "server_error", "internal_error")      # (status, type, code) on the OpenAI routes

    def __init__(self, message: str, headers: dict[str, str] | None = None, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.param = param                     # the request field at fault (OpenAI's `param`)


class Unauthorized(ServiceError):
    status_code, error_type, description = 401, "unauthorized", "Missing bearer token"
    openai = (401, "authentication_error", "invalid_api_key")

    def __init__(self, message: str = "this route needs a bearer token"):
        super().__init__(message, {"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    status_code, error_type, description = 403, "forbidden", "Wrong bearer token"
    openai = (403, "permission_error", "forbidden")


class ModelNotFound(ServiceError):
    status_code, error_type, description = 404, "not_found", "Unknown model"
    openai = (404, "invalid_request_error", "model_not_found")


class RouteNotFound(ServiceError):
    """FastAPI's own routing answers: 404 no such route, 405 wrong method."""

    def __init__(self, status_code: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message, headers)
        self.status_code, self.openai = status_code, (status_code, "invalid_request_error", None)
        self.error_type = "not_found" if status_code == 404 else "http"


class ValidationFailed(ServiceError):
    status_code, error_type, description = 422, "validation", "Input validation error"
    openai = (400, "invalid_request_error", "invalid_value")


class PayloadTooLarge(ServiceError):
    """A request body over WCODEC_PAYLOAD_LIMIT bytes: TGI's 413 (its router's --payload-limit),
    answered before the body is read whole (payload.py)."""
    status_code, error_type, description = 413, "payload_too_large", "Request body too large"
    openai = (413, "invalid_request_error", "payload_too_large")

    def __init__(self, limit: int):
        super().__init__(f"the request body is over {limit} bytes (WCODEC_PAYLOAD_LIMIT)")


class TemplateFailed(ValidationFailed):
    """The model's chat template refused the messages (its raise_exception: roles that do not
    alternate, say), as TGI answers it."""
    error_type = "template_error"


class InvalidModelName(ValidationFailed):
    """A name that is not a plain file stem (no separators, no leading dot)."""


class UnsupportedParameter(ValidationFailed):
    """A request field this server cannot honour (set to something other than its neutral value)."""
    openai = (400, "invalid_request_error", "unsupported_parameter")

    def __init__(self, param: str, why: str = "not supported by this server"):
        super().__init__(f"`{param}`: {why}", param=param)


class LoadFailed(ServiceError):
    status_code, error_type, description = 500, "load_failed", "The model failed to load"
    openai = (500, "server_error", "load_failed")


class UnloadFailed(ServiceError):
    """The model's engine did not close cleanly; its weights were freed all the same."""
    status_code, error_type, description = 500, "unload_failed", "The model's unload failed"
    openai = (500, "server_error", "unload_failed")


class GenerationFailed(ServiceError):
    status_code, error_type, description = 424, "generation", "Request failed during generation"
    openai = (500, "server_error", "generation_failed")


class IncompleteGeneration(ServiceError):
    """A stream that ends without its last token: TGI's 500 "Incomplete generation", here a server
    bug met after the stream started (its first event is sent: no status can answer it)."""
    status_code, error_type, description = 500, "incomplete_generation", "Incomplete generation"


class QueueFull(ServiceError):
    status_code, error_type, description = 429, "overloaded", "Model is overloaded"
    openai = (429, "rate_limit_error", "queue_full")

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(f"Model is overloaded: {message}", {"Retry-After": str(retry_after_s)})


class ClientClosed(ServiceError):
    """The client hung up before its (not streamed) answer, whose generations were then cancelled:
    nginx's 499, which nobody reads but the request metrics count."""
    status_code, error_type, description = 499, "client_closed", "Client closed the request"
    openai = (499, "client_closed", None)


class ModelNotReady(ServiceError):
    status_code, error_type, description = 503, "model_not_ready", "Model is not loaded (yet)"
    openai = (503, "server_error", "model_not_ready")

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class InsufficientMemory(ServiceError):
    status_code, error_type, description = 507, "insufficient_memory", "The model does not fit"
    openai = (507, "server_error", "insufficient_memory")


_BY_STATUS: dict[int, type[ServiceError]] = {c.status_code: c for c in (
    Unauthorized, Forbidden, ModelNotFound, PayloadTooLarge, ValidationFailed, LoadFailed, GenerationFailed,
    QueueFull, ModelNotReady, InsufficientMemory)}
_BY_OPENAI_STATUS: dict[int, type[ServiceError]] = {c.openai[0]: c for c in (
    ModelNotFound, PayloadTooLarge, ValidationFailed, QueueFull, ModelNotReady, GenerationFailed)}


def responses(*codes: int) -> dict[int | str, dict]:
    """The `responses=` of a route that can answer with these error codes."""
    return {code: {"model": ErrorResponse, "description": _BY_STATUS[code].description} for code in codes}


def openai_responses(*codes: int) -> dict[int | str, dict]:
    """The `responses=` of an OpenAI route (/v1/*) that can answer with these (OpenAI) codes."""
    return {code: {"model": OpenAIErrorResponse, "description": _BY_OPENAI_STATUS[code].description}
            for code in codes}


def _body(message: str, error_type: str) -> dict:
    return ErrorResponse(error=message, error_type=error_type).model_dump()


def _openai_body(exc: ServiceError) -> dict:
    _, kind, code = exc.openai
    return OpenAIErrorResponse(error=OpenAIError(message=exc.message, type=kind, param=exc.param,
                                                 code=code)).model_dump()


def is_openai(path: str) -> bool:
    return path.startswith("/v1/")


def _respond(request: Request, exc: ServiceError) -> JSONResponse:
    return respond(request.url.path, exc)


def respond(path: str, exc: ServiceError) -> JSONResponse:
    """The response to `exc` on the route at `path`: OpenAI's shape on /v1/*, TGI's elsewhere."""
    if is_openai(path):
        return JSONResponse(_openai_body(exc), exc.openai[0], headers=exc.headers)
    return JSONResponse(_body(exc.message, exc.error_type), exc.status_code, headers=exc.headers)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return _respond(request, exc)


def _where(loc) -> str:
    return ".".join(str(p) for p in loc if p != "body")


def _field(loc) -> str | None:
    """The request body's field an error is about (OpenAI's `param`); None for the body as a whole."""
    fields = [p for p in loc if p != "body"]
    return fields[0] if fields and isinstance(fields[0], str) else None


SELF_NAMED = "self_named"                      # a schema's error whose message names its field


def self_named(message: str) -> PydanticCustomError:
    """A schema's validation error in words that name the field themselves (TGI's router's:
    "`inputs` cannot be empty"): the 422 says them as they are, with no location before them."""
    return PydanticCustomError(SELF_NAMED, message)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    wheres = ["" if e.get("type") == SELF_NAMED else _where(e.get("loc", ())) for e in errors]
    parts = [f"{w}: {e.get('msg')}" if w else str(e.get("msg")) for w, e in zip(wheres, errors)]
    param = _field(errors[0].get("loc", ())) if errors else None
    return _respond(request, ValidationFailed("; ".join(parts) or "invalid request", param=param))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc, BodyOverLimit):         # payload.py, as the route read the body
        return _respond(request, PayloadTooLarge(exc.limit))
    if exc.status_code == 400:                 # FastAPI's "error parsing the body" (not UTF-8, say): a
        return _respond(request, ValidationFailed(f"invalid request body: {exc.detail}"))   # 422, as for bad JSON
    return _respond(request, RouteNotFound(exc.status_code, str(exc.detail), exc.headers))


class BodyOverLimit(StarletteHTTPException):
    """A body that grew past the limit as the route read it (payload.py): an HTTPException, which
    FastAPI's body reading lets through (any other error there it makes a 400)."""

    def __init__(self, limit: int):
        super().__init__(413)
        self.limit = limit


def internal(exc: Exception) -> ServiceError:
    """Any other exception (a bug) as the 500 that answers it."""
    return ServiceError(f"internal error: {type(exc).__name__}: {str(exc)[:200]}")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception (a bug): still the route's error shape, a 500; Starlette then re-raises
    it, so the server's log has the traceback."""
    return _respond(request, internal(exc))


Handler = Callable[[Request, Exception], Awaitable[JSONResponse]]


def _counting(handler: Handler, on_invalid: Callable[[Request], Awaitable[None]]) -> Handler:
    """`handler`, after `on_invalid(request)` (refusals.py: the metrics' status="validation")."""
    async def counted(request: Request, exc: Exception) -> JSONResponse:
        await on_invalid(request)
        return await handler(request, exc)
    return counted


def install(app: FastAPI, on_invalid: Callable[[Request], Awaitable[None]] | None = None) -> None:
    """The handlers; `on_invalid` is told of every request answered with a validation error."""
    app.add_exception_handler(Exception, _unexpected)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    invalid = [(ValidationFailed, _service_error), (RequestValidationError, _validation_error)]
    for exc, handler in invalid:
        app.add_exception_handler(exc, handler if on_invalid is None else _counting(handler, on_invalid))


def error_event(exc: ServiceError) -> dict:
    """The SSE payload TGI sends when a stream fails after it started."""
    return _body(exc.message, exc.error_type)


def incomplete(exc: Exception) -> IncompleteGeneration:
    """Any other exception (a bug) met by a TGI stream: TGI's incomplete generation, naming it."""
    return IncompleteGeneration(f"{IncompleteGeneration.description}: {internal(exc).message}")


def openai_error_event(exc: ServiceError) -> dict:
    """The SSE payload of an OpenAI stream that fails after it started (the client raises it)."""
    return _openai_body(exc)
