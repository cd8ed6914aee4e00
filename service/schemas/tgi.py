"""Text Generation Inference's request and response shapes (docs/openapi.json of TGI 2.x), so
TGI clients (`text-generation`, `huggingface_hub.InferenceClient.text_generation`) work unchanged.

Parameters this server does not implement are accepted at their neutral value (what TGI's clients
send by default) and refused with 422 otherwise."""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..errors import ValidationFailed, self_named

if TYPE_CHECKING:
    from ..settings import Settings

FinishReason = Literal["length", "eos_token", "stop_sequence"]
MAX_SEED = 2**64 - 1                           # torch.Generator.manual_seed's range
OPEN_UNIT = {"exclusiveMinimum": 0, "exclusiveMaximum": 1}    # TGI's range of top_p and typical_p: 0 < p < 1
# field -> (in bounds?, TGI's router's words otherwise: router/src/validation.rs, ValidationError); the
# bounds WCODEC_MAX_BEST_OF, _STOP_SEQUENCES and _TOP_N_TOKENS set are checked where the settings are
# known (GenerateParameters.check_limits, called by inference.sampling_params)
TGI_BOUNDS = {
    "max_new_tokens": (lambda v: v >= 1, "`max_new_tokens` must be strictly positive"),
    "temperature": (lambda v: v > 0, "`temperature` must be strictly positive"),
    "top_k": (lambda v: v > 0, "`top_k` must be strictly positive"),
    "repetition_penalty": (lambda v: v > 0, "`repetition_penalty` must be strictly positive"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
}
CHAT_EXAMPLE = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


# TGI's router reads a request with serde: a field of the wrong JSON type is refused ("20" for
# max_new_tokens, true for an integer, "yes" for a boolean, 20.0 for an integer), where pydantic's
# default would coerce it; a JSON integer for a float is taken, as serde takes it.
STRICT = ConfigDict(strict=True)


class Grammar(BaseModel):
    """TGI's grammar: the generated text follows a JSON schema or a regex."""
    model_config = STRICT
    type: Literal["json", "json_object", "regex", "json_schema"] = Field(description="'json' (or 'json_object'): "
                                                                         "`value` is a JSON schema; 'regex': a "
                                                                         "regex; 'json_schema': {name, schema}.")
    value: dict | str = Field(description="The schema (an object, or its JSON text), the regex, or {name, schema}.")

    @model_validator(mode="after")
    def _named_schema(self) -> Grammar:
        """'json_schema' takes {name, schema}: a value without `schema` (a bare schema, say) was
        taken for the empty schema, and any JSON answered it."""
        if self.type == "json_schema" and not (isinstance(self.value, dict) and "schema" in self.value):
            raise ValueError("a 'json_schema' grammar's value is {name, schema}: it has no `schema`")
        return self

    def spec(self) -> tuple[str, dict | str]:
        """('regex', pattern) or ('schema', schema)."""
        if self.type == "regex":
            return "regex", self.value
        return "schema", self.value["schema"] if self.type == "json_schema" else self.value


class GenerateParameters(BaseModel):
    # JSON's 1e309 parses to inf (and Python's parser takes NaN): no sampling number is one (TGI's
    # router cannot parse them); inf as a temperature turned a grammar's -inf to nan, failing a step
    model_config = STRICT | ConfigDict(allow_inf_nan=False)
    max_new_tokens: int | None = Field(None, ge=1, description="Maximum number of tokens to generate "
                                       "(default: WCODEC_DEFAULT_MAX_NEW_TOKENS).", examples=[20])
    temperature: float | None = Field(None, gt=0, description="The value used to modulate the logits.")
    top_p: float | None = Field(None, description="Top-p value for nucleus sampling (0 < top_p < 1, as TGI's: "
                                "1.0 is refused; OpenAI's routes take it).", json_schema_extra=OPEN_UNIT)
    top_k: int | None = Field(None, gt=0, description="Keep only the top-k tokens when sampling.")
    do_sample: bool = Field(False, description="Sample instead of greedy decoding.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Random sampling seed.")
    stop: list[str] = Field(default_factory=list, description="Stop generating when one of these is generated "
                            "(at most WCODEC_MAX_STOP_SEQUENCES, TGI's --max-stop-sequences: 4 by default).")
    repetition_penalty: float | None = Field(None, gt=0, description="1.0 means no penalty.")
    return_full_text: bool | None = Field(None, description="Prepend the prompt to the generated text.")
    details: bool = Field(True, description="Return generation details.")
    truncate: int | None = Field(None, description="Keep only the last `truncate` input tokens (1 to "
                                 "WCODEC_MAX_INPUT_TOKENS).", json_schema_extra={"minimum": 1})
    decoder_input_details: bool = Field(False, description="details.prefill: each prompt token with its "
                                        "log-probability given the tokens before it (null for the first); "
                                        "not with a stream.")
    best_of: int | None = Field(None, description="Sample this many sequences (1 to WCODEC_MAX_BEST_OF, TGI's "
                                "--max-best-of: 2 by default) and return the one of highest log-probability (the "
                                "others in details.best_of_sequences); needs sampling, and neither a seed nor a "
                                "stream.", json_schema_extra={"minimum": 1})
    typical_p: float | None = Field(None, description="Typical decoding: keep the tokens whose surprisal is "
                                    "nearest the entropy, most typical first, until their probabilities reach "
                                    "this mass; samples.", json_schema_extra=OPEN_UNIT)
    watermark: bool = Field(False, description="TGI's watermark (Kirchenbauer et al. 2023): after each token, "
                            "a green half of the vocabulary (drawn from that token) gains 2.0 in its logits, so "
                            "that a detector can tell the text.")
    top_n_tokens: int | None = Field(None, description="The most likely tokens at each step (0 to "
                                     "WCODEC_MAX_TOP_N_TOKENS, TGI's --max-top-n-tokens: 5 by default), with their "
                                     "log-probabilities (details.top_tokens, a stream event's top_tokens).",
                                     json_schema_extra={"minimum": 0})
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="TGI's: subtracted from each "
                                           "token's logit times its share of the prompt and generated tokens.")
    grammar: Grammar | None = Field(None, description="Constrain the text to a JSON schema or a regex (TGI's "
                                    "grammar, through outlines-core; the end of text only once it is complete).")
    adapter_id: str | None = Field(None, description="Not supported: must be null.")

    @field_validator("top_p", "typical_p")
    @classmethod
    def _open_unit(cls, v: float | None, info: ValidationInfo) -> float | None:
        """TGI's router refuses top_p and typical_p outside (0, 1), 1.0 included, in these words."""
        if v is not None and not 0 < v < 1:
            raise self_named(f"`{info.field_name}` must be > 0.0 and < 1.0")
        return v

    @field_validator(*TGI_BOUNDS, mode="before")
    @classmethod
    def _tgi_bounds(cls, value, info: ValidationInfo):
        """TGI's router's words for a number out of its bounds (the Field's bounds stay, for the schema)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            within, words = TGI_BOUNDS[info.field_name]
            if not within(value):
                raise self_named(words.format(value=value))
        return value

    def unsupported(self) -> list[str]:
        """The parameters set to something this server cannot do."""
        return ["adapter_id"] if self.adapter_id is not None else []

    def check_limits(self, settings: Settings) -> None:
        """TGI's launcher limits (WCODEC_MAX_BEST_OF, _STOP_SEQUENCES, _TOP_N_TOKENS), refused in its
        router's words with the configured bound (router/src/validation.rs: validate_best_of, validate)."""
        best_of, most, stops, top_n = self.best_of, settings.max_best_of, len(self.stop), self.top_n_tokens
        if best_of is not None and most == 1 and best_of != 1:
            raise ValidationFailed("`best_of` != 1 is not allowed for this endpoint", param="best_of")
        if best_of is not None and not 0 < best_of <= most:
            raise ValidationFailed(f"`best_of` must be > 0 and <= {most}. Given: {best_of}", param="best_of")
        if stops > settings.max_stop_sequences:
            raise ValidationFailed(f"`stop` supports up to {settings.max_stop_sequences} stop sequences. "
                                   f"Given: {stops}", param="stop")
        if top_n is not None and not 0 <= top_n <= settings.max_top_n_tokens:
            raise ValidationFailed(f"`top_n_tokens` must be >= 0 and <= {settings.max_top_n_tokens}. "
                                   f"Given: {top_n}", param="top_n_tokens")


