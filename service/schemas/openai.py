"""What OpenAI's routes share: the sampling fields of chat and completions requests (those this
server cannot honour are declared, so that a value other than their neutral one is refused with a
400 naming the field, never ignored), usage, and the model list of /v1/models."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from .tgi import MAX_SEED

MAX_STOP = 4
Stops = Annotated[list[str], Field(max_length=MAX_STOP)]


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk (empty `choices`) with the usage.")


class OpenAIRequest(BaseModel):
    model: str | None = Field(None, description="A model of the store (see /v1/models); none, 'tgi' or 'dummy' "
                                                "(TGI clients' placeholders): the default model "
                                                "(WCODEC_DEFAULT_MODEL, else the only ready one).")
    max_tokens: int | None = Field(None, ge=1, description="New tokens at most (default: "
                                                           "WCODEC_DEFAULT_MAX_NEW_TOKENS).")
    temperature: float | None = Field(None, ge=0, le=2, description="0 or none: greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | Stops | None = Field(None, description=f"Up to {MAX_STOP} sequences; the text ends before the "
                                                       "first one generated.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, description="Only 1.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: must be empty.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Not supported: must be 0.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Not supported: must be 0.")
    user: str | None = Field(None, description="An end-user id; accepted, not used.")

    def unsupported(self) -> dict[str, str]:
        """field -> why, for the fields set to something this server cannot do (400 naming the first)."""
        bad = {"n": "only 1 choice per prompt"} if (self.n or 1) > 1 else {}
        bad |= {"logit_bias": "not supported: must be empty"} if self.logit_bias else {}
        return bad | {f: "not supported: must be 0" for f in ("presence_penalty", "frequency_penalty")
                      if getattr(self, f)}

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class OpenAIResponse(BaseModel):
    """What every completion and chunk starts with."""
    id: str
    created: int
    model: str
    system_fingerprint: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="the archive file's modification time (Unix seconds)")
    owned_by: str = "wcodec"
    state: Literal["available", "loading", "ready", "unloading", "failed"] = Field(
        description="wcodec's own: only a `ready` model generates; the others answer 503 (POST "
                    "/models/{name}/load loads one)")


class ModelCardList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
