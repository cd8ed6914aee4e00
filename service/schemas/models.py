"""The model control API's shapes (Triton's repository API, with sizes, progress and timings)."""
from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

State = Literal["available", "loading", "ready", "unloading", "failed"]
Weights = Literal["decoded", "compressed"]


class LoadProgress(BaseModel):
    phase: str = Field(description="idle, queued, decoding, building, ready, unloading or failed")
    bytes_done: int = Field(description="decoded bytes so far")
    bytes_total: int


class LoadTimings(BaseModel):
    read_s: float = Field(description="reader thread: preadv + CRC32 (overlaps decode)")
    h2d_s: float = Field(description="host-to-device copies (CUDA events; 0 on the CPU)")
    decode_s: float
    build_s: float = Field(description="config, tokenizer, model on meta, assignment")
    total_s: float
    source: Literal["file", "early read", "host cache"] = Field(
        "file", description="where the compressed bytes came from: the file, the start-up read, or the host "
                            "cache (a model switch: no file read, every stream verified again)")


class ModelInfo(BaseModel):
    name: str
    state: State
    device: str | None = Field(description="where it is (or would be) loaded")
    compressed_bytes: int
    decoded_bytes: int
    ratio: float = Field(description="compressed / decoded")
    loaded_at: datetime | None = Field(description="when the last successful load ended")
    last_load: LoadTimings | None
    last_error: str | None
    progress: LoadProgress
    in_flight: int = Field(description="requests holding the model")
    weights: Weights | None = Field(
        None, description="how its decoder layers are held on the device while loaded (docs/RESIDENT.md)")
    weight_bytes: int | None = Field(None, description="device bytes its weights take as held (decoded tensors, "
                                                        "or kept compressed streams, index and scratch; on the CPU "
                                                        "after its compute setting: float32 doubles bf16), what "
                                                        "the memory budget charges and wcodec_model_weight_bytes "
                                                        "reports; while loading, the load's estimate")
    host_weight_bytes: int | None = Field(None, description="host bytes of its weights while loaded: on a GPU, "
                                          "compressed mode keeps an untied embedding table page-locked there")
    resident: Weights | None = Field(None, description="deprecated: the old name of `weights`")
    resident_bytes: int | None = Field(None, description="deprecated: the old name of `weight_bytes`")


class ModelList(BaseModel):
    models: list[ModelInfo]


RepositoryState = Literal["UNAVAILABLE", "LOADING", "READY", "UNLOADING"]


class RepositoryModel(BaseModel):
    """One model of Triton's repository index (POST /v2/repository/index)."""
    name: str
    version: str = Field("1", description="wcodec keeps one version of each model")
    state: RepositoryState = Field(description="Triton's names: available and failed are UNAVAILABLE")
    reason: str = Field("", description="why it is not ready: its last load's error, or the file's")


class RepositoryRequest(BaseModel):
    """The body of Triton's index, load and unload requests (optional, any content type)."""
    ready: bool = Field(False, description="index: list only the models ready for requests")
    parameters: dict[str, object] = Field(default_factory=dict, description="load: none is supported (a "
                                          "model config or files to load from); unload: `unload_dependents`")
