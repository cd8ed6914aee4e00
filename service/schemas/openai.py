"""What OpenAI's routes share: the sampling fields of chat and completions requests (those this
server cannot honour are declared, so that a value other than their neutral one is refused with a
400 naming the field, never ignored), usage, and the model list of /v1/models."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .tgi import MAX_SEED

MAX_STOP = 4
MAX_BIAS = 100                                  # OpenAI's bound on a logit_bias value
MAX_ID_DIGITS = 19                              # a logit_bias key: a token id, an int64 as vLLM reads it
MAX_N = 16                                      # choices a prompt
Stops = Annotated[list[str], Field(max_length=MAX_STOP)]


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk (empty `choices`) with the usage.")


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)      # 1e309 (inf) or NaN: a 400, as GenerateParameters'
    model: str | None = Field(None, description="A model of the store (see /v1/models); none, 'tgi' or 'dummy' "
                                                "(TGI clients' placeholders): the default model "
                                                "(WCODEC_DEFAULT_MODEL, else the only ready one).")
    max_tokens: int | None = Field(None, ge=1, description="New tokens at most (default: the model's "
                                   "generation_config max_new_tokens, else WCODEC_DEFAULT_MAX_NEW_TOKENS).")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy (whatever top_p and top_k say). "
                                      "None: the model's generation_config value, else 1 (it samples).")
    top_p: float | None = Field(None, gt=0, le=1, description="None: the model's generation_config value, else 1.")
    seed: int | None = Field(None, ge=-2**63, le=MAX_SEED, description="OpenAI's int64 (or up to 2^64 - 1); a "
                             "negative one seeds as its two's complement, as torch's manual_seed takes it.")
    stop: str | Stops | None = Field(None, description=f"Up to {MAX_STOP} sequences; the text ends before the "
                                                       "first one generated.")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's: the text ends after the stop "
                                                    "sequence generated, not before it.")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM's: with logprobs, each token (and "
                                                    "each alternative) written 'token_id:<id>' instead of its text.")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with `stream: true` (a 400 otherwise, "
                                                 "as OpenAI and vLLM answer).")
    n: int | None = Field(None, ge=1, le=MAX_N, description="Choices for each prompt, each its own generation "
                          "(with a seed, choice j samples with seed + j). Greedy choices are alike.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (a decimal string) -> a bias of "
                                                "-100 to 100 added to its logit before sampling (-100 in effect "
                                                "bans it, 100 forces it).")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Subtracted from the logit of every "
                                           "token generated so far (the prompt's do not count).")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Times a token's count among the "
                                            "tokens generated so far, subtracted from its logit.")
    user: str | None = Field(None, description="An end-user id; accepted, not used.")
    # vLLM's sampling extras: the two this engine has (TGI's), and those it has not, declared so
    # that a value other than their neutral one is refused instead of ignored
    top_k: int | None = Field(None, ge=-1, description="vLLM's: sample among the k most likely tokens "
                                                       "(0 or -1: all; None: the model's generation_config value).")
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM's (and TGI's): the logits of the "
                                             "prompt's and generated tokens divided (positive) or multiplied "
                                             "(negative) by it; 1: none; None: the model's generation_config "
                                             "value).")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM's: drop the tokens whose probability (after "
                                "temperature) is under min_p times the most likely one's; 0: none; None: the "
                                "model's generation_config value.")
    min_tokens: int | None = Field(None, ge=0, description="vLLM's: no EOS and no stop string ends the choice "
                                   "before this many tokens (EOS masked until then); at most max_tokens.")
    ignore_eos: bool | None = Field(None, description="vLLM's: an EOS token does not end the choice (benchmarks' "
                                    "fixed output lengths).")
    use_beam_search: bool | None = Field(None, description="vLLM's; not supported (false only).")

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when `stream` is true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdecimal()):                  # int() also reads '\u0663' as 3
                raise ValueError(f"keys are token ids (strings of the digits 0-9), not {key!r}")
            if len(key) > MAX_ID_DIGITS:                                  # int() refuses over 4300 digits: a 500
                raise ValueError(f"keys are token ids of at most {MAX_ID_DIGITS} digits, not one of {len(key)} digits "
                                 f"({key[:MAX_ID_DIGITS]}...)")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"biases lie in [-{MAX_BIAS}, {MAX_BIAS}], not {bias} (token {key})")
        return v

    def unsupported(self) -> dict[str, str]:
        """field -> why, for the fields set to something this server cannot do (400 naming the first)."""
        return {f: "not supported by this server" for f in ("use_beam_search",) if getattr(self, f)}

    def choices(self) -> int:
        return self.n or 1

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class OpenAIResponse(BaseModel):
    """What every completion and chunk starts with."""
    id: str
    created: int
    model: str
    system_fingerprint: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose keys and values came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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
