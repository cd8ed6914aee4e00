"""The model control API: list, show, load, unload."""
from __future__ import annotations

from datetime import datetime, timezone
from fastapi import APIRouter, Query, Response, status

from ..deps import AdminDep, ModelName, RegistryDep
from ..errors import responses
from ..registry import HOLDS_MEMORY, ModelEntry, ModelState
from ..schemas.models import LoadProgress, LoadTimings, ModelInfo, ModelList, Weights

router = APIRouter(prefix="/models", tags=["models"])


def model_info(entry: ModelEntry, device: str) -> ModelInfo:
    f, s = entry.file, entry.stats
    timings = LoadTimings(read_s=s.read_s, h2d_s=s.h2d_s, decode_s=s.decode_s, build_s=s.build_s,
                          total_s=s.total_s, source=s.source) if s else None
    loaded_at = datetime.fromtimestamp(entry.loaded_at, timezone.utc) if entry.loaded_at else None
    p = entry.progress
    weights, weight_bytes = (entry.weights, entry.weight_bytes) if entry.state in HOLDS_MEMORY else (None, None)
    return ModelInfo(name=entry.name, state=entry.state.value, device=device, compressed_bytes=f.compressed_bytes,
                     decoded_bytes=f.decoded_bytes, ratio=round(f.ratio, 6), loaded_at=loaded_at,
                     last_load=timings, last_error=entry.last_error or f.error, in_flight=entry.in_flight,
                     progress=LoadProgress(phase=p.phase, bytes_done=p.bytes_done, bytes_total=p.bytes_total),
                     weights=weights, weight_bytes=weight_bytes, resident=weights, resident_bytes=weight_bytes,
                     host_weight_bytes=entry.served.host_bytes if entry.served is not None else None)


@router.get("", summary="Every model in the store, with its state and sizes")
async def list_models(registry: RegistryDep) -> ModelList:
    return ModelList(models=[model_info(s, registry.device.type) for s in registry.refresh()])


@router.get("/{name}", summary="One model, with its load progress", responses=responses(404, 422))
async def get_model(name: ModelName, registry: RegistryDep) -> ModelInfo:
    return model_info(registry.get(name), registry.device.type)


@router.post("/{name}/load", summary="Decode a model onto the device and keep it resident",
             dependencies=[AdminDep], responses={202: {"model": ModelInfo, "description": "Loading started"},
                                                 **responses(401, 403, 404, 422, 500, 507)})
async def load_model(name: ModelName, registry: RegistryDep, response: Response,
                     wait: bool = Query(True, description="answer once the model is ready"),
                     weights: Weights | None = Query(
                         None, description="decoder layers decoded once (default: WCODEC_WEIGHTS), or kept "
                                           "compressed on the device and decoded just before use"),
                     resident: Weights | None = Query(None, deprecated=True,
                                                      description="the old name of `weights`")) -> ModelInfo:
    entry = await registry.load(name, wait=wait, weights=weights or resident)
    if entry.state is not ModelState.READY or entry.busy:     # loading, or reloading beside the loaded version
        response.status_code = status.HTTP_202_ACCEPTED
    return model_info(entry, registry.device.type)


@router.post("/{name}/unload", summary="Wait for the model's requests, then free its memory",
             dependencies=[AdminDep], responses=responses(401, 403, 404, 422, 500))
async def unload_model(name: ModelName, registry: RegistryDep) -> ModelInfo:
    return model_info(await registry.unload(name), registry.device.type)
