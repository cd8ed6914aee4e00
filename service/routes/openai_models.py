"""OpenAI's model list: every model of the store, loaded or not (`state` tells them apart)."""
from __future__ import annotations

from fastapi import APIRouter

from ..deps import RegistryDep
from ..errors import ModelNotFound, openai_responses
from ..registry import ModelEntry
from ..schemas.openai import ModelCard, ModelCardList

router = APIRouter(prefix="/v1/models", tags=["openai"])


def card(entry: ModelEntry) -> ModelCard:
    return ModelCard(id=entry.name, created=entry.file.mtime_ns // 10**9, state=entry.state.value)


@router.get("", summary="Every model of the store (OpenAI style)")
async def list_models(registry: RegistryDep) -> ModelCardList:
    return ModelCardList(data=[card(s) for s in registry.refresh()])


@router.get("/{model_id}", summary="One model of the store (OpenAI style)", responses=openai_responses(404))
async def get_model(model_id: str, registry: RegistryDep) -> ModelCard:
    if not registry.has(model_id):
        raise ModelNotFound(f"the model {model_id!r} does not exist", param="model")
    return card(registry.get(model_id))
