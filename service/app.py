"""`create_app(settings)`: the FastAPI application. Nothing heavy happens at import or at
creation; the lifespan builds the model registry and starts, in the background, the demo
build and the preloads, so /health answers while models load. `wcodec serve` passes its
start-up timeline and the early reads of the preloaded archives (wcodec/serve.py)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import codec

from . import errors, openapi, refusals
from .metrics import HttpMetricsMiddleware, Metrics
from .payload import PayloadLimitMiddleware
from .registry import ModelRegistry
from .routes import chat, completions, generate, health, models, openai_models, repository
from .settings import Settings
from .timeline import Timeline

log = logging.getLogger("wcodec.service")
DESCRIPTION = ("Serves `.wcodec` models: decoded onto the GPU (or the CPU) at load time, generation "
               "in Text Generation Inference's API and OpenAI's (/v1), model control (wcodec's /models "
               "and Triton's repository API, /v2/repository).")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    timeline: Timeline = app.state.timeline
    registry = ModelRegistry(app.state.settings, app.state.metrics, timeline=timeline, early=app.state.early)
    app.state.early = {}                        # the registry owns (and releases) them now
    registry.refresh()
    app.state.registry = registry
    timeline.mark("lifespan: registry ready, start-up task begins")
    registry.startup = asyncio.create_task(registry.start(), name="wcodec start-up")
    registry.startup.add_done_callback(lambda _: timeline.log(log))
    try:
        yield
    finally:
        await registry.close()


def create_app(settings: Settings | None = None, *, timeline: Timeline | None = None,
               early: dict | None = None) -> FastAPI:
    app = FastAPI(title="wcodec", version=codec.__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings or Settings()
    app.state.timeline = timeline or Timeline()
    app.state.early = early or {}
    app.state.metrics = Metrics()
    errors.install(app, on_invalid=refusals.count_invalid)
    openapi.install(app)
    app.add_middleware(PayloadLimitMiddleware, limit=app.state.settings.payload_limit)
    app.add_middleware(HttpMetricsMiddleware, metrics=app.state.metrics)     # outside: it counts the 413s
    for module in (health, models, repository, generate, chat, completions, openai_models):
        app.include_router(module.router)
    return app
