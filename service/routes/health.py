"""Liveness, readiness (wcodec's, and KServe v2's that Triton's clients read), TGI's /info, and the
Prometheus scrape endpoint."""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

import codec

from ..deps import MetricsDep, ModelName, RegistryDep, SettingsDep
from ..errors import ModelNotReady, responses
from ..inference import VALIDATION_WORKERS
from ..registry import ModelRegistry, ModelState
from ..settings import Settings
from ..schemas.completions import MAX_PROMPTS
from ..schemas.tgi import Info

router = APIRouter(tags=["health"])
EMPTY = {200: {"description": "Yes (an empty body, as Triton's); not: an error, as /health/ready's", "content": {}}}


class Liveness(BaseModel):
    status: str = "ok"


class Health(BaseModel):
    status: str
    ready_models: list[str] = []
    process_start_to_ready_s: float | None = None     # the first model's: wcodec_process_start_to_ready_seconds


class TimelineEntry(BaseModel):
    name: str
    start: float = Field(description="seconds after the process started")
    end: float
    seconds: float
    thread: str


class Startup(BaseModel):
    process_start_to_ready_s: float | None
    timeline: list[TimelineEntry]


@router.get("/health", summary="Liveness: the process answers")
async def health() -> Liveness:
    """{"status": "ok"} alone: /health/ready says which models are ready (this answered an empty
    `ready_models` and a null start-up time while models were ready)."""
    return Liveness()


@router.get("/health/ready", summary="Readiness: 200 once a model is ready (the default model, where "
            "WCODEC_DEFAULT_MODEL names one)", responses=responses(503))
async def ready(registry: RegistryDep, settings: SettingsDep) -> Health:
    return Health(status="ready", ready_models=_ready_models(registry, settings),
                  process_start_to_ready_s=registry.metrics.ready_after)


def _ready_models(registry: ModelRegistry, settings: Settings) -> list[str]:
    """The ready models' names; ModelNotReady (503) while none is, or the default model is not."""
    names = sorted(s.name for s in registry.refresh() if s.state is ModelState.READY)
    if not names:
        raise ModelNotReady(registry.startup_error or "no model is ready yet", settings.retry_after_s)
    if settings.default_model and settings.default_model not in names:    # requests without a model
        raise ModelNotReady(f"the default model {settings.default_model!r} is not ready", settings.retry_after_s)
    return names


@router.get("/v2/health/live", summary="KServe v2 (Triton) liveness: 200, an empty body", response_class=Response,
            responses=EMPTY)
async def v2_live() -> Response:
    return Response()


@router.get("/v2/health/ready", summary="KServe v2 (Triton) readiness: /health/ready's answer, an empty body "
            "when ready", response_class=Response, responses={**EMPTY, **responses(503)})
async def v2_ready(registry: RegistryDep, settings: SettingsDep) -> Response:
    _ready_models(registry, settings)
    return Response()


@router.get("/v2/models/{name}/ready", summary="KServe v2 (Triton) model readiness: 200, an empty body, once "
            "the model is ready", response_class=Response, responses={**EMPTY, **responses(404, 422, 503)})
async def v2_model_ready(name: ModelName, registry: RegistryDep, settings: SettingsDep) -> Response:
    state = registry.get(name).state
    if state is not ModelState.READY:
        raise ModelNotReady(f"model {name!r} is not ready (state {state.value})", settings.retry_after_s)
    return Response()


@router.get("/health/startup", summary="The start-up timeline: every phase and import, seconds after the "
            "process started")
async def startup(request: Request, registry: RegistryDep) -> Startup:
    return Startup(process_start_to_ready_s=registry.metrics.ready_after,
                   timeline=request.app.state.timeline.as_json())


@router.get("/info", summary="TGI-style information on the default model", responses=responses(404, 422, 503))
async def info(registry: RegistryDep, settings: SettingsDep, model: str | None = None) -> Info:
    entry = registry.get(registry.resolve(model))
    served = entry.served
    limit = min(settings.max_total_tokens, served.max_positions) if served else settings.max_total_tokens
    return Info(model_id=entry.name, model_dtype=str(served.dtype) if served else None,
                model_device_type=registry.device.type, max_concurrent_requests=settings.max_queue + settings.max_batch_size,
                max_best_of=settings.max_best_of, max_stop_sequences=settings.max_stop_sequences,
                max_top_n_tokens=settings.max_top_n_tokens, max_input_tokens=min(settings.max_input_tokens, limit - 1),
                max_total_tokens=limit, max_batch_size=settings.max_batch_size,
                validation_workers=VALIDATION_WORKERS, max_client_batch_size=MAX_PROMPTS, version=codec.__version__)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
