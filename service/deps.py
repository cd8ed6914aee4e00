"""Dependencies of the routes, as `Annotated` aliases."""
from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import Forbidden, Unauthorized
from .metrics import Metrics
from .registry import ModelRegistry
from .settings import Settings
from .load.names import NAME_PATTERN


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


_bearer = HTTPBearer(auto_error=False, description="WCODEC_ADMIN_TOKEN, when the server sets one")


def require_admin(settings: Annotated[Settings, Depends(get_settings)],
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """Load and unload need `Authorization: Bearer <WCODEC_ADMIN_TOKEN>` when a token is set."""
    if settings.admin_token is None:
        return
    if credentials is None:
        raise Unauthorized()
    if not secrets.compare_digest(credentials.credentials.encode(), settings.admin_token.get_secret_value().encode()):
        raise Forbidden("the bearer token is not the admin token")


SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
AdminDep = Depends(require_admin)
ModelName = Annotated[str, Path(pattern=NAME_PATTERN, max_length=128, description="a file stem in the store",
                                examples=["smollm2-135m-instruct"])]
