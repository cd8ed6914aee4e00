"""`create_app(settings)`: the FastAPI application. Nothing heavy happens at import or at
creation; the lifespan builds the model registry and starts, in the background, the demo
build and the preloads, so /health answers while models load."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import codec

from . import errors, openapi
from .metrics import HttpMetricsMiddleware, Metrics
from .registry import ModelRegistry
from .routes import chat, generate, health, models
from .settings import Settings

log = logging.getLogger("wcodec.service")
DESCRIPTION = ("Serves `.wcodec` models: decoded onto the GPU (or the CPU) at load time, generation "
               "in Text Generation Inference's API, model control in the spirit of Triton's.")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    registry = ModelRegistry(app.state.settings, app.state.metrics)
    registry.refresh()
    app.state.registry = registry
    registry.startup = asyncio.create_task(registry.start(), name="wcodec start-up")
    try:
        yield
    finally:
        await registry.close()


def create_app(settings: Settings | None = None) -> FastAPI:
    app = FastAPI(title="wcodec", version=codec.__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings or Settings()
    app.state.metrics = Metrics()
    errors.install(app)
    openapi.install(app)
    app.add_middleware(HttpMetricsMiddleware, metrics=app.state.metrics)
    for module in (health, models, generate, chat):
        app.include_router(module.router)
    return app
