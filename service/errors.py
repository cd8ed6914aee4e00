"""Every service error and its HTTP mapping, in one place.

Errors answer in TGI's shape `{"error": str, "error_type": str}`. Handlers and the registry raise
the specific `ServiceError` below; `install(app)` turns them (and FastAPI's own validation and
routing errors) into responses; `responses(...)` declares them on routes for the OpenAPI schema.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class ServiceError(Exception):
    status_code = 500
    error_type = "internal"
    description = "Internal error"

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class Unauthorized(ServiceError):
    status_code, error_type, description = 401, "unauthorized", "Missing bearer token"

    def __init__(self, message: str = "this route needs a bearer token"):
        super().__init__(message, {"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    status_code, error_type, description = 403, "forbidden", "Wrong bearer token"


class ModelNotFound(ServiceError):
    status_code, error_type, description = 404, "not_found", "Unknown model"


class ValidationFailed(ServiceError):
    status_code, error_type, description = 422, "validation", "Input validation error"


class InvalidModelName(ValidationFailed):
    """A name that is not a plain file stem (no separators, no leading dot)."""


class LoadFailed(ServiceError):
    status_code, error_type, description = 500, "load_failed", "The model failed to load"


class GenerationFailed(ServiceError):
    status_code, error_type, description = 424, "generation", "Request failed during generation"


class QueueFull(ServiceError):
    status_code, error_type, description = 429, "overloaded", "Model is overloaded"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class ModelNotReady(ServiceError):
    status_code, error_type, description = 503, "model_not_ready", "Model is not loaded (yet)"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class InsufficientMemory(ServiceError):
    status_code, error_type, description = 507, "insufficient_memory", "The model does not fit"


_BY_STATUS: dict[int, type[ServiceError]] = {c.status_code: c for c in (
    Unauthorized, Forbidden, ModelNotFound, ValidationFailed, LoadFailed, GenerationFailed,
    QueueFull, ModelNotReady, InsufficientMemory)}


def responses(*codes: int) -> dict[int | str, dict]:
    """The `responses=` of a route that can answer with these error codes."""
    return {code: {"model": ErrorResponse, "description": _BY_STATUS[code].description} for code in codes}


def _body(message: str, error_type: str) -> dict:
    return ErrorResponse(error=message, error_type=error_type).model_dump()


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return JSONResponse(_body(exc.message, exc.error_type), exc.status_code, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return JSONResponse(_body("; ".join(parts) or "invalid request", "validation"), 422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400:                 # FastAPI's "error parsing the body" (not UTF-8, say): a
        return JSONResponse(_body(f"invalid request body: {exc.detail}", "validation"), 422)   # 422, as for bad JSON
    error_type = "not_found" if exc.status_code == 404 else "http"
    return JSONResponse(_body(str(exc.detail), error_type), exc.status_code, headers=exc.headers)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


def error_event(exc: ServiceError) -> dict:
    """The SSE payload TGI sends when a stream fails after it started."""
    return _body(exc.message, exc.error_type)