class GenerateRequest(BaseModel):
    model_config = STRICT | ConfigDict(protected_namespaces=())
    inputs: str = Field(min_length=1, examples=[CHAT_EXAMPLE])
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    model: str | None = Field(None, description="Model name (a file stem in the store). Default: "
                              "WCODEC_DEFAULT_MODEL, else the only ready model.")

    @field_validator("inputs", mode="before")
    @classmethod
    def _not_empty(cls, value):
        if value == "":
            raise self_named("`inputs` cannot be empty")
        return value


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class SimpleToken(BaseModel):
    """A token of the input (TGI's /tokenize): `text` is input[start:stop], in characters."""
    id: int
    text: str
    start: int
    stop: int


class ChatTokenizeResponse(BaseModel):
    """TGI's /chat_tokenize: the chat template's text and its tokens."""
    tokenize_response: list[SimpleToken]
    templated_text: str


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class SequenceDetails(BaseModel):
    """What TGI details of a generated sequence: the returned one's (Details) or another of best_of's."""
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token]
    top_tokens: list[list[Token]] = Field(default_factory=list, description="with top_n_tokens: each generated "
                                          "token's most likely tokens, most likely first")


class BestOfSequence(SequenceDetails):
    """One of best_of's sequences other than the one returned."""
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = Field(None, description="with best_of > 1: the other "
                                                            "sequences, in the order they were sampled")


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    input_length: int


class StreamResponse(BaseModel):
    index: int
    token: Token
    top_tokens: list[Token] = Field(default_factory=list, description="with top_n_tokens: this step's most "
                                    "likely tokens, most likely first")
    generated_text: str | None = None
    details: StreamDetails | None = None


class Info(BaseModel):
    """TGI's /info (router/src/lib.rs, Info), with model_dtype and model_device_type (TGI's before 2.0),
    max_batch_size and max_top_n_tokens (TGI's launcher flags, which its Info does not report) beside it."""
    model_config = ConfigDict(protected_namespaces=())
    model_id: str
    model_sha: str | None = None
    model_dtype: str | None
    model_device_type: str
    model_pipeline_tag: str | None = "text-generation"
    max_concurrent_requests: int = Field(description="TGI's: the requests in flight (running or waiting) at "
                                         "most before 429: WCODEC_MAX_BATCH_SIZE running rows + "
                                         "WCODEC_MAX_QUEUE waiting")
    max_best_of: int = Field(description="WCODEC_MAX_BEST_OF: the largest `best_of` the TGI routes take")
    max_stop_sequences: int = Field(description="WCODEC_MAX_STOP_SEQUENCES: the most `stop` sequences the TGI "
                                    "routes take")
    max_top_n_tokens: int = Field(description="WCODEC_MAX_TOP_N_TOKENS: the largest `top_n_tokens` the TGI "
                                  "routes take")
    max_input_tokens: int
    max_total_tokens: int
    max_batch_size: int
    validation_workers: int = Field(description="the threads that tokenize prompts (TGI's validation workers)")
    max_client_batch_size: int = Field(description="the most prompts one request carries (/v1/completions' "
                                       "list, as TGI's)")
    router: str = "wcodec"
    version: str
    sha: str | None = None
    docker_label: str | None = None
